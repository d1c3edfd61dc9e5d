"""Python clients for both services, sync and asyncio.

    with TextClient("localhost:50052") as client:
        for delta_text in client.stream_text("Hello"):  ...
        completion = client.complete("Hello", max_output_tokens=16)

Requests are built by `generate_request` / `decode_request` from keyword arguments; results
are the protobuf messages of the contract (see protos/), so nothing is lost in translation.
Every client takes `tls=ClientTlsConfig(ca, cert, key)` for TLS / mutual TLS and `token=` for a
server that requires a bearer token (sent only over TLS).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Iterable, Iterator, Sequence

from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2, text_pb2_grpc
from services.channels import cancelling, cancelling_aio, open_channel
from services.security import ClientTlsConfig


def _params(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    seed: int | None = None,
    max_output_tokens: int | None = None,
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    min_output_tokens: int = 0,
) -> tuple[decode_pb2.SamplingParams, decode_pb2.StoppingCriteria]:
    sampling = decode_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    stopping = decode_pb2.StoppingCriteria(
        max_output_tokens=max_output_tokens,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        min_output_tokens=min_output_tokens,
    )
    return sampling, stopping


def generate_request(
    prompt: str | Sequence[int] = "",
    *,
    chat: Sequence[tuple[str, str]] | None = None,
    request_id: str = "",
    keep_special_tokens: bool = False,
    stop_strings: Iterable[str] = (),
    include_stop_string: bool = False,
    constraint: decode_pb2.Constraint | None = None,
    **params,
) -> text_pb2.GenerateRequest:
    """A GenerateRequest for a prompt (text, or its token ids as they are), or for a chat given as
    (role, content) pairs, its output held to `constraint` when given. `params` are SamplingParams
    and StoppingCriteria fields by name."""
    sampling, stopping = _params(**params)
    request = text_pb2.GenerateRequest(
        request_id=request_id,
        constraint=constraint,
        sampling=sampling,
        stopping=stopping,
        keep_special_tokens=keep_special_tokens,
        stop_strings=list(stop_strings),
        include_stop_string=include_stop_string,
    )
    if chat is not None:
        request.chat.CopyFrom(text_pb2.Chat(messages=[text_pb2.ChatMessage(role=r, content=c) for r, c in chat]))
    elif isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.ids.extend(prompt)
    return request


def decode_request(
    prompt_token_ids: Iterable[int], *, request_id: str = "", return_logprobs: bool = False,
    constraint: decode_pb2.Constraint | None = None, **params,
) -> decode_pb2.DecodeRequest:
    """A DecodeRequest (its output held to `constraint` when given); `params` are SamplingParams
    and StoppingCriteria fields by name."""
    sampling, stopping = _params(**params)
    return decode_pb2.DecodeRequest(
        request_id=request_id,
        constraint=constraint,
        prompt_token_ids=list(prompt_token_ids),
        sampling=sampling,
        stopping=stopping,
        return_logprobs=return_logprobs,
    )


class TextClient:
    """Blocking client for the text service (Tokenizer + TextGeneration)."""

    def __init__(
        self, target: str, timeout: float | None = None, tls: ClientTlsConfig | None = None, token: str | None = None
    ) -> None:
        self.channel = open_channel(target, tls, token, asynchronous=False)
        self.timeout = timeout
        self._tokenizer = text_pb2_grpc.TokenizerStub(self.channel)
        self._generation = text_pb2_grpc.TextGenerationStub(self.channel)

    def __enter__(self) -> "TextClient":
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = text_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._tokenizer.Tokenize(request, timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: Iterable[int], keep_special_tokens: bool = False) -> str:
        request = text_pb2.DetokenizeRequest(token_ids=list(token_ids), keep_special_tokens=keep_special_tokens)
        return self._tokenizer.Detokenize(request, timeout=self.timeout).text

    def generate(self, prompt: str | Sequence[int] = "", **kwargs) -> Iterator[text_pb2.GenerateResponse]:
        """Stream TextDelta events then one TextFinished. Breaking out early cancels the request.
        Keyword arguments are those of `generate_request` (chat=[(role, content), ...] for chat input)."""
        return cancelling(self._generation.Generate(generate_request(prompt, **kwargs), timeout=self.timeout))

    def complete(self, prompt: str | Sequence[int] = "", **kwargs) -> text_pb2.Completion:
        return self._generation.Complete(generate_request(prompt, **kwargs), timeout=self.timeout)


class AsyncTextClient:
    """asyncio client for the text service."""

    def __init__(
        self, target: str, timeout: float | None = None, tls: ClientTlsConfig | None = None, token: str | None = None
    ) -> None:
        self.channel = open_channel(target, tls, token)
        self.timeout = timeout
        self._tokenizer = text_pb2_grpc.TokenizerStub(self.channel)
        self._generation = text_pb2_grpc.TextGenerationStub(self.channel)

    async def __aenter__(self) -> "AsyncTextClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        request = text_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._tokenizer.Tokenize(request, timeout=self.timeout)).token_ids)

    async def detokenize(self, token_ids: Iterable[int], keep_special_tokens: bool = False) -> str:
        request = text_pb2.DetokenizeRequest(token_ids=list(token_ids), keep_special_tokens=keep_special_tokens)
        return (await self._tokenizer.Detokenize(request, timeout=self.timeout)).text

    def generate(self, prompt: str | Sequence[int] = "", **kwargs) -> AsyncIterator[text_pb2.GenerateResponse]:
        """Stream TextDelta events then one TextFinished; keyword arguments as `generate_request`."""
        return self.stream(generate_request(prompt, **kwargs))

    def stream(self, request: text_pb2.GenerateRequest) -> AsyncIterator[text_pb2.GenerateResponse]:
        """Generate for a ready-made request. Closing the iterator early cancels the call."""
        return cancelling_aio(self._generation.Generate(request, timeout=self.timeout))

    async def complete(self, prompt: str | Sequence[int] = "", **kwargs) -> text_pb2.Completion:
        return await self._generation.Complete(generate_request(prompt, **kwargs), timeout=self.timeout)


class DecodeClient:
    """Blocking client for the decode service."""

    def __init__(
        self, target: str, timeout: float | None = None, tls: ClientTlsConfig | None = None, token: str | None = None
    ) -> None:
        self.channel = open_channel(target, tls, token, asynchronous=False)
        self.timeout = timeout
        self._stub = decode_pb2_grpc.DecoderStub(self.channel)

    def __enter__(self) -> "DecodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()

    def model_info(self) -> decode_pb2.ModelInfo:
        return self._stub.GetModelInfo(decode_pb2.GetModelInfoRequest(), timeout=self.timeout)

    def decode(self, prompt_token_ids: Iterable[int], **kwargs) -> Iterator[decode_pb2.DecodeEvent]:
        """Stream events (Token..., then Finished). Breaking out early cancels the request."""
        call = self._stub.Decode(decode_request(prompt_token_ids, **kwargs), timeout=self.timeout)
        with contextlib.closing(cancelling(call)) as responses:
            for response in responses:
                yield from response.events


class AsyncDecodeClient:
    """asyncio client for the decode service."""

    def __init__(
        self, target: str, timeout: float | None = None, tls: ClientTlsConfig | None = None, token: str | None = None
    ) -> None:
        self.channel = open_channel(target, tls, token)
        self.timeout = timeout
        self._stub = decode_pb2_grpc.DecoderStub(self.channel)

    async def __aenter__(self) -> "AsyncDecodeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def model_info(self) -> decode_pb2.ModelInfo:
        return await self._stub.GetModelInfo(decode_pb2.GetModelInfoRequest(), timeout=self.timeout)

    async def decode(self, prompt_token_ids: Iterable[int], **kwargs) -> AsyncIterator[decode_pb2.DecodeEvent]:
        call = self._stub.Decode(decode_request(prompt_token_ids, **kwargs), timeout=self.timeout)
        async with contextlib.aclosing(cancelling_aio(call)) as responses:
            async for response in responses:
                for event in response.events:
                    yield event
