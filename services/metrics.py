"""Prometheus metrics for one server process, and the per-request record that feeds them.

Data flow:
  * A servicer opens `metrics.track(request_id, prompt_tokens)` when a generation request
    arrives, reports output tokens as they leave (`tokens(n)`, or the `decode_response` /
    `generate_response` adapters for our two stream types) and the finish reason at Finished.
    Leaving the `with` block records the request exactly once: its reason, prompt tokens,
    and one structured log line. TTFT, inter-token gaps and completion tokens are recorded as
    they happen, so a request cancelled mid-stream still counts the tokens it produced.
  * An exception leaving the block is the reason when Finished was not seen: CancelledError
    or GeneratorExit (client cancel, deadline, server stop) -> `cancelled`; anything else ->
    `error` (and INVALID_ARGUMENT also counts as a validation reject). So the `reason` series
    of `tokenwire_requests_total` sum to every generation request the process saw.
  * `StatusCodeInterceptor` counts every RPC (generation or not, auth rejects included) by
    method and final gRPC status in `tokenwire_responses_total{method, code}`: the boundary is
    the one place that knows the status actually sent.
  * Engine gauges read `Engine.stats()` at scrape time (`watch_engine`), so they are never stale;
    so do the prefix cache's counters, which the engine keeps (hit rate = rate of
    `tokenwire_prefix_cache_hit_tokens_total` over `..._queried_tokens_total`), and speculative
    decoding's, by proposer (acceptance rate = rate of `tokenwire_speculative_accepted_tokens_total`
    over `..._proposed_tokens_total`; docs/speculative.md).

Each `Metrics` owns its `CollectorRegistry` (never the global default), so tests and several
servers in one process do not collide. `start_metrics_server` serves it over HTTP.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import logging
import time
from typing import Callable, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from services.errors import status_for
from services.handlers import rewrap
from services.weighted_histogram import WeightedHistogram

request_log = logging.getLogger("tokenwire.requests")

REASONS = ("stop", "length", "error", "cancelled")

# Seconds. TTFT spans a fast GPU prefill to a long CPU prompt behind a queue; gaps and steps
# span a GPU step to a batched CPU step of a 135M model, and stalls
# (docs/benchmarks.md, 'Figures behind code comments').
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class PageStatsLike(Protocol):
    total: int
    used: int
    cached: int
    queried_tokens: int
    hit_tokens: int


class SpeculationStatsLike(Protocol):
    proposer: str
    proposed: int
    accepted: int
    steps: int


class EngineStatsLike(Protocol):
    queue_depth: int
    slots_in_use: int
    pages: PageStatsLike
    preemptions: int
    speculation: SpeculationStatsLike


class _KvCacheCollector:
    """The engine's KV page pool and its counts, read at scrape time: cumulative counts kept by
    the engine (in another process) are counters that this process only reports, which a
    prometheus_client Counter (incremented here) cannot express."""

    def __init__(self, stats: Callable[[], EngineStatsLike]) -> None:
        self._stats = stats

    def collect(self):
        stats = self._stats()
        s = stats.pages
        yield GaugeMetricFamily("tokenwire_kv_pages_total", "KV cache pages, each of 16 positions (decode-server only).", value=s.total)
        yield GaugeMetricFamily("tokenwire_kv_pages_used", "KV cache pages held by running requests (a shared page once).", value=s.used)
        yield GaugeMetricFamily(
            "tokenwire_kv_pages_cached", "KV cache pages no request holds that keep a prompt prefix for reuse (evictable).",
            value=s.cached,
        )
        yield CounterMetricFamily(
            "tokenwire_preemptions", "Requests paused for want of KV pages and recomputed later (invisible to clients but for time).",
            value=stats.preemptions,
        )
        yield CounterMetricFamily(
            "tokenwire_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache (decode-server only).",
            value=s.queried_tokens,
        )
        yield CounterMetricFamily(
            "tokenwire_prefix_cache_hit_tokens", "Prompt tokens whose KV was found in cached pages instead of being computed.",
            value=s.hit_tokens,
        )
        yield from _speculation_metrics(stats.speculation)


def _speculation_metrics(s: SpeculationStatsLike):
    """Speculative decoding's counts, labelled by proposer; none while speculation is off."""
    families = [
        ("tokenwire_speculative_proposed_tokens", "Guessed ids sent to the model to verify (speculative decoding).", s.proposed),
        ("tokenwire_speculative_accepted_tokens", "Guessed ids the model accepted: each a token gained.", s.accepted),
        ("tokenwire_speculative_steps", "Verify steps (one pass over the weights for every row's guesses).", s.steps),
    ]
    for name, documentation, value in families:
        family = CounterMetricFamily(name, documentation, labels=["proposer"])
        if s.proposer:
            family.add_metric([s.proposer], value)
        yield family


