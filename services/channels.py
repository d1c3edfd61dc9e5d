"""Channels to a tokenwire server, and server-streaming calls that cancel when left early.

The one place a client channel is built: the Python clients, the text service's channel to its
decoder and `tokenwire health` all call `open_channel`. Plaintext without TLS settings; TLS (or
mutual TLS) with them; a bearer token only over TLS (gRPC itself refuses call credentials on a
plaintext channel, and we refuse earlier, with a message that says what to configure).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence, TypeVar

import grpc

from services.security import ClientTlsConfig, TlsError

T = TypeVar("T")

ChannelOptions = Sequence[tuple[str, int | str]]


def open_channel(
    target: str,
    tls: ClientTlsConfig | None = None,
    token: str | None = None,
    options: ChannelOptions | None = None,
    *,
    asynchronous: bool = True,
) -> grpc.aio.Channel | grpc.Channel:
    """A grpc.aio channel (or a blocking one with `asynchronous=False`) to `target`."""
    module = grpc.aio if asynchronous else grpc
    if tls is None:
        if token is not None:
            raise TlsError("a bearer token is only sent over TLS: configure a CA (and the server's TLS) as well")
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, tls.credentials(token), options=options)


def cancelling(call: Iterable[T]) -> Iterator[T]:
    """Iterate a server-streaming call; leaving early (break, error, close) cancels it."""
    try:
        yield from call
    finally:
        call.cancel()  # a no-op once the call has finished


async def cancelling_aio(call: AsyncIterable[T]) -> AsyncIterator[T]:
    """`cancelling` for a grpc.aio call: closing the iterator early cancels the RPC."""
    try:
        async for item in call:
            yield item
    finally:
        call.cancel()


async def read_ahead(source: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """Read `source` as fast as it delivers, and yield what has arrived whenever the consumer
    asks: one list per ask, in order, never empty. A consumer that keeps up gets one item per
    list; one that is behind (a slow write downstream) gets the backlog together, so it can
    send it as one message. Nothing that has arrived is held back.

    Memory: the backlog is what `source` produced and the consumer has not taken yet; for a
    decode stream that is at most the request's remaining output. Closing this iterator (or an
    error in `source`, raised to the consumer after the items before it) cancels the reader and
    closes `source`.
    """
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(("item", item))
        except Exception as error:  # handed to the consumer; a cancel of the pump stays a cancel
            queue.put_nowait(("error", error))
            return
        queue.put_nowait(("end", None))

    reader = asyncio.create_task(pump())
    try:
        ended = False
        while not ended:
            kind, value = await queue.get()
            batch: list[T] = []
            while True:
                if kind == "error":
                    if batch:
                        yield batch
                    error, value = value, None
                    try:
                        raise error  # type: ignore[misc]
                    finally:  # no frame local keeps the error (and the request state) in a cycle
                        error = None
                if kind == "end":
                    ended = True
                    break
                batch.append(value)  # type: ignore[arg-type]
                if queue.empty():
                    break
                kind, value = queue.get_nowait()
            if batch:
                yield batch
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
