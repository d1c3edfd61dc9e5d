"""Running a grpc.aio server: health, reflection, binding, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("tokenwire.server")


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, service_names: list[str], serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *service_names]:
            await self.health.set(name, status)


async def start_server(
    add_servicers, service_names: list[str], host: str, port: int, options: list[tuple[str, int]] | None = None
) -> RunningServer:
    """Start a server with `add_servicers(server)` plus health and reflection; port 0 picks a free port."""
    server = grpc.aio.server(options=options or [])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    await server.start()
    running = RunningServer(server, bound, health_servicer)
    await running.set_serving(service_names, True)
    return running


async def serve_until_signal(running: RunningServer, service_names: list[str], grace_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then stop taking requests and let in-flight ones finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining for up to %.1f s", grace_s)
    await running.set_serving(service_names, False)
    await running.server.stop(grace_s)
