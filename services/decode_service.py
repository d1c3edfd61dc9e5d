"""The Decoder servicer: validate, stream the engine's events as protobuf, nothing else."""

from __future__ import annotations

import contextlib

from engine.core.async_engine import AsyncEngine
from engine.core.events import Event, Finished, FinishReason, Token, Usage
from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services import validation
from services.admission import Admission
from services.errors import grpc_errors
from services.metrics import Metrics

_REASONS = {FinishReason.STOP: decode_pb2.FINISH_REASON_STOP, FinishReason.LENGTH: decode_pb2.FINISH_REASON_LENGTH}
_REASONS_FROM_PB = {pb: reason for reason, pb in _REASONS.items()}


def event_to_pb(event: Event) -> decode_pb2.DecodeEvent:
    if isinstance(event, Token):
        return decode_pb2.DecodeEvent(token=decode_pb2.Token(id=event.id, logprob=event.logprob))
    return decode_pb2.DecodeEvent(
        finished=decode_pb2.Finished(
            reason=_REASONS[event.reason],
            usage=decode_pb2.Usage(
                prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens
            ),
            stop_token_id=event.stop_token_id,
        )
    )


def event_from_pb(pb: decode_pb2.DecodeEvent) -> Event:
    """The inverse of `event_to_pb`: what a remote Decoder streamed, as the engine's own event.
    ValueError for an event the stream contract rules out (unset, or an UNSPECIFIED reason)."""
    kind = pb.WhichOneof("event")
    if kind == "token":
        return Token(pb.token.id, pb.token.logprob if pb.token.HasField("logprob") else None)
    if kind != "finished":
        raise ValueError("the decoder sent an event that is neither a token nor a finish")
    finished = pb.finished
    if finished.reason not in _REASONS_FROM_PB:
        raise ValueError(f"the decoder sent finish reason {finished.reason}, which is neither STOP nor LENGTH")
    return Finished(
        _REASONS_FROM_PB[finished.reason],
        Usage(finished.usage.prompt_tokens, finished.usage.completion_tokens),
        finished.stop_token_id if finished.HasField("stop_token_id") else None,
    )


def model_info_to_pb(info: ModelInfo) -> decode_pb2.ModelInfo:
    return decode_pb2.ModelInfo(
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        max_context_length=info.max_context_length,
        eos_token_ids=sorted(info.eos_token_ids),
        max_batch_size=info.max_batch_size,
    )


class DecoderServicer(decode_pb2_grpc.DecoderServicer):
    """Serves nothing until `attach` gives it a warmed-up engine; `admission` gates every call."""

    def __init__(self, admission: Admission, metrics: Metrics) -> None:
        self.admission = admission
        self.metrics = metrics
        self.info: ModelInfo | None = None
        self.engine: AsyncEngine | None = None

    def attach(self, engine: AsyncEngine, info: ModelInfo) -> None:
        self.info = info
        self.engine = engine

    @grpc_errors
    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        with self.admission.admit(), self.metrics.track(request.request_id, len(request.prompt_token_ids)) as tracker:
            request.request_id = tracker.request_id = validation.request_id_of(request.request_id)
            engine_request = validation.decode_request(request, self.info)
            async with contextlib.aclosing(self.engine.stream(engine_request)) as steps:
                async for events in steps:  # one response per engine step for this request
                    response = decode_pb2.DecodeResponse(events=[event_to_pb(e) for e in events])
                    tracker.decode_response(response)
                    yield response

    @grpc_errors
    async def GetModelInfo(self, request, context):
        with self.admission.admit():
            return model_info_to_pb(self.info)
