"""Shared fixtures: real servers on loopback ports, driven by the scripted model."""

from __future__ import annotations

import grpc
import pytest

from engine.engine import EngineConfig
from engine.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2_grpc
from services.decode_server import start_decode_server


@pytest.fixture
def scripted_model() -> ScriptedModel:
    # vocab 1000, EOS 2, 4 slots, context 64: small enough to reason about by hand
    return ScriptedModel(vocab_size=1000, eos_token_ids=frozenset({2}), max_batch_size=4, max_context_length=64)


@pytest.fixture
async def decode_server(scripted_model):
    server = await start_decode_server(scripted_model, EngineConfig(max_queue_size=8))
    yield server
    await server.stop(None)


@pytest.fixture
async def decoder(decode_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode_server.port}") as channel:
        yield decode_pb2_grpc.DecoderStub(channel)
