"""Metrics: scraped from the real HTTP endpoint and parsed with prometheus_client's own parser
(tracker unit tests parse `exposition()`, the very text the endpoint serves, without a socket).

The end-to-end test puts the per-request tracker into a Decoder servicer exactly as the
servers wire it (a few lines around the stream), runs the real engine with the scripted model
behind a real grpc.aio server with `StatusCodeInterceptor`, and checks what a scrape shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import urllib.request

import grpc
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.engine import EngineConfig, EngineStats
from engine.core.kv_pages import PageStats
from engine.core.events import FinishReason
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.client import decode_request
from services.decode_server import start_decode_server
from engine.core.errors import InvalidArgument
from services.metrics import Metrics, start_metrics_server, stop_metrics_server
from support.waiting import until

FAMILIES = {
    "tokenwire_slots_in_use": "gauge",
    "tokenwire_queue_depth": "gauge",
    "tokenwire_requests": "counter",
    "tokenwire_responses": "counter",
    "tokenwire_time_to_first_token_seconds": "histogram",
    "tokenwire_inter_token_latency_seconds": "histogram",
    "tokenwire_prompt_tokens": "counter",
    "tokenwire_completion_tokens": "counter",
    "tokenwire_cancellations": "counter",
    "tokenwire_validation_rejects": "counter",
    "tokenwire_engine_step_seconds": "histogram",
}


def parse(text: str) -> dict[str, prometheus_client.Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape(port: int) -> dict[str, prometheus_client.Metric]:
    """What Prometheus would see: GET the endpoint, parse the text format."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse(response.read().decode())


def read(metrics: Metrics) -> dict[str, prometheus_client.Metric]:
    """The same text without a socket (the endpoint serves exactly `exposition()`)."""
    return parse(metrics.exposition().decode())


def value(families, sample_name: str, **labels) -> float:
    matches = [s.value for f in families.values() for s in f.samples if s.name == sample_name and s.labels == labels]
    assert len(matches) == 1, f"{sample_name}{labels}: {matches}"
    return matches[0]


@pytest.fixture
def served():
    metrics = Metrics()
    server, port = start_metrics_server(metrics, "127.0.0.1", 0)
    yield metrics, port
    stop_metrics_server(server)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the endpoint and the registry --------------------------------------------------------


def test_endpoint_serves_every_metric_with_its_type(served):
    metrics, port = served
    assert port > 0
    families = scrape(port)
    assert {name: families[name].type for name in FAMILIES} == FAMILIES
    for reason in ("stop", "length", "error", "cancelled"):  # exported at zero from the start
        assert value(families, "tokenwire_requests_total", reason=reason) == 0


def test_each_metrics_has_its_own_registry(served):
    metrics, port = served
    other = Metrics()
    with other.track("x", prompt_tokens=3) as tracker:
        tracker.finish("stop")
    assert value(scrape(port), "tokenwire_requests_total", reason="stop") == 0
    assert b'tokenwire_requests_total{reason="stop"} 1.0' in other.exposition()
    assert not any(family.name.startswith("tokenwire") for family in prometheus_client.REGISTRY.collect())


def test_engine_gauges_are_read_at_scrape_time(served):
    metrics, port = served

    stats = EngineStats(0, 0, True, 0.0, PageStats(total=1024, used=0, cached=0, free=1024))
    metrics.watch_engine(lambda: stats)
    families = scrape(port)
    assert value(families, "tokenwire_prefix_cache_hit_tokens_total") == 0
    assert value(families, "tokenwire_kv_pages_total") == 1024 and value(families, "tokenwire_preemptions_total") == 0
    pages = PageStats(total=1024, used=40, cached=6, free=978, queried_tokens=300, hit_tokens=120)
    stats = EngineStats(5, 3, True, 0.0, pages, preemptions=2)
    families = scrape(port)
    assert value(families, "tokenwire_queue_depth") == 5 and value(families, "tokenwire_slots_in_use") == 3
    assert value(families, "tokenwire_prefix_cache_queried_tokens_total") == 300
    assert value(families, "tokenwire_prefix_cache_hit_tokens_total") == 120
    assert value(families, "tokenwire_kv_pages_used") == 40 and value(families, "tokenwire_kv_pages_cached") == 6
    assert value(families, "tokenwire_preemptions_total") == 2
    stats = dataclasses.replace(stats, queue_depth=0)
    assert value(scrape(port), "tokenwire_queue_depth") == 0


