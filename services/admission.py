"""Whether a service takes new requests, and how many it has in flight.

Closed while the model loads, while draining, and when the engine or the upstream decoder
is down: a new request then gets UNAVAILABLE with the reason. Draining waits until the
in-flight count reaches zero (or the grace period ends).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.errors import ServiceError


class Admission:
    def __init__(self, closed_reason: str | None = None) -> None:
        self.closed_reason = closed_reason  # None = open
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self) -> None:
        self.closed_reason = None

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    @contextlib.contextmanager
    def admit(self):
        """Hold one in-flight request for the block; raises UNAVAILABLE when closed."""
        if self.closed_reason is not None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self.closed_reason)
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when the timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
