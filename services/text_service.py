"""The Tokenizer and TextGeneration servicers: protobuf in and out around tokenizer_svc.

Generate: GenerateRequest -> `tokenizer_svc.generation.prepare_request` (the prompt's ids,
validated) -> one decode of those ids (services.decode_stream_client: a request on the text
service's one `Decoder.DecodeStream`, whose entries become engine events; `engine_decode`: an
in-process engine's own events) ->
`generate_text` -> each TextDelta / TextFinished as a GenerateResponse. `Complete` collects the
very same stream, and `tokenwire generate --local` runs it too, so none of them can disagree.
Leaving the stream early (client cancel, deadline, error) closes `generate_text`, which closes
the decode: the upstream call or the engine request is cancelled.

Errors pass on to `grpc_errors` (services.errors maps them): InvalidArgument; the decoder
breaking its contract (DecoderFault) is INTERNAL; a decode stream that ends without Finished is
UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncGenerator, AsyncIterator, Callable, Sequence

from engine.core.async_engine import AsyncEngine
from engine.core.errors import check_token_ids
from engine.core.events import Event, Finished
from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2, text_pb2_grpc
from services import validation
from services.admission import Admission
from services.decode_events import event_to_pb
from services.errors import grpc_errors
from services.metrics import Metrics
from tokenizer_svc import generation
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.generation import (
    Chat,
    TextDelta,
    TextEvent,
    generate_text,
    prepare_request,
)
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")


# --- protobuf <-> tokenizer_svc ----------------------------------------------------------------


def chat_from_pb(chat: text_pb2.Chat) -> Chat:
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return Chat(tuple(ChatMessage(m.role, m.content) for m in chat.messages), add_generation_prompt)


def encode_chat(tokenizer: TextTokenizer, chat: text_pb2.Chat) -> list[int]:
    """A Chat message's prompt ids, as Tokenize and Generate make them (InvalidArgument if refused)."""
    return generation.encode_chat(tokenizer, chat_from_pb(chat))


def prompt_from_pb(request: text_pb2.GenerateRequest) -> str | Chat:
    return chat_from_pb(request.chat) if request.WhichOneof("input") == "chat" else request.prompt


def response_to_pb(event: TextEvent) -> text_pb2.GenerateResponse:
    if isinstance(event, TextDelta):
        return text_pb2.GenerateResponse(delta=text_pb2.TextDelta(text=event.text, token_ids=event.token_ids))
    decoded = event_to_pb(Finished(event.reason, event.usage)).finished  # the decode proto's reason and usage
    return text_pb2.GenerateResponse(
        finished=text_pb2.TextFinished(
            reason=decoded.reason,
            usage=decoded.usage,
            stop_token_id=event.stop_token_id,
            stop_string=event.stop_string,
        )
    )


class TokenizerServicer(text_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizer: TextTokenizer, admission: Admission | None = None) -> None:
        self.tokenizer = tokenizer
        self.admission = admission or Admission()

    @grpc_errors
    async def Tokenize(self, request: text_pb2.TokenizeRequest, context):
        with self.admission.admit():
            if request.WhichOneof("input") == "chat":
                ids = encode_chat(self.tokenizer, request.chat)
            else:
                ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            return text_pb2.TokenizeResponse(token_ids=ids)

    @grpc_errors
    async def Detokenize(self, request: text_pb2.DetokenizeRequest, context):
        with self.admission.admit():
            check_token_ids(request.token_ids, self.tokenizer.vocab_size, "token_ids")
            text = self.tokenizer.decode(request.token_ids, keep_special_tokens=request.keep_special_tokens)
            return text_pb2.DetokenizeResponse(text=text)


# --- where the decode runs ---------------------------------------------------------------------

# A DecodeRequest (and the caller's remaining time) -> the engine's events, one list per decoder
# step: from the remote Decoder (gRPC) or, for `generate --local`, an in-process engine. Closing
# the iterator early must cancel the decode.
DecodeFn = Callable[[decode_pb2.DecodeRequest, "float | None"], AsyncGenerator[Sequence[Event], None]]


def engine_decode(engine: AsyncEngine, info: ModelInfo) -> DecodeFn:
    """The engine's events without a socket, validated as the Decoder validates them. The engine
    has no deadline of its own: `timeout` is not applied here."""

    def decode(request: decode_pb2.DecodeRequest, timeout: float | None):
        return engine.stream(validation.decode_request(request, info))

    return decode


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    def __init__(
        self,
        tokenizer: TextTokenizer,
        decode: DecodeFn,
        info: ModelInfo,
        admission: Admission | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self.info = info
        self.admission = admission or Admission()
        self.metrics = metrics or Metrics()

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        """The one generation path: Generate streams it, Complete collects it, `--local` runs it."""
        request_id = validation.request_id_of(request.request_id)
        text_request = prepare_request(
            self.tokenizer,
            self.info,
            prompt_from_pb(request),
            stop_strings=request.stop_strings,
            include_stop_string=request.include_stop_string,
            keep_special_tokens=request.keep_special_tokens,
        )
        upstream = decode_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=text_request.prompt_token_ids,
            sampling=request.sampling,
            stopping=request.stopping,
        )
        # A DecoderFault (INTERNAL) or StreamEndedWithoutFinished (UNAVAILABLE) propagates to
        # services.errors, which maps it; the request log line carries the request id and code.
        steps = self.decode(upstream, timeout)
        async with contextlib.aclosing(generate_text(self.tokenizer.vocabulary, text_request, steps)) as events:
            async for event in events:
                yield response_to_pb(event)

    async def _served(self, request: text_pb2.GenerateRequest, context) -> AsyncIterator[text_pb2.GenerateResponse]:
        """`generate`, admitted (or UNAVAILABLE), timed and counted, with the client's deadline."""
        with self.admission.admit(), self.metrics.track(request.request_id) as tracker:
            request.request_id = tracker.request_id = validation.request_id_of(request.request_id)
            async with contextlib.aclosing(self.generate(request, context.time_remaining())) as responses:
                async for response in responses:
                    tracker.generate_response(response)
                    yield response

    @grpc_errors
    async def Generate(self, request, context):
        async with contextlib.aclosing(self._served(request, context)) as responses:
            async for response in responses:
                yield response

    @grpc_errors
    async def Complete(self, request, context):
        return await collect(self._served(request, context))


async def collect(responses: AsyncIterator[text_pb2.GenerateResponse]) -> text_pb2.Completion:
    """A Generate stream collected into a Completion."""
    completion = text_pb2.Completion()
    async with contextlib.aclosing(responses):
        async for response in responses:
            if response.HasField("delta"):
                completion.text += response.delta.text
                completion.token_ids.extend(response.delta.token_ids)
            else:
                f = response.finished
                completion.reason = f.reason
                completion.usage.CopyFrom(f.usage)
                if f.HasField("stop_token_id"):
                    completion.stop_token_id = f.stop_token_id
                if f.HasField("stop_string"):
                    completion.stop_string = f.stop_string
        return completion
