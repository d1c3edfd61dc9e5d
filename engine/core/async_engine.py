"""The asyncio face of the engine: one request in, an async iterator of event lists out.

The engine loop runs on its own thread; events cross to the event loop with
`call_soon_threadsafe`, so the event loop never blocks on the engine. Leaving the iterator
early (a client cancel, a deadline, an error downstream) aborts the engine request, which
frees its slot before the next engine step.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine.core.engine import Engine
from engine.core.events import Event, Finished
from engine.core.request import Request


class _QueueSink:
    """Forwards engine-thread events into an asyncio queue (unbounded: at most one list per step)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[list[Event] | BaseException] = asyncio.Queue()

    def events(self, events: list[Event]) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, events)

    def fail(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, error)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def stream(self, request: Request) -> AsyncIterator[list[Event]]:
        """Yield the request's events, one list per engine step, ending with the list holding Finished.
        Raises what `Engine.submit` raises, or the engine's failure."""
        sink = _QueueSink(asyncio.get_running_loop())
        ticket = self.engine.submit(request, sink)
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                finished = isinstance(item[-1], Finished)
                yield item
        finally:
            if not finished:
                self.engine.abort(ticket)
