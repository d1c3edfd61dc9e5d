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

from engine.engine import EngineStopped, QueueFull

log = logging.getLogger("tokenwire.errors")


class InvalidArgument(ValueError):
    """A request field is out of range. `field` is its path in the request message."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


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
    if isinstance(error, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        return error.code(), error.details() or error.code().name
    return None


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    mapped = status_for(error)
    if mapped is None:
        log.error("unexpected error in %s", method, exc_info=error)
        mapped = (grpc.StatusCode.INTERNAL, f"internal error in {method}; see the server log")
    code, message = mapped
    await context.abort(code, message)


def grpc_errors(method):
    """Wrap a servicer method (coroutine or async generator) so that errors map to status codes."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:
                await _abort(context, name, error)

        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:
            await _abort(context, name, error)

    return unary
