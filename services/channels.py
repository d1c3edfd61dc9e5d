"""Channels to a tokenwire server, and server-streaming calls that cancel when left early.

The one place a client channel is built: the Python clients, the text service's channel to its
decoder and `tokenwire health` all call `open_channel`. Plaintext without TLS settings; TLS (or
mutual TLS) with them; a bearer token only over TLS or to a loopback address (gRPC itself
refuses call credentials on a plaintext channel; we refuse earlier, with a message that says
what to configure).
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence, TypeVar

import grpc

from services.security import ClientTlsConfig, TlsError, is_loopback_host, local_credentials

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
    """A grpc.aio channel (or a blocking one with `asynchronous=False`) to `target`.

    A token travels over TLS, or in plain text only to a loopback address: there gRPC's local
    credentials (LOCAL_TCP, which check that the peer is on this host) carry it, since gRPC
    sends no call credentials over an insecure channel. Anywhere else a token without TLS is
    refused here, before anything is sent."""
    module = grpc.aio if asynchronous else grpc
    if tls is not None:
        return module.secure_channel(target, tls.credentials(token), options=options)
    if token is None:
        return module.insecure_channel(target, options=options)
    if not is_loopback_target(target):
        raise TlsError(
            f"a bearer token is sent only over TLS or to a loopback address, and {target} is neither: "
            "configure a CA (and the server's TLS) as well"
        )
    return module.secure_channel(target, local_credentials(token), options=options)


def is_loopback_target(target: str) -> bool:
    """Whether a gRPC target (HOST:PORT, [V6]:PORT, or a dns:/ipv4:/ipv6: URI of one address)
    names this host's loopback interface."""
    address = target
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    if "," in address:  # several addresses: all must be loopback
        return all(is_loopback_target(part) for part in address.split(","))
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return is_loopback_host(host.strip("[]"))


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

