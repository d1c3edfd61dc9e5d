"""Whether a service takes new requests, and how many it has in flight.

Closed while the model loads, while draining, and when the engine or the upstream decoder
is down: a new request then gets UNAVAILABLE with the reason. Draining waits until the
in-flight count reaches zero (or the grace period ends). With `max_in_flight` set, a request
that would be one more than that gets RESOURCE_EXHAUSTED (retry later) instead.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.errors import ServiceError

# Requests in flight at once (generations, which hold theirs for the whole stream, and
# Tokenize/Detokenize): well above what a decoder admits (its batch plus a queue of 64 by default),
# so the decoder's own RESOURCE_EXHAUSTED comes first for generations; it bounds the memory
# requests hold (each up to --max-message-bytes) and the tokenizing queued behind them.
DEFAULT_MAX_IN_FLIGHT = 256


class Admission:
    def __init__(self, closed_reason: str | None = None, max_in_flight: int | None = None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None (got {max_in_flight})")
        self.closed_reason = closed_reason  # None = open
        self.max_in_flight = max_in_flight  # None = no cap
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self) -> None:
        self.closed_reason = None

    def close(self, reason: str) -> None:
        self.closed_reason = reason

    @contextlib.contextmanager
    def admit(self):
        """Hold one in-flight request for the block; raises UNAVAILABLE when closed,
        RESOURCE_EXHAUSTED when `max_in_flight` requests are already in flight."""
        if self.closed_reason is not None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self.closed_reason)
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server already has {self.in_flight} requests in flight, its limit; retry later",
            )
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
