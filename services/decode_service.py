"""The Decoder servicer: validate, stream the engine's events as protobuf, nothing else.

`Decode` serves one request per RPC; `DecodeStream` many over one RPC (services.decode_stream).
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import grpc

from engine.core.async_engine import AsyncEngine
from engine.core.constrained import ConstraintCompiler
from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services import validation
from services.admission import Admission
from services.decode_events import add_events_pb
from services.decode_stream import DecodeStreamSession
from services.errors import ServiceError, grpc_errors
from services.metrics import Metrics
from services.replicas import BATCH_KEY, REPLICA_ID_KEY
from services.sent_together import sent_together


def model_info_to_pb(info: ModelInfo) -> decode_pb2.ModelInfo:
    return decode_pb2.ModelInfo(
        model_id=info.model_id,
        vocab_size=info.vocab_size,
        max_context_length=info.max_context_length,
        eos_token_ids=sorted(info.eos_token_ids),
        max_batch_size=info.max_batch_size,
    )


class DecoderServicer(decode_pb2_grpc.DecoderServicer):
    """Serves nothing until `attach` gives it a warmed-up engine; `admission` gates every call.
    Requests' constraints are compiled against `tokenizer_json` (the served model's tokenizer
    file; its vocabulary is built on a thread once the model is ready); without one, every
    constraint is refused with INVALID_ARGUMENT."""

    def __init__(self, admission: Admission, metrics: Metrics, tokenizer_json: str | Path | None = None) -> None:
        self.admission = admission
        self.metrics = metrics
        self.tokenizer_json = tokenizer_json
        self.info: ModelInfo | None = None
        self.engine: AsyncEngine | None = None
        self.constraints: ConstraintCompiler | None = None
        # sent as initial metadata on GetModelInfo and DecodeStream: which replica answered
        self.replica_id = uuid.uuid4().hex[:12]

    def attach(self, engine: AsyncEngine, info: ModelInfo) -> None:
        self.info = info
        self.engine = engine
        self.constraints = ConstraintCompiler(self.tokenizer_json, info.vocab_size, info.eos_token_ids)
        self.constraints.warm()  # validation runs on the event loop: the vocabulary is built off it

    @grpc_errors
    async def Decode(self, request: decode_pb2.DecodeRequest, context):
        async with contextlib.aclosing(sent_together(self._decode(request))) as responses:
            async for response in responses:
                yield response

    async def _decode(self, request: decode_pb2.DecodeRequest):
        with self.admission.admit(), self.metrics.track(request.request_id, len(request.prompt_token_ids)) as tracker:
            request.request_id = tracker.request_id = validation.request_id_of(request.request_id)
            engine_request = validation.decode_request(request, self.info, self.constraints)
            async with contextlib.aclosing(self.engine.stream(engine_request)) as steps:
                async for events in steps:  # one response per engine step for this request (or several: coalesced)
                    response = decode_pb2.DecodeResponse()
                    add_events_pb(events, response.events)
                    tracker.decode_response(response)
                    yield response

    @grpc_errors
    async def DecodeStream(self, request_iterator, context):
        """Many requests over one stream (services.decode_stream; the proto's invariants 10-15 and 17).
        Refused as a whole (UNAVAILABLE) only while the model loads or the engine is down;
        while draining it stays open for its live requests and refuses new starts one by one.
        Its headers (with this replica's id) go at once: they commit the call for the client's
        retry policy (services.replicas), tell it where the stream landed, and that batches are read."""
        await context.send_initial_metadata(((REPLICA_ID_KEY, self.replica_id), (BATCH_KEY, "1")))
        if self.engine is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self.admission.closed_reason or "the model is still loading")
        session = DecodeStreamSession(self.engine, self.info, self.admission, self.metrics, self.constraints)
        async with contextlib.aclosing(session.run(request_iterator)) as responses:
            async for response in responses:
                yield response

    @grpc_errors
    async def GetModelInfo(self, request, context):
        await context.send_initial_metadata(((REPLICA_ID_KEY, self.replica_id),))
        with self.admission.admit():
            return model_info_to_pb(self.info)
