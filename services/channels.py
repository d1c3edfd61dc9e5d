"""Channels to a tokenwire server, and server-streaming calls that cancel when left early.

The one place a client channel is built: the Python clients, the text service's channel to its
decoder and `tokenwire health` all call `open_channel`. Plaintext without TLS settings; TLS (or
mutual TLS) with them; a bearer token only over TLS (gRPC itself refuses call credentials on a
plaintext channel, and we refuse earlier, with a message that says what to configure).
"""

from __future__ import annotations

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

