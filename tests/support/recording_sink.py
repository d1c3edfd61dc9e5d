"""`Recorder`: an EventSink for scheduler tests, recording what the engine sends."""

from __future__ import annotations

import threading

from engine.core.events import Finished, Token


class Recorder:
    """Records what the engine sends and signals its first events (the request holds a slot: it
    was prefilled) and the end of the stream."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.done = threading.Event()

    def events(self, events) -> None:
        self.batches.append(events)
        self.started.set()
        if isinstance(events[-1], Finished):
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()

    @property
    def finished(self) -> Finished | None:
        """The stream's Finished event, once sent."""
        last = self.batches[-1][-1] if self.batches else None
        return last if isinstance(last, Finished) else None

    @property
    def tokens(self) -> list[int]:
        return [e.id for b in self.batches for e in b if isinstance(e, Token)]
