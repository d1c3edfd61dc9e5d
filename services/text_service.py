"""The Tokenizer and TextGeneration servicers.

Generate: tokenize the prompt -> one upstream `Decoder.Decode` stream -> per response, the new
ids go through the request's incremental detokenizer -> a TextDelta -> at Finished, flush the
detokenizer and send TextFinished with the decoder's reason, usage and stop_token_id.
`Complete` runs the very same generator and collects it, so the two cannot disagree.
Leaving the generator early (client cancel, deadline, error) cancels the upstream call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import AsyncIterator, Callable

import grpc

from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2, text_pb2_grpc
from services import validation
from services.admission import Admission
from services.channels import cancelling_aio
from services.errors import InvalidArgument, ServiceError, grpc_errors
from services.metrics import Metrics
from tokenizer_svc.chat import ChatMessage, ChatTemplateError
from tokenizer_svc.stop_strings import StopStringMatcher
from tokenizer_svc.text_stream import TextStream
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")


def check_token_ids(ids, vocab_size: int, field: str = "token_ids") -> None:
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"{token_id} is not < the vocabulary size {vocab_size}")


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256


def chat_messages(chat: text_pb2.Chat) -> list[ChatMessage]:
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    return [ChatMessage(m.role, m.content) for m in chat.messages]


def encode_chat(tokenizer: TextTokenizer, chat: text_pb2.Chat) -> list[int]:
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        return tokenizer.encode_chat(chat_messages(chat), add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as error:
        raise InvalidArgument("chat", str(error)) from None


def stop_matcher(request: text_pb2.GenerateRequest) -> StopStringMatcher | None:
    stops = list(request.stop_strings)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop_strings", f"at most {MAX_STOP_STRINGS} (got {len(stops)})")
    for i, stop in enumerate(stops):
        if not 1 <= len(stop) <= MAX_STOP_STRING_LENGTH:
            raise InvalidArgument(f"stop_strings[{i}]", f"must be 1 to {MAX_STOP_STRING_LENGTH} characters")
    return StopStringMatcher(stops, request.include_stop_string) if stops else None


def text_finished(
    finished: decode_pb2.Finished | None, stop_string: str | None, prompt_tokens: int, completion_tokens: int
) -> text_pb2.TextFinished:
    """The decoder's Finished carried over, or STOP when a stop string ended the text first."""
    has_stop_id = finished is not None and finished.HasField("stop_token_id")
    return text_pb2.TextFinished(
        reason=decode_pb2.FINISH_REASON_STOP if stop_string is not None else finished.reason,
        usage=decode_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
        stop_token_id=finished.stop_token_id if has_stop_id else None,
        stop_string=stop_string,
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
            check_token_ids(request.token_ids, self.tokenizer.vocab_size)
            text = self.tokenizer.decode(request.token_ids, keep_special_tokens=request.keep_special_tokens)
            return text_pb2.DetokenizeResponse(text=text)


# Where decode responses come from: the remote Decoder (gRPC) or, for `generate --local`, an
# in-process engine. Closing the iterator early must cancel the decode.
DecodeFn = Callable[[decode_pb2.DecodeRequest, "float | None"], AsyncIterator[decode_pb2.DecodeResponse]]


def remote_decode(stub: decode_pb2_grpc.DecoderStub) -> DecodeFn:
    def decode(request: decode_pb2.DecodeRequest, timeout: float | None):
        return cancelling_aio(stub.Decode(request, timeout=timeout))

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

    def _decode_request(self, request: text_pb2.GenerateRequest) -> decode_pb2.DecodeRequest:
        request_id = validation.request_id_of(request.request_id)
        if request.WhichOneof("input") == "chat":
            ids = encode_chat(self.tokenizer, request.chat)
            validation.prompt_ids(ids, self.info, field="chat")
        else:
            if not request.prompt:
                raise InvalidArgument("prompt", "must not be empty (or give chat instead)")
            ids = self.tokenizer.encode(request.prompt)
            validation.prompt_ids(ids, self.info, field="prompt")
        return decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=request.sampling, stopping=request.stopping
        )

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        """The one generation path: Generate streams it, Complete collects it, `--local` runs it.

        Each received id goes through the detokenizer, then the stop-string matcher, one at a
        time, so a stop string's usage counts exactly the ids up to the one that completed it.
        A stop string ends the stream here; leaving the `aclosing` block cancels the decode.
        """
        upstream = self._decode_request(request)
        stream = TextStream(
            self.tokenizer.detokenizer(upstream.prompt_token_ids, request.keep_special_tokens), stop_matcher(request)
        )
        received = 0
        async with contextlib.aclosing(self.decode(upstream, timeout)) as responses:
            async for response in responses:
                last = response.events[-1]
                finished = last.finished if last.HasField("finished") else None
                ids = [e.token.id for e in response.events if e.HasField("token")]
                chunk = stream.push(ids)
                ids = ids[: chunk.consumed]
                text = chunk.text
                if finished is not None and chunk.stop_string is None:
                    chunk = stream.finish()
                    text += chunk.text
                received += len(ids)
                if ids or text:
                    yield text_pb2.GenerateResponse(delta=text_pb2.TextDelta(text=text, token_ids=ids))
                if finished is None and chunk.stop_string is None:
                    continue
                if chunk.stop_string is None and finished.usage.completion_tokens != received:
                    log.error(
                        "request_id=%s usage mismatch: decoder counted %d tokens, %d received",
                        upstream.request_id, finished.usage.completion_tokens, received,
                    )
                    raise ServiceError(grpc.StatusCode.INTERNAL, "token accounting mismatch with the decoder")
                yield text_pb2.GenerateResponse(
                    finished=text_finished(finished, chunk.stop_string, len(upstream.prompt_token_ids), received)
                )
                return  # after a stop string, leaving the block cancels the decode
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended without Finished")

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
