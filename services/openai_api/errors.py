"""The one place failures become HTTP statuses and the OpenAI error body.

Every non-2xx response is `{"error": {"message", "type", "param", "code"}}`:
  * a body FastAPI cannot parse or validate (malformed JSON, a bad field): 400, never 422;
  * a field we know but do not support: 400 naming it (`param`);
  * an unknown model: 404; an unknown path: 404; a method not allowed: 405;
  * the text service's status, mapped by `from_grpc`: INVALID_ARGUMENT 400 (param: the OpenAI
    field the text service's field path comes from; a constraint's message is rewritten to name
    that field, e.g. `response_format.json_schema.schema: unsupported keyword ...`),
    RESOURCE_EXHAUSTED 429 with Retry-After, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything
    else 500 (logged);
  * anything unexpected: 500, logged with its traceback, never sent.
After a stream's 200 the same body goes out as an SSE `data:` event (services.openai_api.streaming).
"""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tokenwire.api")

RETRY_AFTER_S = 1  # what a 429 tells clients to wait: the queue drains at the decoder's pace


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


NOT_SUPPORTED = "is not supported by this server"


def not_supported(field: str, why: str = NOT_SUPPORTED) -> ApiError:
    return ApiError(400, f"{field} {why}", param=field, code="unsupported_parameter")


def unknown_model(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model {model!r} does not exist; this server serves {served!r}", param="model", code="model_not_found")


# The text service's field paths (GenerateRequest, and the DecodeRequest it makes) -> the OpenAI
# request field they come from. The first path component decides.
_PARAMS = {
    "prompt": "prompt",
    "chat": "messages",
    "prompt_token_ids": "prompt",
    "stop_strings": "stop",
    "sampling": None,  # sampling.temperature -> temperature, by the last component
    "stopping": None,  # by the second component: _STOPPING_PARAMS (the request's own max_tokens field by default)
    "top_logprobs": "top_logprobs",
    "request_id": None,
    "constraint": None,  # by the whole path: _CONSTRAINT_PARAMS
}
_STOPPING_PARAMS = {
    "max_output_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
    "min_output_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
}
# The constraint's fields -> the OpenAI field they come from (services.openai_api.structured,
# services.openai_api.tools). Their messages are rewritten to name the OpenAI field too.
_CONSTRAINT_PARAMS = {
    "constraint.json_schema": "response_format.json_schema.schema",
    "constraint.json_object": "response_format",
    "constraint.lark": "tools",
    "constraint.regex": "response_format",
}


def _param(message: str, prompt_field: str, max_tokens_field: str) -> str | None:
    path = message.split(":", 1)[0].strip()
    head = path.split(".", 1)[0].split("[", 1)[0]
    if head not in _PARAMS:
        return None
    if head == "constraint":
        return _CONSTRAINT_PARAMS.get(path, "response_format")
    if head == "sampling":
        return path.rsplit(".", 1)[-1]
    param = _PARAMS[head]
    if head == "stopping":  # stopping.stop_token_ids[2] -> stop_token_ids
        field = path.split(".")[1] if "." in path else ""
        param = _STOPPING_PARAMS.get(field.split("[", 1)[0], "max_tokens")
    return {"prompt": prompt_field, "max_tokens": max_tokens_field}.get(param, param)


def from_grpc(error: grpc.aio.AioRpcError, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> ApiError:
    """The text service's status as an ApiError; `prompt_field`/`max_tokens_field` name the
    request's own fields (chat: messages, max_completion_tokens)."""
    code, details = error.code(), error.details() or error.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        path, sep, reason = details.partition(":")
        if sep and path.strip() in _CONSTRAINT_PARAMS:  # the client's own field name, not ours
            details = f"{_CONSTRAINT_PARAMS[path.strip()]}:{reason}"
            return ApiError(400, details, param=_CONSTRAINT_PARAMS[path.strip()])
        return ApiError(400, details, param=_param(details, prompt_field, max_tokens_field))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, details, "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"the model service is unavailable: {details}", "service_unavailable_error", code="service_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the request took longer than the server's deadline", "timeout_error", code="timeout")
    log.error("text service answered %s: %s", code.name, details)
    return ApiError(500, "internal error; see the server log", "server_error", code="internal_error")


# the names pydantic gives the members of a union in an error's location, not request fields
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(location) -> str | None:
    """A pydantic error location as the request field it names: ("body", "messages", 0,
    "content", "function-after[...]") -> "messages[0].content"."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "body" and not path:
            continue
        elif part.isidentifier() and part not in _UNION_MEMBERS:
            path += ("." if path else "") + part
    return path or None


def install(app: FastAPI) -> None:
    """Error handlers that give every failure the OpenAI shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = _field_path(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if error.status_code < 500 else "server_error"
        return ApiError(error.status_code, str(error.detail), type_, headers=dict(error.headers or {})).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=error)
        return ApiError(500, "internal error; see the server log", "server_error", code="internal_error").response()
