"""The decode service process: a model, its engine, and a grpc.aio server in front."""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.engine import Engine, EngineConfig
from engine.model import Model
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode_service import DecoderServicer
from services.server import RunningServer, start_server

DECODER_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name  # tokenwire.decode.v1.Decoder


@dataclass
class DecodeServer:
    engine: Engine
    running: RunningServer

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float | None = None) -> None:
        await self.running.set_serving([DECODER_SERVICE], False)
        await self.running.server.stop(grace_s)
        self.engine.stop()


async def start_decode_server(
    model: Model, engine_config: EngineConfig = EngineConfig(), host: str = "127.0.0.1", port: int = 0
) -> DecodeServer:
    """Warm the model up, start its engine, then serve (port 0 picks a free port)."""
    model.warm_up()
    engine = Engine(model, engine_config)
    engine.start()
    servicer = DecoderServicer(AsyncEngine(engine), model.info)
    running = await start_server(
        lambda server: decode_pb2_grpc.add_DecoderServicer_to_server(servicer, server), [DECODER_SERVICE], host, port
    )
    return DecodeServer(engine, running)
