"""Many decode replicas behind one text service: gRPC's round_robin with health checks, the
DecodeStream pool (one stream per ready replica), resubmission of requests that had not started,
one model across replicas, per-replica metrics.

Real servers on loopback, each replica on an address of its own (127.0.0.1, .2, .3, ...: Linux
routes all of 127/8 to lo), the text service pointed at all of them as one gRPC target
(`ipv4:A:P,B:P,C:P`). Replicas run the scripted model in this process, or as a process of their
own (tests/support/scripted_decoder.py) where a test kills one. Every replica has a short
maximum connection age (AGE_S), so the streams here outlive several GOAWAYs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.text.v1 import text_pb2_grpc
from services.client import AsyncTextClient, generate_request
from services.decode_server import DecodeServer, start_decode_server
from services.replicas import Address, model_service_name, resolve, service_config
from services.server import ServerOptions
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE
from services.text_server import TextServer, start_text_server
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
AGE_S = 3.0  # the replicas' maximum connection age
INTERVAL_S = 0.1  # the text service's census and readiness interval
LIMIT_S = 10.0  # bound on any one wait: far above the work waited for
# the model of tests/support/scripted_decoder.py, whose vocabulary and EOS ids fit tiny-llama
MODEL = dict(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_context_length=256)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)


def prompt(tokenizer: TextTokenizer) -> str:
    """A prompt whose scripted output (301, 302, ...) is whole words, each sent as it comes."""
    text = "hello " + tokenizer.decode([300], keep_special_tokens=True)
    assert tokenizer.encode(text)[-1] == 300
    return text


async def replica(host: str, step_delay_s: float = 0.0, **model) -> DecodeServer:
    scripted = ScriptedModel(**{**MODEL, "max_batch_size": 4, "step_delay_s": step_delay_s, **model})
    return await start_decode_server(
        scripted, EngineConfig(max_queue_size=64), ServerOptions(host=host, max_connection_age_s=AGE_S),
        health_interval_s=0.05,
    )


def address(server: DecodeServer, host: str) -> str:
    return f"{host}:{server.port}"


def target(*addresses: str) -> str:
    return "ipv4:" + ",".join(addresses)


async def until(predicate, what: str, limit_s: float = LIMIT_S, interval_s: float = 0.02) -> float:
    """Poll until `predicate()`; returns the seconds it took; fails the test past `limit_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        assert loop.time() - start < limit_s, f"{what}: not reached in {limit_s} s"
        await asyncio.sleep(interval_s)
    return loop.time() - start


async def text_server(tokenizer, decoder_target: str) -> TextServer:
    return await start_text_server(tokenizer, decoder_target, health_interval_s=INTERVAL_S, connect_timeout_s=LIMIT_S)


def on_replica(text: TextServer, metric: str, replica: str) -> float:
    return text.metrics.registry.get_sample_value(metric, {"replica": replica}) or 0.0


async def health(host: str, port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def stop_all(*servers) -> None:
    for server in servers:
        if server is not None:
            await server.stop(None)


# -- the pieces --------------------------------------------------------------------------------


async def test_targets_resolve_to_every_address_as_grpc_would():
    assert await resolve("ipv4:127.0.0.1:5,127.0.0.2:6") == (
        [Address("ipv4:127.0.0.1:5", "127.0.0.1:5"), Address("ipv4:127.0.0.2:6", "127.0.0.2:6")], None
    )
    assert await resolve("127.0.0.3:7") == ([Address("ipv4:127.0.0.3:7", "127.0.0.3:7")], None)
    assert await resolve("ipv6:[::1]:8") == ([Address("ipv6:[::1]:8", "[::1]:8")], None)
    for name in ("dns:///localhost:9", "localhost:9", "dns://8.8.8.8/localhost:9"):
        addresses, host = await resolve(name)
        assert host == "localhost"
        assert Address("ipv4:127.0.0.1:9", "127.0.0.1:9") in addresses, name
    assert await resolve("dns:///no-such-host.invalid:9") == ([], "no-such-host.invalid")


def test_the_channel_balances_round_robin_over_replicas_healthy_under_the_models_name():
    config = json.loads(service_config("tokenwire.decode.v1.Decoder/model:abc"))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "tokenwire.decode.v1.Decoder/model:abc"}
    [method] = config["methodConfig"]
    assert {n["method"] for n in method["name"]} == {"GetModelInfo", "DecodeStream"}
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_the_models_name_differs_with_the_model_but_not_with_the_batch_size():
    one = ScriptedModel(**MODEL, max_batch_size=4).info
    assert model_service_name(one) == model_service_name(ScriptedModel(**MODEL, max_batch_size=8).info)
    assert model_service_name(one) != model_service_name(ScriptedModel(**MODEL, model_id="other").info)
    assert model_service_name(one) != model_service_name(ScriptedModel(**{**MODEL, "max_context_length": 128}).info)
    assert model_service_name(one).startswith(DECODER_SERVICE + "/")


async def test_health_watch_answers_through_the_servers_interceptors():
    """gRPC's client-side health checking is a Watch per connection: it must pass our servers'
    interceptors (grpc_health's Watch writes with context.write instead of yielding)."""
    server = await replica("127.0.0.1")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=DECODER_SERVICE))
            assert (await asyncio.wait_for(watch.read(), LIMIT_S)).status == health_pb2.HealthCheckResponse.SERVING
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service=DECODER_SERVICE + "/model:other"))
            assert (await asyncio.wait_for(unknown.read(), LIMIT_S)).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            drained = asyncio.create_task(server.drain(1.0))
            assert (await asyncio.wait_for(watch.read(), LIMIT_S)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            unknown.cancel()
            await drained
    finally:
        await server.stop(None)


# -- spread ------------------------------------------------------------------------------------


async def test_sixty_requests_spread_over_three_replicas(tokenizer):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    replicas = [await replica(h, step_delay_s=0.005) for h in hosts]
    names = [address(r, h) for r, h in zip(replicas, hosts)]
    text = await text_server(tokenizer, target(*names))
    try:
        await until(lambda: text.upstream.stream_replicas() == sorted(names), "a stream on every replica")
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            calls = (client.complete(prompt(tokenizer), max_output_tokens=8, ignore_eos=True) for _ in range(60))
            done = await asyncio.wait_for(asyncio.gather(*calls), LIMIT_S)
        assert [c.usage.completion_tokens for c in done] == [8] * 60
        served = [r.engine.model.prefills for r in replicas]
        assert sum(served) == 60 and all(15 <= n <= 25 for n in served), served
        # the text service counts the same, per replica address, and nothing is left in flight
        assert [on_replica(text, "tokenwire_decoder_requests_total", n) for n in names] == served
        assert [on_replica(text, "tokenwire_decoder_in_flight", n) for n in names] == [0, 0, 0]
        assert text.metrics.registry.get_sample_value("tokenwire_decoder_replicas", {"state": "ready"}) == 3
    finally:
        await stop_all(text, *replicas)


# -- drain -------------------------------------------------------------------------------------


async def test_a_draining_replica_gets_no_new_request_while_the_others_serve(tokenizer):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    replicas = [await replica(h, step_delay_s=0.02) for h in hosts]
    names = [address(r, h) for r, h in zip(replicas, hosts)]
    draining, name = replicas[2], names[2]
    text = await text_server(tokenizer, target(*names))
    try:
        await until(lambda: text.upstream.stream_replicas() == sorted(names), "a stream on every replica")
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            # one long request per replica (least-loaded placement): in flight for 2 s, 100
            # steps of 20 ms, long after the drain began and past the connection age
            long = [
                asyncio.create_task(client.complete(prompt(tokenizer), max_output_tokens=100, ignore_eos=True))
                for _ in range(3)
            ]
            await until(lambda: draining.engine.stats().slots_in_use == 1, "the long request runs on the replica")
            drained = asyncio.create_task(draining.drain(LIMIT_S))
            # at once: requests that reach it before the text service knows are refused there
            # (UNAVAILABLE, nothing sent) and start again elsewhere; no caller sees it
            short = [client.complete(prompt(tokenizer), max_output_tokens=3, ignore_eos=True) for _ in range(15)]
            assert [c.usage.completion_tokens for c in await asyncio.gather(*short)] == [3] * 15
            took = await until(lambda: name not in text.upstream.stream_replicas(), "its stream retired", limit_s=1.0)
            assert took < 1.0
            before = draining.engine.model.prefills
            others_before = sum(r.engine.model.prefills for r in replicas[:2])
            short = [client.complete(prompt(tokenizer), max_output_tokens=3, ignore_eos=True) for _ in range(30)]
            assert [c.usage.completion_tokens for c in await asyncio.gather(*short)] == [3] * 30
            assert draining.engine.model.prefills == before  # not one new request
            assert sum(r.engine.model.prefills for r in replicas[:2]) == others_before + 30
            # its in-flight request ran to its end, and so did the drain
            assert [c.usage.completion_tokens for c in await asyncio.wait_for(asyncio.gather(*long), LIMIT_S)] == [100] * 3
            assert await asyncio.wait_for(drained, LIMIT_S) is True
    finally:
        await stop_all(text, *replicas)


async def test_a_stalled_replica_gets_no_new_request_within_a_second(tokenizer):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    replicas = [await replica(h, step_delay_s=0.005) for h in hosts[:2]]
    scripted = ScriptedModel(**MODEL, max_batch_size=4, step_delay_s=0.005)
    stalling = await start_decode_server(
        scripted, options=ServerOptions(host=hosts[2], max_connection_age_s=AGE_S), stall_timeout_s=0.3,
        health_interval_s=0.05,
    )
    names = [address(r, h) for r, h in zip([*replicas, stalling], hosts)]
    text = await text_server(tokenizer, target(*names))
    try:
        await until(lambda: text.upstream.stream_replicas() == sorted(names), "a stream on every replica")
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            scripted.step_delay_s = 2.0  # its engine stops making progress...
            stuck = [  # ...with work pending: one per replica (least-loaded, ties in turn), one waits on it
                asyncio.create_task(client.complete(prompt(tokenizer), max_output_tokens=3, ignore_eos=True))
                for _ in range(3)
            ]
            await until(lambda: stalling.engine.stats().slots_in_use == 1, "a request on the stalling replica")
            loop = asyncio.get_running_loop()
            await until_async(
                lambda: health(hosts[2], stalling.port, DECODER_SERVICE), health_pb2.HealthCheckResponse.NOT_SERVING
            )
            stalled_at = loop.time()
            await until(lambda: names[2] not in text.upstream.stream_replicas(), "its stream retired")
            assert loop.time() - stalled_at < 1.0
            before = scripted.prefills
            short = [client.complete(prompt(tokenizer), max_output_tokens=3, ignore_eos=True) for _ in range(20)]
            assert [c.usage.completion_tokens for c in await asyncio.gather(*short)] == [3] * 20
            assert scripted.prefills == before
            scripted.step_delay_s = 0.005
            assert [c.usage.completion_tokens for c in await asyncio.wait_for(asyncio.gather(*stuck), LIMIT_S)] == [3] * 3
    finally:
        await stop_all(text, stalling, *replicas)


async def test_streams_outlive_the_connection_age(tokenizer):
    """A decode server's GOAWAY at its connection age lets open calls run on: a request longer
    than several ages completes, and nothing is moved or failed."""
    server = await start_decode_server(
        ScriptedModel(**MODEL, max_batch_size=4, step_delay_s=0.02),
        options=ServerOptions(max_connection_age_s=0.3), health_interval_s=0.05,
    )
    text = await text_server(tokenizer, f"127.0.0.1:{server.port}")
    try:
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            # 100 steps of 20 ms: 2 s, about 6 connection ages
            long = await asyncio.wait_for(client.complete(prompt(tokenizer), max_output_tokens=100, ignore_eos=True), LIMIT_S)
            assert long.usage.completion_tokens == 100
            assert (await client.complete(prompt(tokenizer), max_output_tokens=3)).usage.completion_tokens == 3
        assert (text.metrics.registry.get_sample_value("tokenwire_decoder_resubmitted_total") or 0) == 0
        assert text.upstream.stream_replicas() == [f"127.0.0.1:{server.port}"]
    finally:
        await stop_all(text, server)


async def test_text_readiness_is_at_least_one_ready_replica(tokenizer):
    hosts = ["127.0.0.1", "127.0.0.2"]
    replicas = [await replica(h) for h in hosts]
    text = await text_server(tokenizer, target(*(address(r, h) for r, h in zip(replicas, hosts))))
    SERVING = health_pb2.HealthCheckResponse.SERVING
    try:
        ready = lambda: health("127.0.0.1", text.port, TEXT_GENERATION_SERVICE)  # noqa: E731
        assert await ready() == SERVING
        await replicas[0].drain(1.0)
        await asyncio.sleep(3 * INTERVAL_S)  # several rounds of the monitor
        assert await ready() == SERVING  # one is left
        await replicas[1].drain(1.0)
        await until_async(lambda: ready(), health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        await stop_all(text, *replicas)


async def until_async(ask, wanted, limit_s: float = LIMIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while (got := await ask()) != wanted:
        assert loop.time() < deadline, f"still {got}, not {wanted}, after {limit_s} s"
        await asyncio.sleep(0.05)


# -- kill and rejoin ---------------------------------------------------------------------------


def start_scripted_decoder(host: str, port: int, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable, str(ROOT / "tests" / "support" / "scripted_decoder.py"),
            "--host", host, "--port", str(port), "--max-connection-age", str(AGE_S), *args,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"scripted decoder did not start: {line!r}"
    return proc


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def test_a_killed_replica_fails_only_its_started_streams_and_rejoins_within_the_connection_age(tokenizer):
    # two replicas in this process (4 slots each) and one process (2 slots) to SIGKILL
    replicas = [await replica(h, step_delay_s=0.02) for h in ("127.0.0.1", "127.0.0.2")]
    names = [address(r, h) for r, h in zip(replicas, ("127.0.0.1", "127.0.0.2"))]
    host = "127.0.0.3"
    port = free_port(host)
    doomed = f"{host}:{port}"
    proc = start_scripted_decoder(host, port, "--step-delay", "0.02", "--max-batch-size", "2")
    text = None
    try:
        text = await text_server(tokenizer, target(*names, doomed))
        await until(lambda: text.upstream.stream_replicas() == sorted([*names, doomed]), "a stream on every replica")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            started: set[int] = set()

            async def run(i: int):
                # 100 tokens of 20 ms steps: 2 s, still running when the replica is killed
                call = stub.Generate(generate_request(prompt(tokenizer), max_output_tokens=100, ignore_eos=True))
                tokens = 0
                try:
                    async for response in call:
                        started.add(i)
                        tokens += len(response.delta.token_ids)
                except grpc.aio.AioRpcError as error:
                    return error.code()
                return tokens

            calls = [asyncio.create_task(run(i)) for i in range(12)]
            # least-loaded placement: 4 per replica; on the killed one 2 run and 2 wait for a slot
            await until(
                lambda: [on_replica(text, "tokenwire_decoder_in_flight", n) for n in [*names, doomed]] == [4, 4, 4],
                "4 requests on each replica",
            )
            await until(lambda: len(started) == 10, "the 10 requests with a slot have their first tokens")
            proc.send_signal(signal.SIGKILL)
            killed_with = set(started)
            results = await asyncio.wait_for(asyncio.gather(*calls), LIMIT_S)
        failed = {i for i, r in enumerate(results) if r != 100}
        assert {results[i] for i in failed} == {grpc.StatusCode.UNAVAILABLE}
        assert len(failed) == 2 and failed <= killed_with  # only the two streams it had started
        assert set(range(12)) - killed_with == {i for i in range(12) if i not in killed_with and results[i] == 100}
        assert len(set(range(12)) - killed_with) == 2  # the two that waited there completed elsewhere
        assert text.metrics.registry.get_sample_value("tokenwire_decoder_resubmitted_total") == 2
        await until(lambda: doomed not in text.upstream.stream_replicas(), "its stream is gone")
        proc.wait(5)

        # rejoin: restarted at its address, it is back in rotation within the connection age
        # (in a thread: the servers and the text service here share this event loop)
        proc = await asyncio.to_thread(start_scripted_decoder, host, port, "--step-delay", "0.02", "--max-batch-size", "2")
        took = await until(lambda: doomed in text.upstream.stream_replicas(), "the restarted replica has a stream")
        assert took < AGE_S
        before = on_replica(text, "tokenwire_decoder_requests_total", doomed)
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            done = await asyncio.gather(*(client.complete(prompt(tokenizer), max_output_tokens=3) for _ in range(9)))
        assert [c.usage.completion_tokens for c in done] == [3] * 9
        assert on_replica(text, "tokenwire_decoder_requests_total", doomed) - before == 3
    finally:
        proc.kill()
        await stop_all(text, *replicas)


# -- one model ---------------------------------------------------------------------------------


async def test_a_replica_serving_another_model_gets_no_traffic_and_the_log_names_it(tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="tokenwire.text")
    same = [await replica(h) for h in ("127.0.0.1", "127.0.0.2")]
    other = await replica("127.0.0.3", model_id="other")  # fits the tokenizer, but another model
    late_port = free_port("127.0.0.4")
    names = [address(r, h) for r, h in zip(same, ("127.0.0.1", "127.0.0.2"))]
    refused, late = address(other, "127.0.0.3"), f"127.0.0.4:{late_port}"
    text = late_other = None
    try:
        # at start: most replicas serve the model, so the third is refused
        text = await text_server(tokenizer, target(*names, refused, late))
        assert text.info.model_id == "scripted"
        named = [r.message for r in caplog.records if r.levelno == logging.ERROR and refused in r.message]
        assert len(named) == 1 and "'other'" in named[0] and "no traffic" in named[0], named  # once, not every round
        # the balancer's health name is unknown to it (its Watch answers SERVICE_UNKNOWN, a Check
        # NOT_FOUND): gRPC keeps every call away from it
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health("127.0.0.3", other.port, text.model_service)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert await health("127.0.0.3", other.port, DECODER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        # later: a replica that comes up at a listed address with another model is refused too
        late_other = await start_decode_server(
            ScriptedModel(**MODEL, model_id="newer"), options=ServerOptions(host="127.0.0.4", port=late_port)
        )
        await until(
            lambda: any(late in r.message and "'newer'" in r.message for r in caplog.records if r.levelno == logging.ERROR),
            "the late replica is named",
        )
        replicas_in = lambda state: text.metrics.registry.get_sample_value("tokenwire_decoder_replicas", {"state": state})  # noqa: E731
        await until(lambda: replicas_in("refused") == 2, "both counted as refused")  # (at the end of the census's round)
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            done = await asyncio.gather(*(client.complete(prompt(tokenizer), max_output_tokens=3) for _ in range(20)))
        assert [c.usage.completion_tokens for c in done] == [3] * 20
        assert other.engine.model.prefills == late_other.engine.model.prefills == 0
        assert sum(r.engine.model.prefills for r in same) == 20
        assert text.upstream.stream_replicas() == sorted(names)
    finally:
        await stop_all(text, late_other, other, *same)
