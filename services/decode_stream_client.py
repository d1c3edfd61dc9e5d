"""The text service's side of `Decoder.DecodeStream`: every generation shares one RPC.

Data flow: `decode(request, timeout)` takes a fresh key, opens the stream if none is open (one
per client, reopened after it ends), writes a start and reads its key's entries from a queue.
The stream is a blocking call read by its own thread (`_read`), which hands what it reads to the
event loop through a mailbox: one wake-up of the loop for everything read since the last one.
So when the loop is busy (sending to clients), the thread reads ahead and the next wake-up
carries several steps; every request then gets them as one list, and the text service sends its
client one message for them. A grpc.aio reader could not do this: each read is a round trip
through the event loop, so a busy loop reads one step per turn and sends one message per token.
The per-request `Decode` RPC stays in the contract for other clients.

What holds:
  * Nothing read is held back: the thread wakes the loop at once unless a wake-up is pending.
  * Leaving `decode` before Finished (a client cancel, a deadline, a stop string, an error)
    sends a cancel for the key, which frees the engine slot before the next step.
  * Deadlines: past `timeout` the request ends with DEADLINE_EXCEEDED (and is cancelled), as
    the per-request RPC's deadline did.
  * A request refused by the decoder ends with that status (INVALID_ARGUMENT naming the field,
    RESOURCE_EXHAUSTED, UNAVAILABLE). When the stream itself fails (the decoder went away),
    every request on it ends with UNAVAILABLE, naming the stream's status, and the next request
    opens a new stream.
  * Bounded: a request's queue holds at most its remaining output, and the mailbox at most what
    the decoder sent since the loop last ran.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncGenerator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.events import Event, Finished, Token
from engine.core.inbox import Inbox
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode_events import event_from_pb
from services.errors import ServiceError

log = logging.getLogger("tokenwire.text")

_END = None  # ends a call's request iterator
_DEADLINE = object()  # queued for a request when its deadline passes


class _Stream:
    """One open DecodeStream call: its actions queue (consumed by gRPC's own thread) and its
    reader thread."""

    def __init__(self, stub: decode_pb2_grpc.DecoderStub, deliver) -> None:
        self.actions: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.DecodeStream(iter(self.actions.get, _END))
        self._deliver = deliver  # (stream, list of responses, or a ServiceError at the end)
        self._lock = threading.Lock()
        self._read_ahead: list = []
        self._waking = False
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="tokenwire-decode-stream", daemon=True).start()

    def send(self, action: decode_pb2.DecodeStreamRequest) -> None:
        self.actions.put(action)

    def close(self) -> None:
        self.call.cancel()
        self.actions.put(_END)

    def _read(self) -> None:
        """The reader thread: every response into the mailbox, then the stream's end."""
        failure = ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        try:
            for response in self.call:
                self._post(response)
        except grpc.RpcError as error:  # UNAVAILABLE whatever ended it: a new stream may work
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
    """One DecodeStream at a time over `channel` (a blocking one: services.channels.open_channel
    with asynchronous=False, which `close` closes), shared by every `decode` call of one event
    loop."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._stub = decode_pb2_grpc.DecoderStub(channel)
        self._stream: _Stream | None = None
        self._routes: dict[int, tuple[_Stream, Inbox]] = {}  # key -> (its stream, its inbox)
        self._keys = itertools.count(1)

    def _open(self) -> _Stream:
        if self._stream is None:
            self._stream = _Stream(self._stub, self._deliver)
        return self._stream

    def _deliver(self, stream: _Stream, items: list) -> None:
        """On the loop: route each entry to its request; at the stream's end, fail the requests
        still on it."""
        for item in items:
            if isinstance(item, ServiceError):
                if self._stream is stream:
                    self._stream = None  # the next request opens a new stream
                for route_stream, inbox in list(self._routes.values()):
                    if route_stream is stream:
                        inbox.put(item)
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

    async def decode(
        self, request: decode_pb2.DecodeRequest, timeout: float | None
    ) -> AsyncGenerator[Sequence[Event], None]:
        """The request's events, as lists (see the module docstring); the `DecodeFn` of
        services.text_service. Raises ServiceError with the decoder's status."""
        if timeout is not None and timeout <= 0:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        key = next(self._keys)
        stream = self._open()
        inbox = Inbox()
        self._routes[key] = (stream, inbox)
        # One timer per request (not one per wait: that costs a timer on every message): at the
        # deadline it queues _DEADLINE behind whatever arrived in time.
        timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, inbox.put, _DEADLINE)
        finished = False
        try:
            start = decode_pb2.DecodeStreamStart(key=key, request=request, packed_tokens=True)
            stream.send(decode_pb2.DecodeStreamRequest(start=start))
            while not finished:
                entries = await inbox.take()
                events: list[Event] = []
                for entry in entries:
                    if type(entry) is list:  # packed token ids (the common case)
                        events.extend(map(Token, entry))
                    elif entry is _DEADLINE:
                        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                    elif isinstance(entry, ServiceError):  # shared by the stream's requests: raise a copy
                        finished = True  # the stream failed: nothing to cancel
                        raise ServiceError(entry.code, str(entry))
                    elif entry.HasField("error"):
                        finished = True  # the decoder ended it
                        raise ServiceError(_CODES.get(entry.error.code, grpc.StatusCode.INTERNAL), entry.error.message)
                    else:
                        events.extend(event_from_pb(e) for e in entry.events)
                if not events:
                    continue  # (the contract never sends an empty entry)
                finished = isinstance(events[-1], Finished)
                yield events
        finally:
            if timer is not None:
                timer.cancel()
            self._routes.pop(key, None)
            if not finished and self._stream is stream:  # (a dead stream has cancelled everything)
                stream.send(decode_pb2.DecodeStreamRequest(cancel=decode_pb2.DecodeStreamCancel(key=key)))

    def serving(self, service: str, timeout_s: float) -> bool:
        """Blocking: whether the decoder reports `service` SERVING, asked on the stream's own
        channel, so that readiness follows the connection generations use (after a decoder
        restart, each channel waits out its own reconnect backoff)."""
        try:
            response = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        """Cancel the open stream (its requests fail with UNAVAILABLE) and close the channel."""
        if self._stream is not None:
            self._stream.close()
        self._channel.close()


_CODES = {code.value[0]: code for code in grpc.StatusCode}
