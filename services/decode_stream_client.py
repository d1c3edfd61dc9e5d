"""The text service's side of `Decoder.DecodeStream`: generations share a few RPCs, one per
decode replica, on a channel that gRPC balances (services.replicas).

Data flow: `decode(request, timeout)` takes a fresh key, puts the request on the least-loaded
stream of the pool (opening one if there is none), writes a start and reads its key's entries
from a queue. gRPC's thread writes the starts and cancels; those that queue while it writes one
message go in the next as one DecodeStreamBatch (`_requests`), so a burst of requests costs the
text service's threads and the decoder's loop a few messages, not one each. Each stream is a
blocking call read by its own thread (`_Stream._read`), which hands what it reads to the event
loop through a mailbox: one wake-up of the loop for everything read since the last one. So when
the loop is busy (sending to clients), the thread reads ahead and the next wake-up carries
several steps; every request then gets them as one list, and the text service sends its client
one message for them. A grpc.aio reader could not do this: each read is a round trip through the
event loop, so a busy loop reads one step per turn and sends one message per token. The
per-request `Decode` RPC stays in the contract for other clients.

The pool. gRPC picks a replica per call, so one shared call would keep every request on one
replica. The pool holds one DecodeStream per ready replica: each is opened on the balanced
channel, where round_robin puts it on a replica that is READY and healthy under the model's name;
the replica's headers name it (its id), and a stream that lands on a replica that already has
one is retired. The census (services.replicas) says how many replicas are ready; a stream whose
replica is no longer ready (draining, stalled) is retired: it takes no new request and is closed
once its requests have ended. One stream per replica keeps what issue 10 measured: one message
per replica per engine step, whatever the number of requests.

Resubmission. A request that had received nothing when its stream failed (the replica died,
UNAVAILABLE) or was refused UNAVAILABLE at its start (the replica began draining) is started
again on another stream, up to MAX_ATTEMPTS times. This has to be done here: gRPC's retry policy
(which covers GetModelInfo and the opening of a stream) works per call, and a shared call is
committed at its first headers, long before most of its requests begin; it cannot see inside it.
A request that had received a token fails with UNAVAILABLE: its text was already delivered.

What holds:
  * Nothing read is held back: a reader thread wakes the loop at once unless a wake-up is pending.
  * Leaving `decode` before Finished (a client cancel, a deadline, a stop string, an error)
    sends a cancel for the key, which frees the engine slot before the next step.
  * Deadlines: past `timeout` the request ends with DEADLINE_EXCEEDED (and is cancelled), as
    the per-request RPC's deadline did; a resubmitted request keeps its one deadline.
  * A request refused by the decoder ends with that status (INVALID_ARGUMENT naming the field,
    RESOURCE_EXHAUSTED), UNAVAILABLE once resubmission is spent or the request had started.
  * No request waits on a stream no replica answers: a stream without headers after
    `_IDENTIFY_S` is closed, and its requests (none started) move to another one.
  * Bounded: a request's queue holds at most its remaining output, a mailbox at most what its
    replica sent since the loop last ran, the pool at most one stream per replica plus the ones
    being opened or retired.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncGenerator, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.events import Event, Finished, Token
from engine.core.inbox import Inbox
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode_events import event_from_pb
from services.errors import ServiceError
from services.metrics import Metrics
from services.replicas import BATCH_KEY, REPLICA_ID_KEY

log = logging.getLogger("tokenwire.text")

_END = None  # ends a call's request iterator
_DEADLINE = object()  # queued for a request when its deadline passes
# Starts of one request: the first and up to two resubmissions (as the channel's retry policy).
MAX_ATTEMPTS = 3
# How long a new stream may go without headers. A decode server sends them as the call opens, so a
# stream past this never reached one (a fresh-clone test run saw one stay so for good after its
# replica's restart, and the request on it waited with it): it is closed, and the requests on it,
# none started, move to another stream (`_unanswered`).
_IDENTIFY_S = 5.0


# A batch of actions (invariant 17) takes no more once it holds this many bytes, so it stays well
# under gRPC's default 4 MiB limit on a received message (one long prompt: a few hundred kB).
BATCH_BYTES = 1 << 20


def _requests(actions: queue.SimpleQueue, batches: Callable[[], bool]):
    """A call's request iterator, on gRPC's thread: each next() waits for an action, then takes
    every other one already queued and yields them as one DecodeStreamBatch (a single action as
    itself). gRPC asks for the next message once the last is written, so the starts of a burst
    queue up meanwhile and go together, without waiting for any action not yet queued. Until
    `batches()` (the server's headers said it reads batches), every action goes alone."""
    while (first := actions.get()) is not _END:
        batch, size = [first], first.ByteSize()
        ended = False
        while size < BATCH_BYTES and batches():
            try:
                action = actions.get_nowait()
            except queue.Empty:
                break
            if action is _END:
                ended = True
                break
            batch.append(action)
            size += action.ByteSize()
        if len(batch) == 1:
            yield first
        else:
            yield decode_pb2.DecodeStreamRequest(batch=decode_pb2.DecodeStreamBatch(actions=batch))
        if ended:
            return


@dataclass(frozen=True)
class _Identified:
    """Posted by a reader thread: the replica the stream landed on (its headers' id)."""

    replica: str


class _Stream:
    """One open DecodeStream call: its actions queue (consumed by gRPC's own thread), its reader
    thread, and what the pool knows of it."""

    def __init__(self, stub: decode_pb2_grpc.DecoderStub, deliver) -> None:
        self.actions: queue.SimpleQueue = queue.SimpleQueue()
        self.batches = False  # its server reads DecodeStreamBatch (its headers say so)
        self.call = stub.DecodeStream(_requests(self.actions, lambda: self.batches))
        self.replica: str | None = None  # its replica's id, once its headers came
        self.address: str | None = None  # its replica's address (from the census), for metrics
        self.identified = asyncio.Event()  # headers came, or the call ended first
        self.live = 0  # requests on it
        self.started = 0  # requests ever started on it
        self.retiring = False  # takes no new request; closed once `live` is 0
        self.ended = False
        self._deliver = deliver  # (stream, list of items read, or a ServiceError at the end)
        self._lock = threading.Lock()
        self._read_ahead: list = []
        self._waking = False
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="tokenwire-decode-stream", daemon=True).start()

    @property
    def name(self) -> str:
        return self.address or self.replica or "a replica not yet known"

    def send(self, action: decode_pb2.DecodeStreamRequest) -> None:
        self.actions.put(action)

    def end_writes(self) -> None:
        """Half-close: the decoder ends the call once every request on it has ended (invariant 13)."""
        self.actions.put(_END)

    def close(self) -> None:
        self.call.cancel()
        self.actions.put(_END)

    def _read(self) -> None:
        """The reader thread: the replica's id, every response into the mailbox, then the end."""
        failure = ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        try:
            metadata = dict(self.call.initial_metadata() or ())  # blocks until the headers (or the call's end)
            self.batches = metadata.get(BATCH_KEY) == "1"
            replica = metadata.get(REPLICA_ID_KEY)
            if replica is not None:  # (none when the call failed first)
                self._post(_Identified(replica))
            for response in self.call:
                self._post(response)
        except grpc.RpcError as error:  # UNAVAILABLE whatever ended it: another stream may work
            failure = ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"the decode stream failed: {error.code().name}: {error.details()}"
            )
        finally:
            self.actions.put(_END)
            self._post(failure)

    def _post(self, item) -> None:
        with self._lock:
            self._read_ahead.append(item)
            if self._waking:
                return
            self._waking = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            pass

    def _wake(self) -> None:
        with self._lock:
            items, self._read_ahead = self._read_ahead, []
            self._waking = False
        self._deliver(self, items)


