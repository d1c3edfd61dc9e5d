"""The asyncio face of the engine: one request in, an async iterator of event lists out.

Data flow: the engine loop runs on its own thread and hands each request's events to its sink
once per iteration. The sinks of one event loop share a `_Mailbox`: the engine thread appends
(queue, events) pairs under a lock, and after each prefill and step (`Engine.after_delivery`)
wakes the event loop with one `call_soon_threadsafe` if anything is waiting, so a step that
advances 64 requests costs one wake-up, not 64. On the loop, the mailbox moves each list into
its request's queue.

What holds:
  * Coalescing: `stream` yields everything that has arrived for the request when its consumer
    asks, as one list in order. A consumer that keeps up gets one list per engine step; one that
    is behind (a slow network write) gets the steps it missed together, in one list, so it
    catches up with fewer, larger messages. Nothing that has arrived is held back.
  * The list holding Finished is the last; nothing follows it.
  * Bounded: a request's queue holds at most its remaining output (max_output_tokens, at most
    the context), because the engine produces at most that many tokens for it. A consumer that
    stops reading does not slow the engine or other requests: its request keeps its slot until
    it finishes or is cancelled.
  * Leaving the iterator early (a client cancel, a deadline, an error downstream) aborts the
    engine request, which frees its slot before the next engine step.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

from engine.core.engine import Engine
from engine.core.events import Event, Finished
from engine.core.inbox import Inbox
from engine.core.request import Request



class _Mailbox:
    """Engine thread -> event loop, one wake-up per batch of deliveries."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[Inbox, object, bool]] = []  # (inbox, item, shared)
        self._waking = False  # a wake-up is scheduled and has not run yet
        self.wake_ups = 0  # how many times the engine thread woke the loop (tests read it)

    def post(self, queue: Inbox, item: object, shared: bool = False) -> None:
        """Called on the engine thread; never blocks. Sent at the next `flush`: into `queue` as
        is, or, for a queue `shared` by many requests, in one list with the others posted to it."""
        with self._lock:
            self._items.append((queue, item, shared))

    def flush(self) -> None:
        """Called on the engine thread after a step: wake the loop once for everything posted."""
        with self._lock:
            if self._waking or not self._items:
                return
            self._waking = True
            self.wake_ups += 1
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._waking = False
        batches: dict[Inbox, list] = {}
        for queue, item, shared in items:
            if shared:
                batches.setdefault(queue, []).append(item)
            else:
                queue.put(item)
        for queue, batch in batches.items():  # one put (one wake-up of its reader) per shared queue
            queue.put(batch)


class _QueueSink:
    """One request's sink: its events go through the loop's mailbox into `queue` (unbounded:
    at most one list per engine iteration, and at most the request's output in all). With a tag
    (several requests sharing one queue), each wake-up puts one list of `(tag, item)` pairs."""

    def __init__(self, mailbox: _Mailbox, queue: Inbox | None = None, tag: object = None) -> None:
        self._mailbox = mailbox
        self.queue: Inbox = Inbox() if queue is None else queue
        self._tag = tag

    def events(self, events: list[Event]) -> None:
        if self._tag is None:
            self._mailbox.post(self.queue, events)
        else:
            self._mailbox.post(self.queue, (self._tag, events), shared=True)

    def fail(self, error: BaseException) -> None:
        if self._tag is None:
            self._mailbox.post(self.queue, error)
        else:
            self._mailbox.post(self.queue, (self._tag, error), shared=True)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}

    def _mailbox(self) -> _Mailbox:
        loop = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = _Mailbox(loop)
            self.engine.after_delivery(mailbox.flush)
        return mailbox

    def submit(self, request: Request, queue: Inbox, tag: object) -> int:
        """Queue `request`; its events arrive in `queue` as `(tag, list of events)` and a failure
        as `(tag, exception)`, in lists: one list per wake-up of the loop (per engine step, or
        several steps when the loop is behind) holds those of every request sharing the queue.
        For callers that serve many requests from one queue (DecodeStream). Returns the ticket
        for `Engine.abort`; raises what `Engine.submit` raises."""
        return self.engine.submit(request, _QueueSink(self._mailbox(), queue, tag))

    async def stream(self, request: Request) -> AsyncIterator[list[Event]]:
        """Yield the request's events in order, as lists: everything that has arrived when the
        consumer asks (see Coalescing), the last list ending with Finished.
        Raises what `Engine.submit` raises, or the engine's failure."""
        sink = _QueueSink(self._mailbox())
        ticket = self.engine.submit(request, sink)
        finished = False
        try:
            while not finished:
                events: list[Event] = []
                failure: BaseException | None = None
                for item in await sink.queue.take():
                    if isinstance(item, BaseException):
                        failure = item  # the engine already dropped the request: nothing follows
                        break
                    events += item
                if events:  # what arrived before a failure is still delivered
                    finished = isinstance(events[-1], Finished)
                    yield events
                if failure is not None:
                    finished = True
                    raise failure
        finally:
            if not finished:
                self.engine.abort(ticket)
