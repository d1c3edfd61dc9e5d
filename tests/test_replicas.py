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
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services import decode_stream_client
from services.client import AsyncTextClient, generate_request
from services.decode_server import DecodeServer, start_decode_server
from services.decode_stream_client import MAX_ATTEMPTS, DecodeStreamClient
from services.errors import ServiceError
from services.replicas import Address, channel_options, model_service_name, resolve, service_config
from services.server import ServerOptions
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE
from services.text_server import TextServer, start_text_server
from support.decoder_process import start_scripted_decoder
from support.net import free_port
from support.waiting import LIMIT_S, until, until_answer
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
AGE_S = 3.0  # the replicas' maximum connection age
INTERVAL_S = 0.1  # the text service's census and readiness interval
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


class CensusRounds:
    """Counts the text service's census rounds (its monitor's `_take_census`) and keeps what
    `look()` gave at the end of each. The round tells the stream pool its news before it ends
    (`replicas_changed` retires a stream at once), so a replica that a round asked after it went
    NOT_SERVING has no stream taking requests at that round's end."""

    def __init__(self, text: TextServer, look=lambda: None) -> None:
        self.seen: list = []
        take = text._take_census

        async def counted() -> None:
            try:
                await take()
            finally:
                self.seen.append(look())

        text._take_census = counted  # the monitor looks it up each round

    @property
    def count(self) -> int:
        return len(self.seen)

    async def after(self, rounds: int, what: str) -> None:
        """Wait (bounded) until `rounds` rounds have ended, counted from now."""
        until_count = self.count + rounds
        await until(lambda: self.count >= until_count, f"{rounds} census rounds ({what})")


async def retired_by_the_next_full_round(text: TextServer, rounds: CensusRounds, name: str) -> None:
    """Called once `name`'s health says NOT_SERVING: the round under way may have asked it before;
    the one after it asks it after, and its stream must be gone by that round's end."""
    began = rounds.count
    await rounds.after(2, f"{name} asked after it went NOT_SERVING")
    assert rounds.seen[began + 1] is False, f"{name}'s stream still takes requests after the rounds {rounds.seen[began:]}"
    assert name not in text.upstream.stream_replicas()


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
    # a restarted replica is reconnected to within 2 s, less than one connection age (AGE_S):
    # gRPC's default backoff grows to 120 s (the rejoin below waits on this, not on a clock)
    options = dict(channel_options("tokenwire.decode.v1.Decoder/model:abc"))
    assert options["grpc.max_reconnect_backoff_ms"] <= 2000 < AGE_S * 1000
    assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]


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
    rounds = CensusRounds(text, lambda: name in text.upstream.stream_replicas())
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
            await until_answer(lambda: health(hosts[2], draining.port, text.model_service),
                               health_pb2.HealthCheckResponse.NOT_SERVING, "the draining replica's health")
            await retired_by_the_next_full_round(text, rounds, name)
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


async def test_a_stalled_replica_gets_no_new_request_from_the_next_census_round_on(tokenizer):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    replicas = [await replica(h, step_delay_s=0.005) for h in hosts[:2]]
    scripted = ScriptedModel(**MODEL, max_batch_size=4, step_delay_s=0.005)
    stalling = await start_decode_server(
        scripted, options=ServerOptions(host=hosts[2], max_connection_age_s=AGE_S), stall_timeout_s=0.3,
        health_interval_s=0.05,
    )
    names = [address(r, h) for r, h in zip([*replicas, stalling], hosts)]
    text = await text_server(tokenizer, target(*names))
    rounds = CensusRounds(text, lambda: names[2] in text.upstream.stream_replicas())
    try:
        await until(lambda: text.upstream.stream_replicas() == sorted(names), "a stream on every replica")
        async with AsyncTextClient(f"127.0.0.1:{text.port}") as client:
            scripted.step_delay_s = 2.0  # its engine stops making progress...
            stuck = [  # ...with work pending: one per replica (least-loaded, ties in turn), one waits on it
                asyncio.create_task(client.complete(prompt(tokenizer), max_output_tokens=3, ignore_eos=True))
                for _ in range(3)
            ]
            await until(lambda: stalling.engine.stats().slots_in_use == 1, "a request on the stalling replica")
            await until_answer(
                lambda: health(hosts[2], stalling.port, text.model_service), health_pb2.HealthCheckResponse.NOT_SERVING,
                "the stalled replica's health",
            )
            await retired_by_the_next_full_round(text, rounds, names[2])
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
    first = address(replicas[0], hosts[0])
    rounds = CensusRounds(text, lambda: {r.address.name: r.state for r in text.census.replicas.values()}.get(first))
    SERVING = health_pb2.HealthCheckResponse.SERVING
    try:
        ready = lambda: health("127.0.0.1", text.port, TEXT_GENERATION_SERVICE)  # noqa: E731
        assert await ready() == SERVING
        await replicas[0].drain(1.0)
        # the census has found it gone, and the monitor has set readiness after that round (it
        # does, before the next round begins)
        await until(lambda: rounds.seen[-1:] == ["not_ready"], "the census found the first replica not ready")
        await rounds.after(1, "readiness set after the round that found it gone")
        assert await ready() == SERVING  # one is left
        await replicas[1].drain(1.0)
        await until_answer(ready, health_pb2.HealthCheckResponse.NOT_SERVING, "the text service's readiness")
    finally:
        await stop_all(text, *replicas)


