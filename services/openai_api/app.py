"""The FastAPI application: the OpenAI routes over one channel to the text service.

Routes: GET /v1/models; POST /v1/completions and /v1/chat/completions (services.openai_api
.completions); POST /tokenize and /detokenize (passthroughs to the text service's Tokenizer;
a conversation's tool turns written as a generation writes them);
GET /health (liveness: the process answers), /ready (the text service reports TextGeneration
SERVING, which it does only while its decoder does: both backends reachable), /metrics.

A generation: validate the body (pydantic; 400 on failure, services.openai_api.errors), check the
model name (404), refuse known-but-unsupported fields (400 naming the first), log unknown ones,
check `response_format` and the tools (services.openai_api.structured, .tools; the model's tool
format is the one its chat template writes, asked of the text service's DescribeChat once, on
the first request that needs it), then open one text-service `Generate` per choice.
Non-streamed: collect them while watching for the client's disconnect. Streamed: wait for the
first event, so that a refusal (400, 429, 503) is still an HTTP status, then answer 200 with the
event stream. Leaving early in any way closes
the gRPC calls, which cancels the text service's work and frees the decode slot.

Bearer auth: with `auth_token` set, every route but /health and /ready needs
`Authorization: Bearer <token>` (compared in constant time), else 401.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protos.text.v1 import text_pb2, text_pb2_grpc
from services.client import AsyncTextClient
from services.openai_api import completions, conversion, errors, tools
from services.openai_api.completions import Endpoint, Header
from services.openai_api.errors import ApiError, from_grpc
from services.openai_api.metrics import ApiMetrics
from services.openai_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    REFUSAL_REASONS,
    TokenizeRequest,
    unsupported_fields,
)
from services.openai_api.streaming import ClientGone, EventStream, first_and_rest, merged, until_disconnected
from services.openai_api.tool_formats import FALLBACK, FORMATS, ToolFormat
from services.security import ClientTlsConfig
from services.service_names import TEXT_GENERATION_SERVICE

log = logging.getLogger("tokenwire.api")

OPEN_PATHS = ("/health", "/ready")
_FORMAT_NAMES = {text_pb2.TOOL_FORMAT_QWEN: "qwen", text_pb2.TOOL_FORMAT_SMOLLM2: "smollm2", text_pb2.TOOL_FORMAT_LLAMA3: "llama3"}
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500, 503, 504)}


@dataclass(frozen=True)
class ApiOptions:
    """What the app needs; services.config builds it from the api-server's flags."""

    text_target: str  # HOST:PORT of the text service
    model_name: str  # the one model name /v1/models lists and requests must name
    text_tls: ClientTlsConfig | None = None
    text_token: str | None = None  # the text service's bearer token
    auth_token: str | None = None  # the token clients of this front must send
    request_timeout_s: float | None = 600.0  # a generation's deadline at the text service (504 past it)
    ready_timeout_s: float = 2.0
    tool_format: str | None = None  # services.openai_api.tool_formats.FORMATS; None: the chat template's (DescribeChat)


