"""The one place exceptions become gRPC status codes.

Every servicer method is wrapped with `grpc_errors`. Clients get a status code and a short
message, never a traceback; unexpected errors are logged in full server-side and reach the
client as INTERNAL with the request id to look up in the log.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError

from engine.core.errors import DecoderFault, EngineStopped, InvalidArgument, QueueFull, StreamEndedWithoutFinished
from services.handlers import rewrap

log = logging.getLogger("tokenwire.errors")


class ServiceError(Exception):
    """An error with a chosen status code (e.g. passed through from an upstream service)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status for a known error, or None for an unexpected one."""
    if isinstance(error, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, ServiceError):
        return error.code, str(error)
    if isinstance(error, DecoderFault):  # the decoder broke its contract: our fault, not the caller's
        return grpc.StatusCode.INTERNAL, str(error)
    if isinstance(error, StreamEndedWithoutFinished):  # the decoder went away mid-stream
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        return error.code(), error.details() or error.code().name
    return None


def _failure(method: str, error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status for `error`; an unexpected one is logged in full and becomes INTERNAL."""
    mapped = status_for(error)
    if mapped is None:
        log.error("unexpected error in %s", method, exc_info=error)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")
    elif mapped[0] == grpc.StatusCode.INTERNAL:
        log.error("%s: %s", method, mapped[1])
    return mapped


# `context.abort` is called after the `except` block, never inside it: the AbortError it raises
# would otherwise chain to our error, whose traceback keeps the failed request's frames (and
# their per-request state) alive until the next cycle collection.


def grpc_errors(method):
    """Wrap a servicer method (coroutine or async generator) so that errors map to status codes."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
                return
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:
                failure = _failure(name, error)
            await context.abort(*failure)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            failure = _failure(name, error)
        await context.abort(*failure)

    return unary


class ParseRequestsInHandler(grpc.aio.ServerInterceptor):
    """Parse each request message inside the handler, so bytes that are not a valid message get
    INVALID_ARGUMENT (grpc's own deserializer turns a parse failure into UNKNOWN, logs a
    traceback, and bypasses every other interceptor). For a streaming request (DecodeStream)
    each message is parsed as the handler reads it."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        problem = f"the request is not a valid message for {details.method}"

        async def parsed(raw: bytes, context):
            try:
                return parse(raw)
            except DecodeError:
                pass
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)

        async def parsed_stream(raws, context):
            async for raw in raws:
                yield await parsed(raw, context)

        def parse_first(behaviour):
            if handler.request_streaming and handler.response_streaming:

                async def stream_stream(raws, context):
                    async for response in behaviour(parsed_stream(raws, context), context):
                        yield response

                return stream_stream
            if handler.request_streaming:  # none of ours; kept whole for completeness

                async def stream_unary(raws, context):
                    return await behaviour(parsed_stream(raws, context), context)

                return stream_unary
            if handler.response_streaming and not inspect.isasyncgenfunction(behaviour):
                # a coroutine that sends with context.write (grpc_health's Watch, which gRPC's
                # client-side health checking calls): kept a coroutine, since grpc.aio refuses
                # a handler that mixes the two styles

                async def unary_write(raw, context):
                    return await behaviour(await parsed(raw, context), context)

                return unary_write
            if handler.response_streaming:

                async def unary_stream(raw, context):
                    async for response in behaviour(await parsed(raw, context), context):
                        yield response

                return unary_stream

            async def unary_unary(raw, context):
                return await behaviour(await parsed(raw, context), context)

            return unary_unary

        return rewrap(handler, parse_first, request_deserializer=None)