# -- kill and rejoin ---------------------------------------------------------------------------


def start_doomed(host: str, port: int) -> subprocess.Popen:
    """The replica to kill: a process of its own (2 slots, 20 ms steps), started (bounded) in a
    thread, since the servers and the text service here share the test's event loop."""
    return start_scripted_decoder(
        port, "--max-connection-age", str(AGE_S), "--step-delay", "0.02", "--max-batch-size", "2", host=host
    )


async def test_a_killed_replica_fails_only_its_started_streams_and_rejoins_within_the_connection_age(tokenizer):
    # two replicas in this process (4 slots each) and one process (2 slots) to SIGKILL
    replicas = [await replica(h, step_delay_s=0.02) for h in ("127.0.0.1", "127.0.0.2")]
    names = [address(r, h) for r, h in zip(replicas, ("127.0.0.1", "127.0.0.2"))]
    host = "127.0.0.3"
    port = free_port(host)
    doomed = f"{host}:{port}"
    proc = await asyncio.to_thread(start_doomed, host, port)
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

        # rejoin: restarted at its address, it is back in rotation (gRPC reconnects within its
        # capped backoff, below a connection age: test_the_channel_balances_... checks the cap)
        proc = await asyncio.to_thread(start_doomed, host, port)
        await until(lambda: doomed in text.upstream.stream_replicas(), "the restarted replica has a stream")
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
        # at start: most replicas serve the model, so the third is refused (named by the census's
        # first round that reaches it: on a loaded host a round can time out on every replica)
        text = await text_server(tokenizer, target(*names, refused, late))
        assert text.info.model_id == "scripted"
        named = lambda: [r.message for r in caplog.records if r.levelno == logging.ERROR and refused in r.message]  # noqa: E731
        await until(named, "the refused replica is named")
        assert "'other'" in named()[0] and "no traffic" in named()[0], named()
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
        assert len(named()) == 1, named()  # once over all the rounds since, not every round
    finally:
        await stop_all(text, late_other, other, *same)


class _Unanswering(decode_pb2_grpc.DecoderServicer):
    """A decoder whose DecodeStream calls arrive and are never answered: no headers, no message
    (as a call that never reaches a replica looks to the client)."""

    def __init__(self) -> None:
        self.calls = 0
        self.never = asyncio.Event()

    async def DecodeStream(self, request_iterator, context):
        self.calls += 1
        await self.never.wait()
        yield decode_pb2.DecodeStreamResponse()  # (never reached)


async def test_a_request_on_a_stream_no_replica_answers_moves_on_and_fails_instead_of_waiting(monkeypatch):
    """A fresh-clone run of the suite hung here (test_operations' chaos test): after a decoder's
    restart the pool's only stream never got its headers, and the request sent on it waited for
    good. Such a stream is closed once _IDENTIFY_S passes (0.3 s here), and its request, which
    nothing started, goes to a new stream: each attempt a call of its own, then UNAVAILABLE once
    MAX_ATTEMPTS are spent."""
    monkeypatch.setattr(decode_stream_client, "_IDENTIFY_S", 0.3)
    fake = _Unanswering()
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecoderServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = DecodeStreamClient(grpc.insecure_channel(f"127.0.0.1:{port}"))

    async def drain() -> None:
        async for _ in client.decode(decode_pb2.DecodeRequest(prompt_token_ids=[1, 2]), None):
            pass

    try:
        with pytest.raises(ServiceError) as error:
            await asyncio.wait_for(drain(), 10 * MAX_ATTEMPTS * 0.3)  # the bound only stops a hang
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        assert fake.calls == MAX_ATTEMPTS
    finally:
        fake.never.set()
        await client.close()
        await server.stop(None)