# -- the per-request tracker ----------------------------------------------------------------


def test_tracker_times_tokens_and_logs_one_line(caplog):
    metrics = Metrics(clock=(clock := FakeClock()))
    with caplog.at_level(logging.INFO, logger="tokenwire.requests"):
        with metrics.track("req-1", prompt_tokens=5) as tracker:
            clock.now += 0.5
            tracker.tokens(1)  # first token: TTFT 0.5 s
            clock.now += 0.25
            tracker.tokens(2)  # two tokens together after 0.25 s: two gaps of 0.125 s
            clock.now += 0.1
            tracker.tokens(0)  # nothing arrived: not a gap
            tracker.finish(FinishReason.LENGTH)
            clock.now += 0.05
    f = read(metrics)
    assert value(f, "tokenwire_requests_total", reason="length") == 1
    assert value(f, "tokenwire_prompt_tokens_total") == 5
    assert value(f, "tokenwire_completion_tokens_total") == 3
    assert value(f, "tokenwire_time_to_first_token_seconds_count") == 1
    assert value(f, "tokenwire_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(f, "tokenwire_inter_token_latency_seconds_count") == 2
    assert value(f, "tokenwire_inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert value(f, "tokenwire_inter_token_latency_seconds_bucket", le="0.1") == 0
    assert value(f, "tokenwire_inter_token_latency_seconds_bucket", le="0.15") == 2
    [record] = caplog.records
    assert record.getMessage() == (
        "request_id=req-1 reason=length code=OK prompt_tokens=5 completion_tokens=3 ttft_s=0.5000 duration_s=0.9000"
    )


def test_first_batch_of_several_tokens_counts_zero_gaps():
    metrics = Metrics(clock=FakeClock())
    with metrics.track() as tracker:
        metrics.clock.now += 1.0
        tracker.tokens(3)
        tracker.finish("stop")
    assert tracker.ttft_s == pytest.approx(1.0)
    zero_gaps = metrics.registry.get_sample_value("tokenwire_inter_token_latency_seconds_bucket", {"le": "0.001"})
    assert zero_gaps == 2


@pytest.mark.parametrize(
    "error, reason, code, counter",
    [
        (asyncio.CancelledError(), "cancelled", "CANCELLED", "tokenwire_cancellations_total"),
        (GeneratorExit(), "cancelled", "CANCELLED", "tokenwire_cancellations_total"),
        (InvalidArgument("prompt_token_ids", "must not be empty"), "error", "INVALID_ARGUMENT", "tokenwire_validation_rejects_total"),
        (RuntimeError("boom"), "error", "INTERNAL", None),
    ],
)
def test_an_exception_is_the_reason(caplog, error, reason, code, counter):
    metrics = Metrics()
    with caplog.at_level(logging.INFO, logger="tokenwire.requests"), pytest.raises(type(error)):
        with metrics.track("req-2", prompt_tokens=4) as tracker:
            tracker.tokens(1)
            raise error
    f = read(metrics)
    assert value(f, "tokenwire_requests_total", reason=reason) == 1
    assert value(f, "tokenwire_completion_tokens_total") == 1  # produced before the end: still counted
    for name in ("tokenwire_cancellations_total", "tokenwire_validation_rejects_total"):
        assert value(f, name) == (1 if name == counter else 0)
    assert f"reason={reason} code={code}" in caplog.records[0].getMessage()


def test_finished_wins_over_a_later_close_and_reasons_are_checked():
    metrics = Metrics()
    with pytest.raises(GeneratorExit):
        with metrics.track() as tracker:
            tracker.finish(decode_pb2.FINISH_REASON_STOP)
            raise GeneratorExit  # the consumer closed the stream after Finished
    assert tracker.reason == "stop"
    assert metrics.registry.get_sample_value("tokenwire_cancellations_total") == 0
    for not_a_finish in ("cancelled", decode_pb2.FINISH_REASON_UNSPECIFIED):
        with pytest.raises(ValueError, match="stop or length"):
            metrics.track().finish(not_a_finish)


def test_log_line_quotes_awkward_values():
    metrics = Metrics()
    with metrics.track('id with "quotes" and spaces') as tracker:
        tracker.finish("stop")
    assert tracker.log_line().startswith(r'request_id="id with \"quotes\" and spaces" reason=stop code=OK')
    assert 'ttft_s=""' in tracker.log_line()  # no token: no TTFT


# -- end to end: the decode server as the CLI runs it ---------------------------------


async def test_decode_server_end_to_end(served):
    metrics, port = served
    model = ScriptedModel(vocab_size=1000, eos_token_ids=frozenset({2}), max_batch_size=2, max_context_length=64, step_delay_s=0.02)
    server = await start_decode_server(model, EngineConfig(max_queue_size=8), metrics=metrics)
    grpc_port = server.port
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            # 10, 11 -> 12, 13, 14 (LENGTH at 3)
            events = [e async for r in stub.Decode(decode_request([10, 11], max_output_tokens=3)) for e in r.events]
            assert events[-1].finished.reason == decode_pb2.FINISH_REASON_LENGTH
            # prompt ends in 1 -> the first token is EOS 2: STOP at prefill, no output token
            async for _ in stub.Decode(decode_request([1])):
                pass
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Decode(decode_request([])):
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            call = stub.Decode(decode_request([10], max_output_tokens=60))  # 59 steps of 20 ms uncancelled
            await call.read()
            call.cancel()
            await stub.GetModelInfo(decode_pb2.GetModelInfoRequest())
        # the server side of the cancel, and the slot's release, land asynchronously
        await until(lambda: value(f := scrape(port), "tokenwire_requests_total", reason="cancelled") == 1
                    and value(f, "tokenwire_slots_in_use") == 0, "the cancel counted and the slot free", interval_s=0.02)
        f = scrape(port)
        # freed by the cancel, not by running its 59 steps: 2 steps for the first request, then
        # 25 (0.5 s) at most for the cancel to land (about 1 when nothing else is running)
        assert model.decode_steps <= 2 + 25, model.decode_steps
    finally:
        await server.stop(None)
    assert value(f, "tokenwire_engine_step_seconds_count") >= 2  # the engine's steps are timed
    assert {r: value(f, "tokenwire_requests_total", reason=r) for r in ("stop", "length", "error", "cancelled")} == {
        "stop": 1, "length": 1, "error": 1, "cancelled": 1,
    }
    assert value(f, "tokenwire_validation_rejects_total") == 1
    assert value(f, "tokenwire_cancellations_total") == 1
    assert value(f, "tokenwire_prompt_tokens_total") == 2 + 1 + 0 + 1
    assert value(f, "tokenwire_completion_tokens_total") >= 3 + 0 + 1  # the cancelled one ran a few steps
    assert value(f, "tokenwire_time_to_first_token_seconds_count") == 2  # the STOP-at-prefill one had no token
    assert value(f, "tokenwire_slots_in_use") == 0 and value(f, "tokenwire_queue_depth") == 0
    assert value(f, "tokenwire_kv_pages_total") == 2 * 64 // 16 and value(f, "tokenwire_kv_pages_used") == 0
    decode = "/tokenwire.decode.v1.Decoder/Decode"
    assert value(f, "tokenwire_responses_total", method=decode, code="OK") == 2
    assert value(f, "tokenwire_responses_total", method=decode, code="INVALID_ARGUMENT") == 1
    assert value(f, "tokenwire_responses_total", method=decode, code="CANCELLED") == 1
    assert value(f, "tokenwire_responses_total", method="/tokenwire.decode.v1.Decoder/GetModelInfo", code="OK") == 1


def test_log_line_escapes_control_characters_and_bounds_length():
    metrics = Metrics()
    with metrics.track("evil\r\nrequest_id=forged\x1b[2J\x00" + "x" * 1000) as tracker:
        tracker.finish("stop")
    line = tracker.log_line()
    assert line.isprintable() and "\n" not in line and "\r" not in line
    assert line.startswith(r'request_id="evil\r\nrequest_id=forged\x1b[2J\x00')
    assert len(line) < 600
