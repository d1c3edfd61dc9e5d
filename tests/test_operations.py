"""Operating the stack: readiness, overload, cancellation, drain, a peer that dies, TLS.

Real servers on loopback; the decode side runs the scripted model, in-process or as its own
process (tests/support/scripted_decoder.py runs the same server and shutdown code as
`tokenwire decode-server`) when a test must kill or signal it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import signal
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.engine import EngineConfig
from engine.core.errors import ModelLoadFailed
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.client import AsyncTextClient, decode_request, generate_request
from services.decode_server import start_decode_server
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE
from services.security import ClientTlsConfig, ServerTlsConfig
from services.server import ServerOptions
from services.text_server import start_text_server
from support.decoder_process import start_scripted_decoder
from support.gated_steps import GatedSteps
from support.slow_factory import slow_scripted
from support.net import free_port
from support.waiting import LIMIT_S, until
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def scripted(**kw) -> ScriptedModel:
    return ScriptedModel(**{"vocab_size": 512, "eos_token_ids": frozenset({0, 2}), "max_context_length": 256, **kw})


async def health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def eventually(predicate, what: str = "the condition", limit_s: float = LIMIT_S) -> None:
    """Poll an async or sync predicate until true (bounded)."""
    await until(predicate, what, limit_s, interval_s=0.05)


async def decode_all(stub, request) -> list[dpb.DecodeEvent]:
    return [e async for r in stub.Decode(request) for e in r.events]


async def read_rest(call) -> list:
    """The remaining events of a call already read with `read()` (iteration cannot be mixed in)."""
    events = []
    while (response := await call.read()) != grpc.aio.EOF:
        events.extend(response.events)
    return events


async def status_of(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


# -- readiness -------------------------------------------------------------------------------


async def test_decode_readiness_waits_for_the_model_while_liveness_serves():
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return scripted()

    server = await start_decode_server(load_model=slow_load, wait_until_ready=False, health_interval_s=0.05)
    try:
        assert await health(server.port) == SERVING
        assert await health(server.port, DECODER_SERVICE) == NOT_SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await decode_all(stub, decode_request([5], max_output_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            release.set()
            await server.until_ready()
            await eventually(lambda: _is(server.port, SERVING))
            assert len(await decode_all(stub, decode_request([5], max_output_tokens=2))) == 3
    finally:
        release.set()
        await server.stop(None)


async def test_a_stop_while_the_model_loads_tells_whoever_waits_and_leaves_no_engine_running():
    """A SIGTERM (or a test's stop) before the model is ready: `until_ready` raises instead of
    waiting for a readiness that can no longer come, in process and with the engine in a child
    process, whose start, still under way as the server stopped, is stopped once it returns."""
    release = threading.Event()

    def slow_load():
        release.wait(LIMIT_S)
        return scripted()

    server = await start_decode_server(load_model=slow_load, wait_until_ready=False, health_interval_s=0.05)
    waiter = asyncio.ensure_future(server.until_ready())
    await server.stop(None)
    release.set()
    with pytest.raises(ModelLoadFailed, match="the server stopped while the model was loading"):
        await asyncio.wait_for(waiter, LIMIT_S)

    children_before = set(multiprocessing.active_children())
    server = await start_decode_server(spawn_model=functools.partial(slow_scripted, 1.0), wait_until_ready=False)
    await until(lambda: set(multiprocessing.active_children()) - children_before, "the engine's child started")
    (child,) = set(multiprocessing.active_children()) - children_before
    await server.stop(None)
    with pytest.raises(ModelLoadFailed, match="stopped while"):
        await asyncio.wait_for(server.until_ready(), LIMIT_S)
    await until(lambda: not child.is_alive(), "the engine's child, started after the stop, stopped")
    assert server.engine is None


def _past_max_positions():
    from engine.jax_backend.jax_model import JaxModel

    return JaxModel.load(TINY, max_context_length=1000)  # past its max_position_embeddings (256)


def _corrupt_weights():
    raise RuntimeError("the weights are corrupt")


@pytest.mark.parametrize(
    ("load_model", "reason", "code", "last_line"),
    [
        (_past_max_positions, "max_context_length must be in 1..256", 2, "refusing to serve: {reason}"),
        (_corrupt_weights, "RuntimeError: the weights are corrupt", 1,
         "loading the model failed: {reason}; exiting so a supervisor can restart the service"),
    ],
)
async def test_a_model_that_cannot_load_says_why_last_and_exits_2_for_a_configuration_error(
    load_model, reason, code, last_line, caplog
):
    """A ValueError at load (the model or its settings) can never work: exit 2; anything else
    may be the host's (exit 1, for a supervisor to restart). Either way the reason itself reaches
    the caller and is the last line, and readiness never comes."""
    server = await start_decode_server(load_model=load_model, wait_until_ready=False, health_interval_s=0.05)
    try:
        with pytest.raises(ModelLoadFailed, match=reason):
            await server.until_ready()
        assert await health(server.port, DECODER_SERVICE) == NOT_SERVING
    finally:
        assert await asyncio.wait_for(server.serve_until_signal(grace_s=0), 30) == code
    assert caplog.records[-1].levelno == logging.CRITICAL
    assert caplog.records[-1].getMessage().startswith(last_line.format(reason=reason))
    assert [r.exc_info is not None for r in caplog.records].count(True) == (code == 1)  # a refusal has no traceback


async def _is(port: int, status: int) -> bool:
    return await health(port, DECODER_SERVICE) == status


async def test_a_stalled_engine_is_not_ready_but_still_live():
    # its first decode step is held until the gate opens: stalled for as long as the test needs
    # (a slow step raced the health monitor against the step's end)
    model = GatedSteps(lambda step: step == 1, vocab_size=512, eos_token_ids=frozenset({0, 2}), max_context_length=256)
    server = await start_decode_server(model, stall_timeout_s=0.3, health_interval_s=0.05)
    try:
        await eventually(lambda: _is(server.port, SERVING), "ready")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = decode_pb2_grpc.DecoderStub(channel).Decode(decode_request([5], max_output_tokens=2))
            try:
                await eventually(lambda: model.entered.is_set(), "the decode step is held")
                await eventually(lambda: _is(server.port, NOT_SERVING), "not ready while stalled")
                assert await health(server.port) == SERVING  # liveness holds: restarting would not help
            finally:
                model.gate.set()
            assert len([e async for r in call for e in r.events]) == 3  # the step completes: 2 tokens + Finished
        await eventually(lambda: _is(server.port, SERVING), "ready again")
    finally:
        model.gate.set()
        await server.stop(None)


async def test_text_readiness_follows_the_decoder():
    decode = await start_decode_server(scripted(), health_interval_s=0.05)
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}", health_interval_s=0.05)
    try:
        await eventually(lambda: _text_is(text.port, SERVING))
        await decode.stop(None)
        await eventually(lambda: _text_is(text.port, NOT_SERVING))
        assert await health(text.port) == SERVING
        assert await health(text.port, "tokenwire.text.v1.Tokenizer") == SERVING  # needs no decoder
    finally:
        await text.stop(None)


async def test_a_decoder_slowed_for_a_moment_stays_ready_and_a_frozen_one_does_not():
    """The text service asks for the decoder's health every interval (50 ms here) and gives it the
    census's time to answer (two intervals, at least 0.5 s): a decoder stopped for 0.15 s, as a
    busy host can stall one, is never reported unavailable; one stopped for 2 s is, and is back
    when it resumes."""
    port = free_port()
    proc = start_scripted_decoder(port)
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{port}", health_interval_s=0.05)
    try:
        await eventually(lambda: _text_is(text.port, SERVING))
        seen = set()
        for _ in range(3):
            proc.send_signal(signal.SIGSTOP)
            for _ in range(6):  # 0.15 s stopped (3 intervals), its readiness read throughout
                await asyncio.sleep(0.025)
                seen.add(await health(text.port, TEXT_GENERATION_SERVICE))
            proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.2)
            seen.add(await health(text.port, TEXT_GENERATION_SERVICE))
        assert seen == {SERVING}, seen
        proc.send_signal(signal.SIGSTOP)
        await eventually(lambda: _text_is(text.port, NOT_SERVING), "a decoder stopped for long reported unavailable")
        proc.send_signal(signal.SIGCONT)
        await eventually(lambda: _text_is(text.port, SERVING), "the resumed decoder ready again")
    finally:
        proc.send_signal(signal.SIGCONT)
        await text.stop(None)
        proc.kill()


async def _text_is(port: int, status: int) -> bool:
    return await health(port, TEXT_GENERATION_SERVICE) == status


# -- overload ---------------------------------------------------------------------------------


@pytest.fixture
async def small_stack():
    """1 slot + 2 waiting = capacity 3; each step 20 ms."""
    model = scripted(max_batch_size=1, step_delay_s=0.02)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=2))
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    yield model, decode, text
    await text.stop(None)
    await decode.stop(None)


async def test_a_full_queue_is_resource_exhausted_at_once_and_liveness_holds(small_stack):
    model, decode, text = small_stack
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = decode_pb2_grpc.DecoderStub(channel)
        busy = [stub.Decode(decode_request([5], max_output_tokens=60, ignore_eos=True)) for _ in range(3)]
        await eventually(lambda: decode.engine.stats().queue_depth == 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode_all(stub, decode_request([5], max_output_tokens=3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await health(decode.port) == SERVING  # a full queue never fails liveness
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:  # passed through unchanged
            assert await status_of(client.complete("hello", max_output_tokens=3)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in busy:
            assert [e async for r in call for e in r.events][-1].finished.usage.completion_tokens == 60


async def test_overload_at_twice_capacity(small_stack):
    model, decode, text = small_stack
    async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
        results = await asyncio.gather(
            *(client.complete("hello", max_output_tokens=10, ignore_eos=True) for _ in range(6)), return_exceptions=True
        )
    codes = sorted(r.code().name if isinstance(r, grpc.aio.AioRpcError) else "OK" for r in results)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and "RESOURCE_EXHAUSTED" in codes and "OK" in codes, codes
    for r in results:
        if not isinstance(r, Exception):
            assert r.usage.completion_tokens == 10
    await eventually(lambda: decode.engine.stats().slots_in_use == 0 and decode.engine.stats().queue_depth == 0)


# -- cancellation -----------------------------------------------------------------------------


async def test_cancelling_a_waiting_request_frees_its_place(small_stack):
    """Each request runs 200 tokens, 199 steps of 20 ms (4 s), unless cancelled. A cancel that did
    nothing would let the waiting one leave the queue only by being admitted (a second prefill)
    once the running one had run all its steps."""
    model, decode, text = small_stack
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = decode_pb2_grpc.DecoderStub(channel)
        running = stub.Decode(decode_request([5], max_output_tokens=200, ignore_eos=True))
        await running.read()  # prefilled: it holds the one slot
        waiting = stub.Decode(decode_request([5], max_output_tokens=200, ignore_eos=True))
        await eventually(lambda: decode.engine.stats().queue_depth == 1)
        waiting.cancel()
        await eventually(lambda: decode.engine.stats().queue_depth == 0)
        assert model.prefills == 1 and decode.engine.stats().slots_in_use == 1  # it left, never admitted
        running.cancel()
        await eventually(lambda: decode.engine.stats().slots_in_use == 0 and model.slots_held == 0)
        assert model.prefills == 1
        assert model.decode_steps < 100, model.decode_steps  # 2 s: half of what it would run uncancelled


async def test_thousands_of_cancel_cycles_leak_nothing():
    # 1 ms steps, so that a 200-token request outlives its cancel (without a delay the scripted
    # model ran all 200 tokens before the cancel arrived, with or without cancellation)
    model = scripted(max_batch_size=8, step_delay_s=0.001)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=64))
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)

            async def cycle(i: int) -> None:
                call = stub.Generate(generate_request("hello", max_output_tokens=200, ignore_eos=True))
                if i % 2:
                    await call.read()  # cancel mid-stream; otherwise before the first token
                call.cancel()

            for start in range(0, 2000, 16):
                await asyncio.gather(*(cycle(i) for i in range(start, start + 16)))
        await eventually(lambda: decode.engine.stats().slots_in_use == 0 and decode.engine.stats().queue_depth == 0)
        assert model.slots_held == 0
        assert b"tokenwire_slots_in_use 0.0" in decode.metrics.exposition()
        # The 1,000 cancelled after their first token were admitted: run to their end, 8 at a time,
        # they would take 1000 * 199 / 8 = ~25,000 steps. Cancelled, they take a few each.
        assert model.prefills >= 1000 and model.decode_steps < 10_000, (model.prefills, model.decode_steps)
    finally:
        await text.stop(None)
        await decode.stop(None)


# -- drain and a peer that dies ------------------------------------------------------------------


async def test_drain_refuses_new_requests_and_finishes_in_flight_ones():
    decode = await start_decode_server(scripted(step_delay_s=0.02), health_interval_s=0.05)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            # 99 steps of 20 ms: in flight for 2 s, long after the drain began (a drain that did
            # not wait would stop the server under it)
            in_flight = stub.Decode(decode_request([5], max_output_tokens=100, ignore_eos=True))
            await in_flight.read()
            drained = asyncio.create_task(decode.drain(10))
            await eventually(lambda: _is(decode.port, NOT_SERVING))
            assert await status_of(decode_all(stub, decode_request([5], max_output_tokens=2))) == grpc.StatusCode.UNAVAILABLE
            assert not drained.done() and decode.engine.stats().slots_in_use == 1  # still waiting for it
            rest = await read_rest(in_flight)
            assert rest[-1].finished.usage.completion_tokens == 100
            assert await drained is True
    finally:
        await decode.stop(None)


async def test_sigterm_drains_and_exits_0():
    port = free_port()
    proc = start_scripted_decoder(port, "--step-delay", "0.02")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            # in flight for 2 s (99 steps of 20 ms): still running when the drain begins
            in_flight = stub.Decode(decode_request([5], max_output_tokens=100, ignore_eos=True))
            await in_flight.read()
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: _is(port, NOT_SERVING))
            assert await status_of(decode_all(stub, decode_request([5], max_output_tokens=2))) == grpc.StatusCode.UNAVAILABLE
            rest = await read_rest(in_flight)
            assert rest[-1].finished.usage.completion_tokens == 100
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        proc.kill()


async def test_a_dead_engine_takes_the_process_down_with_exit_1():
    port = free_port()
    proc = start_scripted_decoder(port, "--fail-at-step", "1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            code = await status_of(decode_all(decode_pb2_grpc.DecoderStub(channel), decode_request([5], max_output_tokens=5)))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(proc.wait, 15) == 1
    finally:
        proc.kill()


async def test_chaos_kill_the_decoder_mid_stream_then_restart_it():
    port = free_port()
    proc = start_scripted_decoder(port, "--step-delay", "0.02")
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{port}", health_interval_s=0.1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            call = stub.Generate(generate_request("hello", max_output_tokens=200, ignore_eos=True))
            await call.read()
            proc.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(read_rest(call), 10)  # promptly, no hang
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await eventually(lambda: _text_is(text.port, NOT_SERVING))
            assert await status_of(stub.Complete(generate_request("hello", max_output_tokens=2))) == grpc.StatusCode.UNAVAILABLE
            proc.wait(5)
            proc = start_scripted_decoder(port)
            await eventually(lambda: _text_is(text.port, SERVING), "the text service follows the restarted decoder", limit_s=20)
            completion = await stub.Complete(generate_request("hello", max_output_tokens=3))
            assert completion.usage.completion_tokens == 3
    finally:
        await text.stop(None)
        proc.kill()


# -- TLS ----------------------------------------------------------------------------------------


async def test_mutual_tls_between_services_and_bearer_auth_for_clients(pki):
    decode = await start_decode_server(
        scripted(),
        options=ServerOptions(tls=ServerTlsConfig(pki / "server.crt", pki / "server.key", client_ca=pki / "ca.crt")),
    )
    text_tls = ServerTlsConfig(pki / "server.crt", pki / "server.key")
    try:
        with pytest.raises(grpc.aio.AioRpcError):  # no client certificate: the decoder refuses the text service
            await start_text_server(
                TextTokenizer.from_dir(TINY), f"localhost:{decode.port}", connect_timeout_s=2,
                decoder_tls=ClientTlsConfig(ca=pki / "ca.crt"),
            )
        text = await start_text_server(
            TextTokenizer.from_dir(TINY), f"localhost:{decode.port}",
            ServerOptions(tls=text_tls, auth_token="let-me-in"),
            decoder_tls=ClientTlsConfig(ca=pki / "ca.crt", cert=pki / "client.crt", key=pki / "client.key"),
        )
        try:
            target = f"localhost:{text.port}"
            tls = ClientTlsConfig(ca=pki / "ca.crt")
            async with AsyncTextClient(target, tls=tls, token="let-me-in") as client:
                assert (await client.complete("hello", max_output_tokens=3)).usage.completion_tokens == 3
            async with AsyncTextClient(target, tls=tls, token="wrong") as client:
                assert await status_of(client.complete("hello", max_output_tokens=3)) == grpc.StatusCode.UNAUTHENTICATED
            async with AsyncTextClient(target) as plaintext:
                assert await status_of(plaintext.complete("hello", max_output_tokens=3)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await text.stop(None)
    finally:
        await decode.stop(None)