class Metrics:
    """Every metric of one process, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.clock = clock
        r = self.registry
        self.slots_in_use = Gauge("tokenwire_slots_in_use", "Engine slots holding a request (decode-server only).", registry=r)
        self.queue_depth = Gauge("tokenwire_queue_depth", "Requests waiting for a slot and KV pages, preempted ones included (decode-server only).", registry=r)
        self.requests = Counter(
            "tokenwire_requests", "Generation requests by how they ended: stop, length, error, cancelled.", ["reason"], registry=r
        )
        self.responses = Counter(
            "tokenwire_responses", "RPCs of every method by the gRPC status code sent.", ["method", "code"], registry=r
        )
        self.time_to_first_token = Histogram(
            "tokenwire_time_to_first_token_seconds", "From a request's arrival to its first output token.",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.inter_token_latency = WeightedHistogram(
            "tokenwire_inter_token_latency_seconds",
            "Gap before each output token after the first (a gap shared by tokens that arrive together is split evenly).",
            STEP_BUCKETS, r,
        )
        self.prompt_tokens = Counter("tokenwire_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.completion_tokens = Counter("tokenwire_completion_tokens", "Output tokens sent.", registry=r)
        self.cancellations = Counter("tokenwire_cancellations", "Requests cancelled (client, deadline or shutdown).", registry=r)
        self.validation_rejects = Counter("tokenwire_validation_rejects", "Requests refused with INVALID_ARGUMENT.", registry=r)
        self.engine_step_seconds = Histogram(
            "tokenwire_engine_step_seconds", "Wall time of one engine decode step over all active slots.",
            buckets=STEP_BUCKETS, registry=r,
        )
        self.cpu_kernels = Gauge(
            "tokenwire_cpu_kernels", "1 for the state of the CPU decode kernels: on, off (a WARNING in the log says why) "
            "or not applicable (decode-server with a JAX model only).", ["state"], registry=r,
        )
        # text-server only: its decode replicas, each named by its address (services.replicas)
        self.decoder_requests = Counter(
            "tokenwire_decoder_requests", "Generation requests started on each decode replica (text-server only; "
            "a request moved to another replica before its first token counts on both).", ["replica"], registry=r,
        )
        self.decoder_in_flight = Gauge(
            "tokenwire_decoder_in_flight", "Generation requests in flight on each decode replica (text-server only).",
            ["replica"], registry=r,
        )
        self.decoder_resubmitted = Counter(
            "tokenwire_decoder_resubmitted", "Requests moved to another decode replica before their first token, their "
            "replica having failed or refused them with UNAVAILABLE (text-server only).", registry=r,
        )
        self.decoder_replicas = Gauge(
            "tokenwire_decoder_replicas", "Decode replicas behind the text service by state: ready, not_ready, refused "
            "(serving another model) (text-server only).", ["state"], registry=r,
        )
        for reason in REASONS:  # export zeros, so rates work before the first request of a kind
            self.requests.labels(reason)

    def watch_engine(self, stats: Callable[[], EngineStatsLike]) -> None:
        """Read the slot, queue and KV cache metrics from `stats()` (e.g. `engine.stats`) at every scrape."""
        self.slots_in_use.set_function(lambda: stats().slots_in_use)
        self.queue_depth.set_function(lambda: stats().queue_depth)
        self.registry.register(_KvCacheCollector(stats))

    def track(self, request_id: str = "", prompt_tokens: int = 0) -> "RequestTracker":
        """Start timing one generation request; use as `with metrics.track(...) as tracker:`."""
        return RequestTracker(self, request_id, prompt_tokens)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format, as the HTTP endpoint serves it."""
        return generate_latest(self.registry)


