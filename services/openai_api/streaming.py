"""Server-sent events, several choices' streams as one, and cancelling work when the client leaves.

  * `sse(obj)`: one `data: {json}\\n\\n` event; `DONE` ends every stream.
  * `merged(streams)`: the items of n async iterators as (choice index, item), in arrival order;
    an error in any ends the merge with it; leaving the merge closes every stream (each
    closing cancels its gRPC call: services.channels.cancelling_aio).
  * `until_disconnected(request, awaitable)`: the awaitable, cancelled if the client disconnects
    first (`ClientGone`). A non-streamed request has no other way to notice: nothing is sent
    until the result, so without this a client that left would keep its generation (and its
    decode slot) to the end. A streamed response is watched by Starlette's StreamingResponse,
    which cancels the body iterator on `http.disconnect` (uvicorn's HTTP/1.1 servers speak
    ASGI 2.3, where it listens), which closes the streams the same way.
The SSE framing is written here rather than with FastAPI's own EventSourceResponse generator
mode: that mode makes a route a generator for every request, and ours answers JSON when
`stream` is false and must pick the status (400, 429...) before any byte of a stream is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that, however it ends (finished, client gone, server stopping, even
    before its first byte), closes its events and then calls `closed`: the body iterator may
    never have started, so its own `finally` cannot be relied on for the cleanup."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], closed: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._closed = closed

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._closed()


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so `receive` only waits)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    if len(streams) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
            await queue.put((index, ended))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is ended:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_and_rest(stream: AsyncIterator[T]) -> tuple[T | None, AsyncIterator[T]]:
    """The stream's first item (None when it is empty) and an iterator over all of it again, so
    a stream's first failure can still become an HTTP status before the 200 is sent."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        return None, _empty()
    except BaseException:
        await stream.aclose()
        raise
    return first, _prepend(first, stream)


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    async with contextlib.aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def _empty() -> AsyncIterator:
    return
    yield