def create_app(options: ApiOptions, metrics: ApiMetrics | None = None) -> FastAPI:
    metrics = metrics or ApiMetrics()
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # opened on the server's own event loop (a grpc.aio channel belongs to one loop)
        client = AsyncTextClient(options.text_target, options.request_timeout_s, options.text_tls, options.text_token)
        state["client"] = client
        try:
            yield
        finally:
            await client.channel.close()

    app = FastAPI(title="tokenwire OpenAI-compatible API", version="1", lifespan=lifespan)
    app.state.metrics = metrics
    errors.install(app)
    app.add_middleware(AuthAndCount, metrics=metrics, token=options.auth_token)

    def client() -> AsyncTextClient:
        return state["client"]

    async def tool_format() -> ToolFormat:
        """The model's tool format: the one its chat template writes, as the text service reads it
        (Tokenizer.DescribeChat; tool_formats), asked once; `options.tool_format` overrides it."""
        if "tool_format" not in state:
            stub = text_pb2_grpc.TokenizerStub(client().channel)
            try:
                described = await stub.DescribeChat(text_pb2.DescribeChatRequest(), timeout=options.request_timeout_s)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise from_grpc(error, "tools") from None
                # a text service older than DescribeChat: its template is unknown here
                log.warning("the text service cannot describe its chat template (no DescribeChat): its tool format is unknown")
                described = text_pb2.ChatDescription()
            template_format = _FORMAT_NAMES.get(described.tool_format)
            name = options.tool_format or template_format or FALLBACK
            fmt = FORMATS[name]
            if described.renders_tools and name == template_format:  # the template's own words for its own format
                fmt = fmt.shown_by_template()
            log.info("tool calls in the %r format (the chat template's: %s), tools shown by %s", name,
                     template_format or "none known", "the template" if fmt.template_shows_tools else "this front")
            state["tool_format"] = fmt
        return state["tool_format"]

    def check_model(model: str | None) -> None:
        if model is not None and model != options.model_name:
            raise errors.unknown_model(model, options.model_name)

    @app.get("/health", tags=["operations"])
    async def health() -> dict:
        return {}

    @app.get("/ready", tags=["operations"], responses={503: {"model": ErrorResponse}})
    async def ready() -> JSONResponse:
        stub = health_pb2_grpc.HealthStub(client().channel)
        try:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=TEXT_GENERATION_SERVICE), timeout=options.ready_timeout_s)
            serving = answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        if not serving:
            raise ApiError(503, "the text service or its decoder is not ready", "service_unavailable_error", code="not_ready")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["operations"])
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_ERRORS)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(options.model_name)]}

    @app.get("/v1/models/{model}", responses=_ERRORS)
    async def model(model: str) -> dict:
        check_model(model)
        return _model_card(options.model_name)

    async def generate(request: Request, body: CompletionRequest | ChatCompletionRequest, endpoint: Endpoint) -> Response:
        check_model(body.model)
        refused = unsupported_fields(body)
        if refused:
            raise errors.not_supported(refused[0], REFUSAL_REASONS.get(refused[0], errors.NOT_SUPPORTED))
        if body.model_extra:
            log.info("ignoring unknown fields of %s: %s", request.url.path, ", ".join(sorted(body.model_extra)))
        prefix = "chatcmpl-" if endpoint.chat else "cmpl-"
        header = Header(prefix + uuid.uuid4().hex, int(time.time()), options.model_name)
        plan, fmt = None, None
        if endpoint.chat:
            plan = tools.plan_of(body.tools, body.tool_choice, body.parallel_tool_calls)
            if plan is not None or _has_tool_turns(body.messages):
                fmt = await tool_format()
        requests = conversion.generate_requests(body, header.id, plan, fmt)
        calls = completions.Calls(plan, fmt)
        logprobs = bool(requests[0].logprobs)
        source = merged([_generation(client(), r) for r in requests])  # closing it cancels every call
        metrics.in_flight.inc()
        streaming = False
        try:
            if not body.stream:
                result = completions.collect(endpoint, header, len(requests), body.n or 1, source, metrics, logprobs, calls)
                return JSONResponse(await until_disconnected(request, result))
            try:  # the first event (or the refusal) before the 200
                _, events = await until_disconnected(request, first_and_rest(source))
            except grpc.aio.AioRpcError as error:
                raise from_grpc(error, endpoint.prompt_field, endpoint.max_tokens_field) from None
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = completions.chunks(
                endpoint, header, len(requests), body.n or 1, events, metrics, logprobs, include_usage, calls
            )

            async def closed() -> None:  # the response is over, however it ended
                await source.aclose()
                metrics.in_flight.dec()

            streaming = True
            return EventStream(stream, closed)
        except ClientGone:
            log.info("%s: the client disconnected; its generation was cancelled", header.id)
            return Response(status_code=499)  # nobody reads it; counted as such
        finally:
            if not streaming:
                await source.aclose()
                metrics.in_flight.dec()

    @app.post("/v1/completions", responses=_ERRORS)
    async def create_completion(request: Request, body: CompletionRequest) -> Response:
        return await generate(request, body, completions.COMPLETIONS)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def create_chat_completion(request: Request, body: ChatCompletionRequest) -> Response:
        return await generate(request, body, completions.CHAT)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            fmt = await tool_format() if _has_tool_turns(body.messages) else None
            pb = text_pb2.TokenizeRequest(chat=conversion.chat_pb(body.messages, body.add_generation_prompt, fmt=fmt))
        else:
            pb = text_pb2.TokenizeRequest(text=body.prompt, add_special_tokens=body.add_special_tokens)
        try:
            response = await text_pb2_grpc.TokenizerStub(client().channel).Tokenize(pb, timeout=options.request_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error, "messages" if body.messages is not None else "prompt") from None
        return {"tokens": list(response.token_ids), "count": len(response.token_ids)}

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        try:
            text = await client().detokenize(body.tokens)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error) from None
        return {"prompt": text}

    return app


def _has_tool_turns(messages) -> bool:
    """Whether the conversation holds tool results or earlier calls (written in the tool format)."""
    return any(m.role == "tool" or m.tool_calls is not None for m in messages)


async def _generation(client: AsyncTextClient, request: text_pb2.GenerateRequest):
    """One choice's Generate stream, started only when first read (so a request that fails or
    is cancelled before reading starts no call) and cancelled when closed early."""
    async with contextlib.aclosing(client.stream(request)) as responses:
        async for response in responses:
            yield response


class AuthAndCount:
    """ASGI middleware: the bearer token check (401 in the OpenAI shape) and the count of every
    response by route and status. Plain ASGI rather than `@app.middleware("http")`, whose
    wrapper stands between a streamed response and the client's disconnect."""

    def __init__(self, app, metrics: ApiMetrics, token: str | None) -> None:
        self.app, self.metrics = app, metrics
        self.expected = token.encode() if token else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        def count(status: int) -> None:
            nonlocal counted
            counted = True
            route = scope.get("route")
            self.metrics.responded(getattr(route, "path", "other"), status)

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":  # counted before the client can see it
                count(message["status"])
            await send(message)

        try:
            if self.expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
                refusal = ApiError(
                    401, "missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                    "authentication_error", code="invalid_api_key",
                ).response()
                await refusal(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        finally:
            if not counted:  # nothing was sent (the server failed before answering)
                count(500)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tokenwire"}