class RequestTracker:
    """One request's timings and counts; records itself once, when its `with` block ends."""

    def __init__(self, metrics: Metrics, request_id: str, prompt_tokens: int) -> None:
        self.metrics = metrics
        self.request_id = request_id  # may be set later, once the server has assigned one
        self.prompt_tokens = prompt_tokens  # may be set later (e.g. after tokenizing); counted at the end
        self.completion_tokens = 0
        self.reason: str | None = None
        self.code: grpc.StatusCode | None = None
        self.ttft_s: float | None = None
        self.duration_s: float | None = None
        self._start = metrics.clock()
        self._last: float | None = None  # when the previous output tokens arrived

    def tokens(self, n: int, now: float | None = None) -> None:
        """`n` output tokens are leaving now (one engine step may deliver several at once);
        `now`: the clock's reading, when the caller has one for many requests."""
        if n <= 0:
            return
        m = self.metrics
        if now is None:
            now = m.clock()
        if self._last is None:
            self.ttft_s = now - self._start
            m.time_to_first_token.observe(self.ttft_s)
            if n > 1:
                m.inter_token_latency.observe(0.0, n - 1)  # the rest of the first batch came with the first token
        else:
            m.inter_token_latency.observe((now - self._last) / n, n)
        m.completion_tokens.inc(n)
        self.completion_tokens += n
        self._last = now

    def finish(self, reason: str | enum.Enum | int) -> None:
        """The stream ended normally. `reason`: 'stop'/'length', an engine `FinishReason`, or a
        `decode_pb2.FinishReason` number. The first reason decided wins."""
        if self.reason is None:
            self.reason = _reason_name(reason)
            self.code = grpc.StatusCode.OK

    def decode_response(self, response: decode_pb2.DecodeResponse) -> None:
        """Record one Decode response: its Token events, and Finished (with usage) if last."""
        self.tokens(sum(1 for event in response.events if event.HasField("token")))
        if response.events and response.events[-1].HasField("finished"):
            finished = response.events[-1].finished
            self.prompt_tokens = finished.usage.prompt_tokens
            self.finish(finished.reason)

    def generate_response(self, response: text_pb2.GenerateResponse) -> None:
        """Record one Generate response: a TextDelta's ids, or TextFinished (with usage)."""
        if response.HasField("delta"):
            self.tokens(len(response.delta.token_ids))
        elif response.HasField("finished"):
            self.prompt_tokens = response.finished.usage.prompt_tokens
            self.finish(response.finished.reason)

    def __enter__(self) -> "RequestTracker":
        return self

    def __exit__(self, exc_type, error, traceback) -> bool:
        if self.reason is None:
            self._fail(error)
        self.duration_s = self.metrics.clock() - self._start
        m = self.metrics
        m.requests.labels(self.reason).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        level = logging.WARNING if self.reason == "error" else logging.INFO
        if request_log.isEnabledFor(level):  # (the line is built only when it is written)
            request_log.log(level, "%s", self.log_line())
        return False  # never swallow the exception

    def _fail(self, error: BaseException | None) -> None:
        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            self.reason, self.code = "cancelled", grpc.StatusCode.CANCELLED
            self.metrics.cancellations.inc()
            return
        self.reason = "error"
        if error is None:  # the block ended without Finished and without an exception: a servicer bug
            self.code = grpc.StatusCode.UNKNOWN
        else:
            mapped = status_for(error) if isinstance(error, Exception) else None
            self.code = mapped[0] if mapped else grpc.StatusCode.INTERNAL
        if self.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.metrics.validation_rejects.inc()

    def log_line(self) -> str:
        """logfmt: one line per request, greppable and machine-parsable."""
        fields = {
            "request_id": self.request_id,
            "reason": self.reason,
            "code": self.code.name if self.code else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": None if self.ttft_s is None else f"{self.ttft_s:.4f}",
            "duration_s": None if self.duration_s is None else f"{self.duration_s:.4f}",
        }
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())


def _reason_name(reason: str | enum.Enum | int) -> str:
    if isinstance(reason, enum.Enum):
        name = reason.name.lower()
    elif isinstance(reason, int):
        name = decode_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    else:
        name = reason
    if name not in ("stop", "length"):
        raise ValueError(f"a finished stream ends with stop or length, not {reason!r}")
    return name


MAX_LOGGED_VALUE = 256


def _logfmt_value(value: object) -> str:
    if value is None:
        return '""'
    text = str(value)[:MAX_LOGGED_VALUE]  # a client's request id is logged even when refused as too long
    if text and not any(c in text for c in ' ="\\') and text.isprintable():
        return text
    # Quote, and escape every non-printable character (CR, ESC, NUL...): client text cannot forge lines.
    return '"' + "".join(c if c.isprintable() and c not in '"\\' else _escape(c) for c in text) + '"'


def _escape(c: str) -> str:
    return {'"': '\\"', "\\": "\\\\", "\n": "\\n"}.get(c) or c.encode("unicode_escape").decode("ascii")


# -- every RPC's status code, at the server boundary ------------------------------------------


class StatusCodeInterceptor(grpc.aio.ServerInterceptor):
    """Counts each RPC's final status in `tokenwire_responses_total{method, code}`.

    Put it first in the server's interceptor list so it also sees what later interceptors
    (e.g. bearer auth) reject. Handlers must be async (coroutines or async generators), as
    all of ours are; a sync handler is passed through uncounted rather than run on the loop.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._responses = metrics.responses

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        count = functools.partial(self._count, handler_call_details.method)
        return rewrap(handler, lambda behavior: _counted(behavior, count))

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self._responses.labels(method, code.name).inc()


def _code_of(error: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.UNKNOWN  # what grpc sends for an unhandled exception


def _counted(behavior, count: Callable[[grpc.StatusCode], None]):
    """Wrap a handler, keeping its kind (grpc.aio dispatches on coroutine vs async generator)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as error:
                count(_code_of(error, context))
                raise
            count(context.code() or grpc.StatusCode.OK)

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request, context):
            try:
                result = await behavior(request, context)
            except BaseException as error:
                count(_code_of(error, context))
                raise
            count(context.code() or grpc.StatusCode.OK)  # a handler may set_code and return
            return result

        return call
    return behavior


# -- the HTTP endpoint ----------------------------------------------------------------------


def start_metrics_server(metrics: Metrics, host: str, port: int):
    """Serve `metrics` in the Prometheus text format at http://host:port/ (any path) on a daemon
    thread; port 0 picks a free port. Returns (server, bound port); stop with `stop_metrics_server`."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server, server.server_port


def stop_metrics_server(server) -> None:
    server.shutdown()
    server.server_close()
