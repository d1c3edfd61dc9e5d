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

from engine.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2, text_pb2_grpc
from services import validation
from services.errors import InvalidArgument, ServiceError, grpc_errors
from tokenizer_svc.tokenizer import TextTokenizer

log = logging.getLogger("tokenwire.text")


def check_token_ids(ids, vocab_size: int, field: str = "token_ids") -> None:
    for i, token_id in enumerate(ids):
        if token_id >= vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"{token_id} is not < the vocabulary size {vocab_size}")


class TokenizerServicer(text_pb2_grpc.TokenizerServicer):
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer

    @grpc_errors
    async def Tokenize(self, request: text_pb2.TokenizeRequest, context):
        ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return text_pb2.TokenizeResponse(token_ids=ids)

    @grpc_errors
    async def Detokenize(self, request: text_pb2.DetokenizeRequest, context):
        check_token_ids(request.token_ids, self.tokenizer.vocab_size)
        text = self.tokenizer.decode(request.token_ids, keep_special_tokens=request.keep_special_tokens)
        return text_pb2.DetokenizeResponse(text=text)


# Where decode responses come from: the remote Decoder (gRPC) or, for `generate --local`, an
# in-process engine. Closing the iterator early must cancel the decode.
DecodeFn = Callable[[decode_pb2.DecodeRequest, "float | None"], AsyncIterator[decode_pb2.DecodeResponse]]


def remote_decode(stub: decode_pb2_grpc.DecoderStub) -> DecodeFn:
    async def decode(request: decode_pb2.DecodeRequest, timeout: float | None):
        call = stub.Decode(request, timeout=timeout)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op once the call is done; cancels the upstream Decode otherwise

    return decode


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    def __init__(self, tokenizer: TextTokenizer, decode: DecodeFn, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self.info = info

    def _decode_request(self, request: text_pb2.GenerateRequest) -> decode_pb2.DecodeRequest:
        request_id = validation.request_id_of(request.request_id)
        if not request.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        ids = self.tokenizer.encode(request.prompt)
        validation.prompt_ids(ids, self.info, field="prompt")
        return decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=request.sampling, stopping=request.stopping
        )

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        """The one generation path: Generate streams it, Complete collects it, `--local` runs it."""
        upstream = self._decode_request(request)
        detokenizer = self.tokenizer.detokenizer(upstream.prompt_token_ids, request.keep_special_tokens)
        received = 0
        async with contextlib.aclosing(self.decode(upstream, timeout)) as responses:
            async for response in responses:
                ids = [e.token.id for e in response.events if e.HasField("token")]
                finished = response.events[-1].finished if response.events[-1].HasField("finished") else None
                received += len(ids)
                text = detokenizer.push(ids) if ids else ""
                if finished is not None:
                    text += detokenizer.finish()
                if ids or text:
                    yield text_pb2.GenerateResponse(delta=text_pb2.TextDelta(text=text, token_ids=ids))
                if finished is not None:
                    if finished.usage.completion_tokens != received:
                        log.error(
                            "request_id=%s usage mismatch: decoder counted %d tokens, %d received",
                            upstream.request_id, finished.usage.completion_tokens, received,
                        )
                        raise ServiceError(grpc.StatusCode.INTERNAL, "token accounting mismatch with the decoder")
                    yield text_pb2.GenerateResponse(
                        finished=text_pb2.TextFinished(
                            reason=finished.reason,
                            usage=finished.usage,
                            stop_token_id=finished.stop_token_id if finished.HasField("stop_token_id") else None,
                        )
                    )
                    return
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended without Finished")

    @grpc_errors
    async def Generate(self, request, context):
        async with contextlib.aclosing(self.generate(request, context.time_remaining())) as responses:
            async for response in responses:
                yield response

    @grpc_errors
    async def Complete(self, request, context):
        return await collect(self.generate(request, context.time_remaining()))


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
        return completion
