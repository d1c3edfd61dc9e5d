"""The server side of `Decoder.DecodeStream`: many requests over one RPC, one response per step.

Data flow: a reader task takes the client's actions. A start is admitted (drain refuses it with
UNAVAILABLE), validated as Decode validates, and submitted to the engine with this stream's one
queue as its sink (`AsyncEngine.submit`, tagged with the request's `_Live` record; each wake-up
of the loop puts one list for all of them). A cancel aborts the engine request. The writer (the
RPC's response generator) waits for the queue, takes everything in it, and sends one
DecodeStreamResponse: per live request, its new events, or its error. So a step that advances
64 requests is one message, and a client that is behind gets several steps in one. The tokens of requests started with packed_tokens (the text service's)
travel as two integer arrays for the whole response (invariant 15).

A DecodeStreamBatch (invariant 17) is read as its actions one after another: a client that
starts many requests at once sends them in one message, and this loop reads it with one wake-up.

What holds (the proto's invariants 10-14 and 17):
  * Items are tagged with the `_Live` object, not the key: a key cancelled and started again
    never receives the old request's events.
  * Each request ends once: at its Finished or its error, its record leaves `live`, its metrics
    record is written and its admission released. A cancel, the RPC's end or a failure ends the
    rest as cancelled and aborts them in the engine.
  * Bounded: the queue holds at most the live requests' remaining output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from engine.core.async_engine import AsyncEngine
from engine.core.errors import InvalidArgument
from engine.core.events import Event, Finished, Token
from engine.core.inbox import Inbox
from engine.core.constrained import ConstraintCompiler
from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2
from services import validation
from services.admission import Admission
from services.decode_events import add_events_pb, event_to_pb
from services.errors import ServiceError, status_for
from services.metrics import Metrics, RequestTracker

_CLOSED = object()  # the reader's last item: the client closed its side
# A backlog is sent in responses of at most this many events (a few hundred kB), well under the
# default 4 MiB message limit however many slots and steps it spans.
MAX_EVENTS_PER_RESPONSE = 16384


@dataclass(eq=False)
class _Live:
    key: int
    tracker: RequestTracker
    admitted: contextlib.ExitStack
    packed: bool  # its tokens go in the response's token_keys/token_ids (invariant 15)
    ticket: int = -1


@dataclass
class DecodeStreamSession:
    """One DecodeStream RPC, over the servicer's engine and the model it serves."""

    engine: AsyncEngine
    info: ModelInfo
    admission: Admission
    metrics: Metrics
    constraints: ConstraintCompiler | None = None  # compiles requests' constraints (None: refused)
    queue: Inbox = field(default_factory=Inbox)
    live: dict[int, _Live] = field(default_factory=dict)
    client_closed: bool = False

    async def run(self, actions: AsyncIterator[decode_pb2.DecodeStreamRequest]) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
        reader = asyncio.create_task(self._read(actions))
        try:
            pending: collections.deque = collections.deque()  # items taken from the queue, not yet sent
            while not (self.client_closed and not self.live):
                if not pending or len(self.queue):
                    for got in await self.queue.take():
                        _extend(pending, got)
                items, events = [], 0
                while pending and events < MAX_EVENTS_PER_RESPONSE:
                    items.append(pending.popleft())
                    events += _size(items[-1])
                response = self._response(items)
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()
                if response.requests or response.token_ids:
                    yield response
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)  # its error, if any, was raised above
            for live in list(self.live.values()):  # the RPC ended (cancelled, failed, or server stop)
                self.engine.engine.abort(live.ticket)
                self._end(live, asyncio.CancelledError())

    async def _read(self, actions: AsyncIterator[decode_pb2.DecodeStreamRequest]) -> None:
        try:
            async for action in actions:
                if action.WhichOneof("action") == "batch":  # invariant 17: in order, one by one
                    for inner in action.batch.actions:
                        if inner.WhichOneof("action") == "batch":
                            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "batch.actions: a batch inside a batch")
                        self._act(inner)
                else:
                    self._act(action)
        finally:
            self.client_closed = True
            self.queue.put(_CLOSED)  # wakes the writer, which ends once nothing is live

    def _act(self, action: decode_pb2.DecodeStreamRequest) -> None:
        """One start or cancel. An action unset, or one this server does not know (a later
        client's), fails the RPC rather than leave a request that never starts."""
        kind = action.WhichOneof("action")
        if kind == "start":
            self._start(action.start)
        elif kind == "cancel":
            live = self.live.get(action.cancel.key)
            if live is not None:
                self.engine.engine.abort(live.ticket)
                self._end(live, asyncio.CancelledError())
        else:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "action: not set, or not one this server knows")

    def _start(self, start: decode_pb2.DecodeStreamStart) -> None:
        if start.key in self.live:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"key {start.key} is in use on this stream")
        pb = start.request
        tracker = self.metrics.track(pb.request_id, len(pb.prompt_token_ids))
        live = _Live(start.key, tracker, contextlib.ExitStack(), start.packed_tokens)
        try:
            if start.packed_tokens and pb.return_logprobs:
                raise InvalidArgument("packed_tokens", "packed tokens carry no logprobs; unset it or return_logprobs")
            live.admitted.enter_context(self.admission.admit())
            pb.request_id = tracker.request_id = validation.request_id_of(pb.request_id)
            request = validation.decode_request(pb, self.info, self.constraints)
            live.ticket = self.engine.submit(request, self.queue, live)
        except Exception as error:  # refused: this request ends with its error, the stream goes on
            self.live[start.key] = live
            self.queue.put((live, error))
            return
        self.live[start.key] = live

    def _response(self, items: list) -> decode_pb2.DecodeStreamResponse:
        """One response from the queue's items: per live request its events, or its error."""
        events: dict[_Live, list[Event]] = {}
        failed: dict[_Live, BaseException] = {}
        for item in items:
            if item is _CLOSED:
                continue
            live, payload = item
            if self.live.get(live.key) is not live or live in failed:
                continue  # cancelled, or already ended: nothing more is sent for it
            if isinstance(payload, BaseException):
                failed[live] = payload
            else:
                events.setdefault(live, []).extend(payload)
        response = decode_pb2.DecodeStreamResponse()
        keys: list[int] = []  # packed tokens (invariant 15), for every packed request at once
        token_ids: list[int] = []
        now = self.metrics.clock()  # one reading for every request of the response
        for live, evs in events.items():
            if live in failed:
                continue  # the error ends it (events before a failure are not sent: it failed)
            if live.packed:
                ids = [e.id for e in evs if isinstance(e, Token)]
                keys += [live.key] * len(ids)
                token_ids += ids
                if isinstance(evs[-1], Finished):
                    response.requests.add(key=live.key).events.append(event_to_pb(evs[-1]))
                live.tracker.tokens(len(ids), now)
            else:
                add_events_pb(evs, response.requests.add(key=live.key).events)
                live.tracker.tokens(sum(1 for e in evs if isinstance(e, Token)), now)
            if isinstance(evs[-1], Finished):
                live.tracker.finish(evs[-1].reason)
                self._end(live, None)
        response.token_keys.extend(keys)
        response.token_ids.extend(token_ids)
        for live, error in failed.items():
            code, message = status_for(error) or (grpc.StatusCode.INTERNAL, "internal error; see the server log")
            response.requests.add(key=live.key, error=decode_pb2.RequestError(code=code.value[0], message=message))
            self._end(live, error)
        return response

    def _end(self, live: _Live, error: BaseException | None) -> None:
        """The request is over: forget it, record it once, release its admission."""
        if self.live.get(live.key) is live:
            del self.live[live.key]
        live.tracker.__exit__(type(error) if error else None, error, None)
        live.admitted.close()


def _extend(pending: collections.deque, got) -> None:
    """What the queue held: a list of (live, events or error) from the engine's mailbox, or one
    item put here (_CLOSED, or a refused start's (live, error))."""
    if type(got) is list:
        pending.extend(got)
    else:
        pending.append(got)


def _size(item) -> int:
    """How many events a queue item carries."""
    return len(item[1]) if isinstance(item, tuple) and isinstance(item[1], list) else 1
