"""`tokenwire health`: is a server's gRPC health service answering SERVING?

Container healthchecks, `depends_on: condition: service_healthy` and scripts wait on it, so its
contract is the exit code (Docker's HEALTHCHECK convention): 0 when SERVING, 1 otherwise --
not reachable, NOT_SERVING (starting or draining), or an unknown service name. It prints one
line saying which, so `docker inspect` shows why a container is unhealthy.

Each attempt opens a fresh channel: a channel that failed to connect backs off exponentially
(up to minutes), which would make `wait` notice a server that came up long after it did.
"""

from __future__ import annotations

import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.channels import open_channel
from services.security import ClientTlsConfig

POLL_INTERVAL_S = 0.5


def check_once(target: str, service: str, timeout: float, tls: ClientTlsConfig | None = None) -> str:
    """The service's status name (SERVING, NOT_SERVING, ...) or the RPC error that prevented knowing."""
    with open_channel(target, tls, asynchronous=False) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def health_check(
    target: str,
    service: str = "",
    timeout: float = 5.0,
    wait: float = 0.0,
    tls: ClientTlsConfig | None = None,
) -> int:
    """Exit code 0 when `service` ('' = the whole server) at `target` is SERVING, else 1.

    `timeout` bounds each check; with `wait` > 0, checks repeat until SERVING or until `wait`
    seconds have passed (for scripts that start a server and wait for it to warm up).
    """
    deadline = time.monotonic() + wait
    name = service or "(server)"
    while True:
        status = check_once(target, service, timeout, tls)
        if status == "SERVING":
            print(f"{target} {name}: SERVING")
            return 0
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"{target} {name}: {status}", file=sys.stderr)
            return 1
        time.sleep(min(POLL_INTERVAL_S, left))
