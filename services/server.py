"""Running a grpc.aio server: transport options, health, reflection, interceptors, drain.

Health: the overall service ("") is liveness and stays SERVING while the process is up, even
with a full queue; each full service name is readiness, set by the service's own monitor.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.admission import Admission
from services.errors import ParseRequestsInHandler
from services.metrics import Metrics, StatusCodeInterceptor
from services.security import BearerTokenInterceptor, ServerTlsConfig, check_server_auth

log = logging.getLogger("tokenwire.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    """How a server listens. Built once from flags; binds loopback unless told otherwise."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    tls: ServerTlsConfig | None = None
    auth_token: str | None = None  # bearer token required on every RPC but health and reflection
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 0  # per connection; 0 = gRPC's default (unlimited)
    # After this long (gRPC adds +-10 % jitter) a connection gets GOAWAY, so that clients
    # re-resolve and find new replicas; its open calls run on to their end. 0 = never.
    max_connection_age_s: float = 0.0

    def grpc_options(self) -> list[tuple[str, int]]:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]
        if self.max_concurrent_streams:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        if self.max_connection_age_s:
            options.append(("grpc.max_connection_age_ms", max(1, round(self.max_connection_age_s * 1000))))
        return options


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]
    tasks: list[asyncio.Task] = field(default_factory=list)  # background monitors, cancelled at stop
    _readiness: dict[str, int] = field(default_factory=dict)

    async def stop(self, grace_s: float | None) -> None:
        for task in self.tasks:
            task.cancel()
        await self.set_ready(False)
        await self.server.stop(grace_s)

    async def set_ready(self, serving: bool, names: list[str] | None = None) -> None:
        """Set readiness of `names` (default: all of this server's services); logs changes."""
        status = SERVING if serving else NOT_SERVING
        for name in names or self.service_names:
            if self._readiness.get(name) != status:
                self._readiness[name] = status
                log.info("readiness %s: %s", name, "SERVING" if serving else "NOT_SERVING")
                await self.health.set(name, status)


async def start_server(add_servicers, service_names: list[str], options: ServerOptions, metrics: Metrics) -> RunningServer:
    """Start a server with `add_servicers(server)` plus health and reflection. Liveness is
    SERVING from the start; readiness starts NOT_SERVING until the caller says otherwise."""
    check_server_auth(options.auth_token, options.tls, options.host)  # also for servers built in code
    # Outermost first: count every RPC's status, then refuse unparsable messages, then check auth.
    interceptors: list[grpc.aio.ServerInterceptor] = [StatusCodeInterceptor(metrics), ParseRequestsInHandler()]
    if options.auth_token:
        interceptors.append(BearerTokenInterceptor(options.auth_token))
    server = grpc.aio.server(options=options.grpc_options(), interceptors=interceptors)
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{options.host}:{options.port}"
    try:
        if options.tls is not None:
            bound = server.add_secure_port(address, options.tls.credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as error:  # grpc raises RuntimeError when the port is taken
        raise OSError(f"could not bind {address}: {error}") from None
    if bound == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    await health_servicer.set("", SERVING)
    running = RunningServer(server, bound, health_servicer, service_names)
    await running.set_ready(False)
    return running


async def wait_for_signal(*others: asyncio.Event) -> str:
    """Wait for SIGTERM/SIGINT or any of `others`; returns what happened."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(e.wait()) for e in (stop, *others)]
    try:
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return "signal" if stop.is_set() else "event"


async def drain(running: RunningServer, admission: Admission, grace_s: float) -> bool:
    """Stop taking requests (UNAVAILABLE), go NOT_SERVING, and wait up to `grace_s` for the
    in-flight ones to finish. Returns whether they all did."""
    admission.close("the server is shutting down")
    await running.set_ready(False)
    log.info("draining for up to %.1f s", grace_s)
    finished = await admission.drained(grace_s)
    if not finished:
        log.warning("grace period over: requests still in flight are cancelled")
    return finished
