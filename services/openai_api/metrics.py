"""The HTTP front's Prometheus metrics, in a registry of its own, served at /metrics.

  * `tokenwire_api_requests_total{path, status}`: every response by route and HTTP status,
    counted as it starts (an error inside a stream, after its 200, is
    `tokenwire_api_stream_errors_total`; a client gone before the answer, 499);
  * `tokenwire_api_ttft_seconds`: request arrival to the first output token, per choice;
  * `tokenwire_api_inter_token_seconds`: the gap between a choice's deltas, once per token it
    brought (a delta of k tokens after a gap g counts g/k, k times);
  * `tokenwire_api_prompt_tokens_total`, `tokenwire_api_completion_tokens_total`: from usage;
  * `tokenwire_api_requests_in_flight`: generation requests being served now (0 when idle: the
    load test's "nothing left behind").
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.metrics import STEP_BUCKETS, TTFT_BUCKETS


class ApiMetrics:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenwire_api_requests", "HTTP responses by route and status", ["path", "status"], registry=r)
        self.stream_errors = Counter("tokenwire_api_stream_errors", "errors sent inside a stream after its 200", registry=r)
        self.ttft = Histogram("tokenwire_api_ttft_seconds", "request arrival to a choice's first token", buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("tokenwire_api_inter_token_seconds", "time between a choice's tokens", buckets=STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenwire_api_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("tokenwire_api_completion_tokens", "output tokens sent", registry=r)
        self.in_flight = Gauge("tokenwire_api_requests_in_flight", "generation requests being served", registry=r)

    def responded(self, path: str, status: int) -> None:
        self.requests.labels(path, str(status)).inc()

    def timer(self) -> "ChoiceTimer":
        return ChoiceTimer(self, self.clock())


class ChoiceTimer:
    """One choice's token timing, from the request's arrival."""

    def __init__(self, metrics: ApiMetrics, started: float) -> None:
        self.metrics, self.last, self.first = metrics, started, True

    def tokens(self, count: int) -> None:
        if not count:
            return
        now = self.metrics.clock()
        self.metrics.completion_tokens.inc(count)
        if self.first:
            self.metrics.ttft.observe(now - self.last)
            self.first = False
        else:
            for _ in range(count):
                self.metrics.inter_token.observe((now - self.last) / count)
        self.last = now
