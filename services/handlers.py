"""Re-wrapping a gRPC method handler: the one piece our server interceptors share.

A grpc.aio server interceptor that changes what a method does gets the method's
`RpcMethodHandler` and must return a new one of the same kind (unary/stream in, unary/stream out),
built with the matching grpc factory and keeping the response serializer. grpc offers no helper for
that, so it is written once here; the status counter (services.metrics), the request parser
(services.errors) and the bearer-token check (services.security) all use it.
"""

from __future__ import annotations

from typing import Any, Callable

import grpc

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}
_KEEP: Any = object()

Behaviour = Callable[..., Any]  # (request or request iterator, context) -> response(s)


def rewrap(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Behaviour], Behaviour],
    *,
    request_deserializer: Callable[[bytes], Any] | None = _KEEP,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that runs `wrap(its behaviour)`. The response
    serializer is kept; so is the request deserializer unless one (or None: the behaviour gets
    the raw bytes) is given."""
    for kind, factory in _FACTORIES.items():
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            deserializer = handler.request_deserializer if request_deserializer is _KEEP else request_deserializer
            return factory(
                wrap(behaviour), request_deserializer=deserializer, response_serializer=handler.response_serializer
            )
    raise TypeError(f"not an RPC method handler: {handler!r}")
