"""`wait_serving`: poll a server process's gRPC health until it says SERVING (bounded), failing
at once, with the tail of its log, when one of the processes it needs exits first."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.service_names import DECODER_SERVICE


def log_tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else f"(no log at {log})"


def wait_serving(port: int, processes: list[subprocess.Popen], logs: list[Path], limit_s: float,
                 service: str = DECODER_SERVICE) -> None:
    """Blocking: call it from a thread (asyncio.to_thread) in an async test. `logs`: where the
    processes write their output (files, never a pipe that nobody reads while they serve)."""
    deadline = time.monotonic() + limit_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for process, log in zip(processes, logs, strict=True):
                assert process.poll() is None, f"pid {process.pid} exited {process.returncode}:\n{log_tail(log)}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"port {port} not SERVING in {limit_s} s:\n" + "\n".join(map(log_tail, logs))
            time.sleep(0.2)
