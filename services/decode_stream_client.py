"""The text service's side of `Decoder.DecodeStream`: every generation shares one RPC.

Data flow: `decode(request, timeout)` takes a fresh key, opens the stream if none is open
(one per client, reopened after it ends), writes a start and reads its key's entries from a
queue that the stream's reader task fills. It yields the engine's events, as lists: everything
that has arrived for the request when its consumer asks (one step's events when the consumer
keeps up, several steps' when it is behind), so the text service sends its client one message
for them. The per-request `Decode` RPC stays in the contract for other clients.

What holds:
  * Leaving `decode` before Finished (a client cancel, a deadline, a stop string, an error)
    sends a cancel for the key, which frees the engine slot before the next step.
  * Deadlines: past `timeout` the request ends with DEADLINE_EXCEEDED (and is cancelled), as
    the per-request RPC's deadline did.
  * A request refused by the decoder ends with that status (INVALID_ARGUMENT naming the field,
    RESOURCE_EXHAUSTED, UNAVAILABLE). When the stream itself fails (the decoder went away),
    every request on it ends with UNAVAILABLE, naming the stream's status, and the next request
    opens a new stream.
  * Bounded: a request's queue holds at most its remaining output.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import AsyncGenerator, Sequence

import grpc

from engine.core.events import Event, Finished
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.decode_events import event_from_pb
from services.errors import ServiceError


class DecodeStreamClient:
    """One DecodeStream at a time over `stub`'s channel, shared by every `decode` call."""

    def __init__(self, stub: decode_pb2_grpc.DecoderStub) -> None:
        self._stub = stub
        self._call = None  # the open DecodeStream call, or None
        self._routes: dict[int, tuple[object, asyncio.Queue]] = {}  # key -> (its call, its queue)
        self._keys = itertools.count(1)
        self._outbox: asyncio.Queue | None = None  # actions for the open call's writer task
        self._tasks: set[asyncio.Task] = set()

    def _open(self):
        """The open call, opened if need be, with its reader and its writer task. Requests never
        write to the call themselves: grpc.aio cancels a whole RPC when one of its writes is
        cancelled, and a request's task is cancelled whenever its client goes away."""
        if self._call is None:
            call = self._stub.DecodeStream()
            self._call, self._outbox = call, asyncio.Queue()
            writer = asyncio.create_task(self._write(call, self._outbox))
            reader = asyncio.create_task(self._read(call, writer))
            for task in (writer, reader):
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return self._call

    async def _read(self, call, writer: asyncio.Task) -> None:
        """Route each entry to its request; when the stream ends, fail the requests still on it."""
        failure = ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode stream ended")
        try:
            async for response in call:
                for entry in response.requests:
                    route = self._routes.get(entry.key)
                    if route is not None and route[0] is call:
                        route[1].put_nowait(entry)
        except grpc.aio.AioRpcError as error:  # UNAVAILABLE whatever ended it: a new stream may work
            failure = ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"the decode stream failed: {error.code().name}: {error.details()}"
            )
        finally:
            writer.cancel()
            if self._call is call:
                self._call = None  # the next request opens a new stream
            for route_call, queue in list(self._routes.values()):
                if route_call is call:
                    queue.put_nowait(failure)

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        """Write the actions in order; a failed write ends the call (the reader fails its requests)."""
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception:
            call.cancel()

    async def decode(
        self, request: decode_pb2.DecodeRequest, timeout: float | None
    ) -> AsyncGenerator[Sequence[Event], None]:
        """The request's events, as lists (see the module docstring); the `DecodeFn` of
        services.text_service. Raises ServiceError with the decoder's status."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        key = next(self._keys)
        call = self._open()
        outbox = self._outbox
        queue: asyncio.Queue = asyncio.Queue()
        self._routes[key] = (call, queue)
        finished = False
        try:
            outbox.put_nowait(decode_pb2.DecodeStreamRequest(start=decode_pb2.DecodeStreamStart(key=key, request=request)))
            while not finished:
                entries = [await self._next(queue, deadline, loop)]
                while not queue.empty():
                    entries.append(queue.get_nowait())
                events: list[Event] = []
                for entry in entries:
                    if isinstance(entry, ServiceError):  # shared by the stream's requests: raise a copy
                        finished = True  # the stream failed: nothing to cancel
                        raise ServiceError(entry.code, str(entry))
                    if entry.HasField("error"):
                        finished = True  # the decoder ended it
                        raise ServiceError(_CODES.get(entry.error.code, grpc.StatusCode.INTERNAL), entry.error.message)
                    events.extend(event_from_pb(e) for e in entry.events)
                if not events:
                    continue  # (the contract never sends an empty entry)
                finished = isinstance(events[-1], Finished)
                yield events
        finally:
            self._routes.pop(key, None)
            if not finished and self._call is call:  # (a dead stream has cancelled everything)
                outbox.put_nowait(decode_pb2.DecodeStreamRequest(cancel=decode_pb2.DecodeStreamCancel(key=key)))

    @staticmethod
    async def _next(queue: asyncio.Queue, deadline: float | None, loop: asyncio.AbstractEventLoop):
        if deadline is not None and loop.time() >= deadline:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        if not queue.empty():
            return queue.get_nowait()
        if deadline is None:
            return await queue.get()
        try:
            async with asyncio.timeout_at(deadline):
                return await queue.get()
        except TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None

    async def close(self) -> None:
        """Cancel the open stream (its requests fail) and wait for its tasks."""
        if self._call is not None:
            self._call.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


_CODES = {code.value[0]: code for code in grpc.StatusCode}