class DecodeStreamClient:
    """A pool of DecodeStreams over `channel` (a blocking one, balanced: services.channels.open_channel
    with asynchronous=False and services.replicas.channel_options; `close` closes it), shared by
    every `decode` call of one event loop. `replicas_changed` keeps it in step with the census."""

    def __init__(self, channel: grpc.Channel, metrics: Metrics | None = None) -> None:
        self._channel = channel
        self._stub = decode_pb2_grpc.DecoderStub(channel)
        self._metrics = metrics or Metrics()
        self._streams: list[_Stream] = []  # open, retiring ones included
        self._routes: dict[int, tuple[_Stream, Inbox]] = {}  # key -> (its stream, its inbox)
        self._keys = itertools.count(1)
        self._ready: set[str] = set()  # ready replicas' ids, from the census
        self._names: dict[str, str] = {}  # replica id -> address
        self._filling: asyncio.Task | None = None
        self._closed = False
        self._turn = 0  # breaks ties between equally loaded streams

    # -- the pool ---------------------------------------------------------------------------

    def _active(self) -> list[_Stream]:
        return [s for s in self._streams if not s.retiring and not s.ended]

    def _open(self) -> _Stream:
        if self._closed:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the text service is stopping")
        stream = _Stream(self._stub, self._deliver)
        self._streams.append(stream)
        stream.loop.call_later(_IDENTIFY_S, self._unanswered, stream)
        return stream

    def _unanswered(self, stream: _Stream) -> None:
        """`_IDENTIFY_S` after `stream` opened: close it if no headers came. Its reader then posts
        its end (UNAVAILABLE), which resubmits its requests elsewhere (or fails them once their
        attempts are spent) instead of leaving them on a call that may never answer."""
        if stream.replica is None and not stream.ended:
            log.warning("closing a decode stream that no replica answered within %.1f s", _IDENTIFY_S)
            stream.close()

    def _pick(self) -> _Stream:
        """The least-loaded stream whose replica is known (ties in turn, so that requests one at
        a time spread too); else one being opened; else a new one."""
        active = self._active()
        if not active:
            return self._open()
        candidates = [s for s in active if s.replica is not None] or active
        low = min(s.live for s in candidates)
        tied = [s for s in candidates if s.live == low]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def _retire(self, stream: _Stream, why: str, level: int = logging.INFO) -> None:
        if stream.retiring or stream.ended:
            return
        log.log(level, "retiring the decode stream to replica %s: %s", stream.name, why)
        stream.retiring = True
        if stream.live == 0:
            stream.end_writes()

    def replicas_changed(self, ready: set[str], unready: set[str], names: dict[str, str]) -> None:
        """The census's news: retire streams on replicas no longer ready, open streams for ready
        replicas that have none."""
        self._ready, self._names = set(ready), dict(names)
        for stream in self._streams:
            self._name(stream)
        for stream in self._active():
            if stream.replica in unready:
                self._retire(stream, "the replica is not ready")
        self._fill_soon()

    def _fill_soon(self) -> None:
        if self._closed:
            return
        if (self._filling is None or self._filling.done()) and self._ready - self._covered():
            self._filling = asyncio.get_running_loop().create_task(self._fill())

    def _covered(self) -> set[str]:
        return {s.replica for s in self._active() if s.replica is not None}

    async def _fill(self) -> None:
        """Open streams, one at a time, until every ready replica has one. gRPC chooses where
        each lands; one that lands on a covered replica is retired (at `_identified`). Attempts
        are bounded; the next census round tries again."""
        for _ in range(len(self._ready - self._covered()) + 1):
            if not self._ready - self._covered():
                return
            stream = self._open()
            try:
                await asyncio.wait_for(stream.identified.wait(), _IDENTIFY_S)
            except asyncio.TimeoutError:
                return
            if stream.ended or stream.retiring:
                await asyncio.sleep(0.05)  # nothing ready, or a covered replica: give gRPC a moment

    async def filled(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until every ready replica has a stream, or filling gave up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._ready - self._covered() and loop.time() < deadline:
            self._fill_soon()
            if self._filling is not None:
                await asyncio.wait([self._filling], timeout=max(0.0, deadline - loop.time()))

    def stream_replicas(self) -> list[str]:
        """The replica address of each stream taking requests (or its id, or a placeholder, while
        the census or its headers have not told it yet)."""
        return sorted(s.name for s in self._active())

    # -- what the streams deliver -------------------------------------------------------------

    def _identified(self, stream: _Stream, replica: str) -> None:
        stream.replica = replica
        stream.identified.set()
        self._name(stream)
        if any(s is not stream and s.replica == stream.replica for s in self._active()):
            self._retire(stream, "its replica has a stream already", logging.DEBUG)  # routine while filling

    def _name(self, stream: _Stream) -> None:
        """Its replica's address, once both its headers and the census have come: the metrics
        count from then on, what it carried until then included."""
        if stream.address is None and stream.replica in self._names:
            stream.address = self._names[stream.replica]
            self._metrics.decoder_requests.labels(stream.address).inc(stream.started)
            self._metrics.decoder_in_flight.labels(stream.address).inc(stream.live)

    def _started(self, stream: _Stream) -> None:
        stream.live += 1
        stream.started += 1
        if stream.address is not None:
            self._metrics.decoder_requests.labels(stream.address).inc()
            self._metrics.decoder_in_flight.labels(stream.address).inc()

    def _ended(self, stream: _Stream) -> None:
        stream.live -= 1
        if stream.address is not None:
            self._metrics.decoder_in_flight.labels(stream.address).dec()
        if stream.retiring and stream.live == 0 and not stream.ended:
            stream.end_writes()

    def _deliver(self, stream: _Stream, items: list) -> None:
        """On the loop: route each entry to its request; at the stream's end, fail the requests
        still on it (they resubmit themselves when they can)."""
        for item in items:
            if type(item) is _Identified:
                self._identified(stream, item.replica)
                continue
            if isinstance(item, ServiceError):
                stream.ended = True
                stream.identified.set()
                if stream in self._streams:
                    self._streams.remove(stream)
                for route_stream, inbox in list(self._routes.values()):
                    if route_stream is stream:
                        inbox.put(item)
                self._fill_soon()
                continue
            if item.token_ids:  # packed tokens (invariant 15), before the entries
                if len(item.token_keys) != len(item.token_ids):
                    self._break(stream, f"the decoder sent {len(item.token_keys)} token keys for {len(item.token_ids)} tokens")
                    return
                by_key: dict[int, list[int]] = {}
                for key, token_id in zip(item.token_keys, item.token_ids):
                    by_key.setdefault(key, []).append(token_id)
                for key, ids in by_key.items():
                    route = self._routes.get(key)
                    if route is not None and route[0] is stream:
                        route[1].put(ids)
            for entry in item.requests:
                route = self._routes.get(entry.key)
                if route is not None and route[0] is stream:
                    route[1].put(entry)

    def _break(self, stream: _Stream, problem: str) -> None:
        """The decoder broke the stream's contract: fail its requests (INTERNAL) and end it."""
        log.error("%s; ending the decode stream", problem)
        stream.close()
        self._deliver(stream, [ServiceError(grpc.StatusCode.INTERNAL, f"the decoder broke the stream's contract: {problem}")])

    # -- one request ----------------------------------------------------------------------------

    def _start(self, request: decode_pb2.DecodeRequest, inbox: Inbox) -> tuple[int, _Stream]:
        key = next(self._keys)
        stream = self._pick()
        self._routes[key] = (stream, inbox)
        self._started(stream)
        # packed tokens carry no logprobs (invariant 15): a request that asks for them gets Token events
        start = decode_pb2.DecodeStreamStart(key=key, request=request, packed_tokens=not request.return_logprobs)
        stream.send(decode_pb2.DecodeStreamRequest(start=start))
        return key, stream

    async def decode(
        self, request: decode_pb2.DecodeRequest, timeout: float | None
    ) -> AsyncGenerator[Sequence[Event], None]:
        """The request's events, as lists (see the module docstring); the `DecodeFn` of
        services.text_service. Raises ServiceError with the decoder's status."""
        if timeout is not None and timeout <= 0:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        inbox = Inbox()
        # One timer per request (not one per wait: that costs a timer on every message): at the
        # deadline it queues _DEADLINE behind whatever arrived in time.
        timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, inbox.put, _DEADLINE)
        key, stream = self._start(request, inbox)
        attempts = 1
        started = False  # an event came: from now on a failure is final
        finished = False  # the request ended on its stream: nothing to cancel
        try:
            while not finished:
                entries = await inbox.take()
                events: list[Event] = []
                for entry in entries:
                    if type(entry) is list:  # packed token ids (the common case)
                        events.extend(map(Token, entry))
                        started = True
                        continue
                    if entry is _DEADLINE:
                        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    if isinstance(entry, ServiceError):  # the stream failed (shared: raise a copy)
                        code, message = entry.code, str(entry)
                    elif entry.HasField("error"):  # the decoder ended this request
                        code = _CODES.get(entry.error.code, grpc.StatusCode.INTERNAL)
                        message = entry.error.message
                        if code == grpc.StatusCode.UNAVAILABLE and not started:  # e.g. it began to drain
                            self._retire(stream, f"it refused a start: {message}")
                    else:
                        events.extend(event_from_pb(e) for e in entry.events)
                        started = True
                        continue
                    if code != grpc.StatusCode.UNAVAILABLE or started or attempts >= MAX_ATTEMPTS:
                        finished = True
                        raise ServiceError(code, message)
                    # nothing of it was sent: start it again, where gRPC's picks put the pool now
                    self._routes.pop(key, None)
                    self._ended(stream)
                    self._metrics.decoder_resubmitted.inc()
                    log.info("request %s moves to another decode replica: %s", request.request_id, message)
                    key, stream = self._start(request, inbox)
                    attempts += 1
                if not events:
                    continue  # (the contract never sends an empty entry)
                finished = isinstance(events[-1], Finished)
                yield events
        finally:
            if timer is not None:
                timer.cancel()
            self._routes.pop(key, None)
            if not finished and not stream.ended:  # (a dead stream has cancelled everything)
                stream.send(decode_pb2.DecodeStreamRequest(cancel=decode_pb2.DecodeStreamCancel(key=key)))
            self._ended(stream)

    def serving(self, service: str, timeout_s: float) -> bool:
        """Blocking: whether a replica reports `service` SERVING, asked on the streams' own
        channel: through its balancer, so True means at least one replica is connected, healthy
        under the channel's health name and SERVING (after a restart, each channel waits out its
        own reconnect backoff)."""
        try:
            response = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        """Cancel the open streams (their requests fail with UNAVAILABLE) and close the channel."""
        self._closed = True
        if self._filling is not None:
            self._filling.cancel()
        for stream in self._streams:
            stream.close()
        self._channel.close()


_CODES = {code.value[0]: code for code in grpc.StatusCode}
