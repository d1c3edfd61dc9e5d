"""The delivery path from the engine to the clients: one wake-up per engine step for every
stream, coalesced lists for a consumer that is behind, read-ahead on the text service's upstream,
and a reader that stops reading neither stalls the engine nor other streams.

The tests over gRPC run twice: with the engine on a thread of the server (`model=`) and in its
own process (`spawn_model=`, engine.core.engine_process, as `tokenwire decode-server` runs it)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
from pathlib import Path

import grpc
import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine, EngineConfig
from engine.core.events import Finished, Token
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.client import decode_request
from services import decode_stream_client
from services.decode_server import DecodeServer, start_decode_server
from support.waiting import LIMIT_S, steps_until_freed, until

TINY = Path(__file__).parent / "assets" / "tiny-llama"
# LIMIT_S, the bound on any one wait (support.waiting): far above the work waited for (the
# longest here is 600 steps of 1 ms), far below forever.


async def within(awaitable, limit_s: float = LIMIT_S):
    """Await `awaitable` (a read, a stream's next list, an RPC's status); fails the test past `limit_s`."""
    return await asyncio.wait_for(awaitable, limit_s)


def decode_steps(server: DecodeServer) -> float:
    """The decode steps the server's engine has taken (its step-time histogram counts one per
    step; from an engine process it can lag by the steps of one message)."""
    return server.metrics.registry.get_sample_value("tokenwire_engine_step_seconds_count")


def request(prompt_last: int, n: int | None) -> Request:
    return Request(f"r{prompt_last}", (1, prompt_last), stopping=StoppingCriteria(max_output_tokens=n, ignore_eos=True))


@pytest.fixture(params=["thread", "process"])
def where(request) -> str:
    """Where the decode server runs its engine: on a thread, or in an engine process."""
    return request.param


async def scripted_decode_server(where: str, engine_config: EngineConfig, **model) -> DecodeServer:
    """A decode server over ScriptedModel(**model), its engine on a thread or in its own process."""
    if where == "thread":
        return await start_decode_server(ScriptedModel(**model), engine_config)
    return await start_decode_server(spawn_model=functools.partial(ScriptedModel, **model), engine_config=engine_config)


@pytest.fixture
def engine():
    model = ScriptedModel(vocab_size=1000, max_batch_size=8, max_context_length=256, step_delay_s=0.002)
    engine = Engine(model, EngineConfig(max_queue_size=8))
    engine.start()
    yield engine
    engine.stop()


async def collect(stream) -> list[list]:
    return [events async for events in stream]


async def test_one_wake_up_per_engine_iteration_for_all_streams(engine):
    async_engine = AsyncEngine(engine)
    results = await within(asyncio.gather(*(collect(async_engine.stream(request(100 * i, 20))) for i in range(1, 9))))
    for i, lists in enumerate(results, start=1):
        tokens = [e.id for events in lists for e in events if isinstance(e, Token)]
        assert tokens == list(range(100 * i + 1, 100 * i + 21))
    model = engine.model
    # 8 streams x 20 tokens: one wake-up per engine iteration (prefills and steps) at most, where
    # a wake-up per request per step would be about 160
    assert async_engine._mailbox().wake_ups <= model.prefills + model.decode_steps
    assert model.decode_steps >= 19


async def test_a_consumer_that_is_behind_gets_the_backlog_in_one_list_in_order(engine):
    stream = AsyncEngine(engine).stream(request(500, 10))
    async with contextlib.aclosing(stream):
        first = await within(anext(stream))  # Token(501), and more if the loop woke late on a busy machine
        got = [e.id for e in first]
        assert got == list(range(501, 501 + len(got))) and len(got) < 10
        # the engine runs on while this consumer is away (the other steps, 2 ms each)
        await until(lambda: not engine.stats().slots_in_use, "the request ended")
        rest = await within(anext(stream))
        assert [e.id for e in rest[:-1]] == list(range(501 + len(got), 511))
        assert isinstance(rest[-1], Finished) and rest[-1].usage.completion_tokens == 10
        with pytest.raises(StopAsyncIteration):
            await within(anext(stream))


async def test_leaving_a_coalesced_stream_early_frees_the_slot(engine):
    # no cap: the request runs to the 256-token context, the prefill and 253 decode steps (0.5 s);
    # leaving aborts it before the engine's next step, so its slot is free within a few steps of
    # that, counted by the model (a wait of any length on a busy machine does not change the count)
    stream = AsyncEngine(engine).stream(request(300, None))
    async with contextlib.aclosing(stream):
        assert (await within(anext(stream)))[0] == Token(301)  # (more, when this consumer is behind)
    left_at = engine.model.decode_steps
    await steps_until_freed(lambda: engine.stats().slots_in_use, lambda: engine.model.decode_steps, left_at, at_most=3)
    assert engine.model.slots_held == 0


# -- a reader that stops reading, over gRPC ---------------------------------------------------


async def test_a_reader_that_stops_reading_holds_only_its_own_output_and_slows_no_one(where):
    """Bound: a stalled reader's request still ends after max_output_tokens (its slot is freed),
    so what waits for it on the server is at most its own output, in our queue or in gRPC's
    flow-control window; the engine and every other stream go on meanwhile."""
    server = await scripted_decode_server(
        where, EngineConfig(max_queue_size=4), vocab_size=1000, max_batch_size=4, max_context_length=1024, step_delay_s=0.001
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            slow = stub.Decode(decode_request([1, 100], max_output_tokens=600, ignore_eos=True))
            first = await within(slow.read())  # then this reader stops reading
            assert first.events[0].token.id == 101
            fast_call = stub.Decode(decode_request([1, 5], max_output_tokens=50, ignore_eos=True), timeout=LIMIT_S)
            fast = [e async for r in fast_call for e in r.events]
            assert [e.token.id for e in fast[:-1]] == list(range(6, 56))  # done while the slow one waits
            assert fast[-1].finished.usage.completion_tokens == 50
            # the stalled request still runs to its end (600 steps of 1 ms)
            await until(lambda: not server.engine.stats().slots_in_use, "the stalled request ended", interval_s=0.005)
            tokens = [e.token.id for e in first.events if e.HasField("token")]
            finished = None
            while finished is None:
                response = await within(slow.read())
                tokens += [e.token.id for e in response.events if e.HasField("token")]
                if response.events[-1].HasField("finished"):
                    finished = response.events[-1].finished
            assert tokens == list(range(101, 701)) and finished.usage.completion_tokens == 600
    finally:
        await server.stop(None)


# -- DecodeStream: many requests over one RPC (the proto's invariants 10-15 and 17) ----------


def start(key: int, prompt_last: int, n: int, **stopping) -> decode_pb2.DecodeStreamRequest:
    request = decode_request([1, prompt_last], max_output_tokens=n, ignore_eos=True, **stopping)
    return decode_pb2.DecodeStreamRequest(start=decode_pb2.DecodeStreamStart(key=key, request=request))


def cancel(key: int) -> decode_pb2.DecodeStreamRequest:
    return decode_pb2.DecodeStreamRequest(cancel=decode_pb2.DecodeStreamCancel(key=key))


@pytest.fixture
async def stream_server(where):
    server = await scripted_decode_server(
        where, EngineConfig(max_queue_size=4), vocab_size=1000, max_batch_size=4, max_context_length=1024, step_delay_s=0.002
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, decode_pb2_grpc.DecoderStub(channel)
    await server.stop(None)


async def read_until_done(call, keys: set[int]) -> tuple[dict, dict, int]:
    """Per key: its events, and its error if any; and how many responses carried them."""
    events: dict[int, list] = {k: [] for k in keys}
    errors: dict[int, decode_pb2.RequestError] = {}
    responses = 0
    while any(k not in errors and not (events[k] and events[k][-1].HasField("finished")) for k in keys):
        response = await within(call.read())
        responses += 1
        seen = [entry.key for entry in response.requests]
        assert response.requests and len(seen) == len(set(seen))  # never empty, one entry per key
        for entry in response.requests:
            assert entry.key not in errors and not (events[entry.key] and events[entry.key][-1].HasField("finished"))
            if entry.HasField("error"):
                assert not entry.events
                errors[entry.key] = entry.error
            else:
                events[entry.key].extend(entry.events)
    return events, errors, responses


async def test_many_requests_on_one_stream_each_get_exactly_their_events(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    for key in range(1, 5):
        await call.write(start(key, 100 * key, 30))
    events, errors, responses = await read_until_done(call, {1, 2, 3, 4})
    assert errors == {}
    for key, evs in events.items():
        assert [e.token.id for e in evs[:-1]] == list(range(100 * key + 1, 100 * key + 31))
        assert evs[-1].finished.reason == decode_pb2.FINISH_REASON_LENGTH
        assert evs[-1].finished.usage.completion_tokens == 30
    assert responses < 4 * 30  # steps of several requests travel together
    await call.done_writing()
    assert await within(call.code()) == grpc.StatusCode.OK  # closing our side ends the stream: nothing is live


async def test_packed_tokens_are_the_same_tokens_before_their_finished(stream_server):
    """Invariant 15: a request started with packed_tokens gets its tokens in the response's
    token_keys/token_ids, before its entry, which holds only its Finished; a plain request on the
    same stream still gets Token events; packed tokens with logprobs are refused, naming the field."""
    server, stub = stream_server
    call = stub.DecodeStream()
    for key, last in ((1, 100), (3, 200)):
        packed = decode_request([1, last], max_output_tokens=12, ignore_eos=True)
        await call.write(decode_pb2.DecodeStreamRequest(start=decode_pb2.DecodeStreamStart(key=key, request=packed, packed_tokens=True)))
    await call.write(start(2, 300, 12))
    with_logprobs = decode_request([1, 5], max_output_tokens=3, return_logprobs=True)
    await call.write(decode_pb2.DecodeStreamRequest(start=decode_pb2.DecodeStreamStart(key=4, request=with_logprobs, packed_tokens=True)))
    ids: dict[int, list] = {1: [], 2: [], 3: []}
    finished, errors = {}, {}
    while len(finished) + len(errors) < 4:
        response = await within(call.read())
        assert len(response.token_keys) == len(response.token_ids)
        for key, token_id in zip(response.token_keys, response.token_ids):
            assert key in (1, 3) and key not in finished
            ids[key].append(token_id)
        for entry in response.requests:
            assert entry.key not in finished
            if entry.HasField("error"):
                errors[entry.key] = entry.error
                continue
            if entry.key in (1, 3):
                assert [e.WhichOneof("event") for e in entry.events] == ["finished"], "packed: the entry is only the Finished"
            else:
                ids[2] += [e.token.id for e in entry.events if e.HasField("token")]
            if entry.events[-1].HasField("finished"):
                finished[entry.key] = entry.events[-1].finished
    assert ids == {1: list(range(101, 113)), 2: list(range(301, 313)), 3: list(range(201, 213))}
    assert all(f.usage.completion_tokens == 12 and f.reason == decode_pb2.FINISH_REASON_LENGTH for f in finished.values())
    assert errors[4].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "packed_tokens" in errors[4].message
    await call.done_writing()
    assert await within(call.code()) == grpc.StatusCode.OK


async def test_a_refused_request_ends_alone_and_the_stream_goes_on(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    bad = decode_pb2.DecodeStreamRequest(start=decode_pb2.DecodeStreamStart(
        key=7, request=decode_pb2.DecodeRequest(prompt_token_ids=[1, 5000])))
    await call.write(bad)
    await call.write(start(8, 200, 5))
    events, errors, _ = await read_until_done(call, {7, 8})
    assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == errors[7].code
    assert "prompt_token_ids[1]" in errors[7].message
    assert [e.token.id for e in events[8][:-1]] == [201, 202, 203, 204, 205]
    call.cancel()


async def test_a_cancelled_request_frees_its_slot_and_gets_nothing_more(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(start(1, 100, 900))
    first = await within(call.read())
    assert first.requests[0].key == 1
    await call.write(cancel(1))
    await call.write(cancel(99))  # unknown: nothing happens
    # a fresh key: responses already on their way may still carry key 1's events (invariant 12)
    await call.write(start(2, 500, 3))
    new, old = [], [e for entry in first.requests for e in entry.events]
    while not (new and new[-1].HasField("finished")):
        for entry in (await within(call.read())).requests:
            assert entry.key in (1, 2) and not entry.HasField("error")
            (new if entry.key == 2 else old).extend(entry.events)
    assert [e.token.id for e in new if e.HasField("token")] == [501, 502, 503]
    assert not any(e.HasField("finished") for e in old)  # the cancelled request never finished
    await until(lambda: server.engine.stats().slots_in_use == 0, "the cancelled request's slot is freed")
    call.cancel()


async def test_cancelling_the_rpc_frees_every_slot(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    for key in (1, 2):
        await call.write(start(key, 100 * key, 900))  # 899 decode steps (1.8 s) each
    await within(call.read())
    cancelled_at = decode_steps(server)
    call.cancel()  # frees both slots within a few steps; a third of their steps is ample
    await steps_until_freed(lambda: server.engine.stats().slots_in_use, lambda: decode_steps(server), cancelled_at, at_most=300)
    await until(lambda: server.admission.in_flight == 0, "the cancelled requests released their admission")


async def test_a_key_in_use_and_a_malformed_action_fail_the_rpc_as_invalid_argument(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(start(1, 100, 900))
    await call.write(start(1, 200, 5))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while True:
            await within(call.read())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key 1" in error.value.details()
    raw = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    async with raw:
        method = raw.stream_stream("/tokenwire.decode.v1.Decoder/DecodeStream", lambda b: b, lambda b: b)
        call = method()
        await call.write(b"\xff\xff\xff")
        await call.done_writing()
        assert await within(call.code()) == grpc.StatusCode.INVALID_ARGUMENT
    # the failed RPC aborted its 900-token request (899 decode steps) soon after it began: within
    # a third of its steps, counted from the server's start (each test has its own server)
    await steps_until_freed(lambda: server.engine.stats().slots_in_use, lambda: decode_steps(server), 0, at_most=300)


def batch(*actions: decode_pb2.DecodeStreamRequest) -> decode_pb2.DecodeStreamRequest:
    return decode_pb2.DecodeStreamRequest(batch=decode_pb2.DecodeStreamBatch(actions=actions))


async def test_a_batch_is_its_actions_applied_in_order(stream_server):
    """Invariant 17: one message with a start, another start, a cancel of the first and a new start
    on its key is exactly those four actions in that order: key 1 gets only the later request's
    events, key 2 its own, and the cancelled request's slot is freed."""
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(batch(start(1, 100, 900), start(2, 200, 5), cancel(1), start(1, 300, 4)))
    events, errors, _ = await read_until_done(call, {1, 2})
    assert errors == {}
    assert [e.token.id for e in events[1] if e.HasField("token")] == [301, 302, 303, 304]
    assert [e.token.id for e in events[2] if e.HasField("token")] == [201, 202, 203, 204, 205]
    assert events[1][-1].finished.usage.completion_tokens == 4
    await until(lambda: server.engine.stats().slots_in_use == 0, "every slot is free, the cancelled one's too")
    await call.done_writing()
    assert await within(call.code()) == grpc.StatusCode.OK


async def test_a_batch_inside_a_batch_fails_the_rpc_as_invalid_argument(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(batch(start(1, 100, 900), batch(start(2, 200, 5))))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while True:
            await within(call.read())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "batch.actions" in error.value.details()
    # the failed RPC aborted the request its batch had started (899 decode steps) within a third of them
    await steps_until_freed(lambda: server.engine.stats().slots_in_use, lambda: decode_steps(server), 0, at_most=300)


def test_the_text_services_upstream_sends_what_is_queued_together_in_order(monkeypatch):
    """`_requests` (the DecodeStream request iterator on gRPC's thread): every action queued when
    gRPC asks for the next message goes in one batch, in order; a lone action goes as itself; a
    batch closes at BATCH_BYTES; the end of writes ends the iterator after what came before it."""
    actions: queue.SimpleQueue = queue.SimpleQueue()
    messages = decode_stream_client._requests(actions, lambda: True)
    burst = [start(1, 100, 5), start(2, 200, 5), cancel(1), start(3, 300, 5)]
    for action in burst:
        actions.put(action)
    assert next(messages) == batch(*burst)
    actions.put(cancel(3))
    assert next(messages) == cancel(3)
    monkeypatch.setattr(decode_stream_client, "BATCH_BYTES", 2 * start(4, 400, 5).ByteSize())
    for action in (start(4, 400, 5), start(5, 500, 5), start(6, 600, 5), cancel(4)):
        actions.put(action)
    actions.put(decode_stream_client._END)
    actions.put(cancel(9))  # after the end: never read (read, the test would see it, not hang)
    assert next(messages) == batch(start(4, 400, 5), start(5, 500, 5))
    assert next(messages) == batch(start(6, 600, 5), cancel(4))
    assert next(messages, None) is None


def test_the_upstream_sends_no_batch_to_a_server_that_has_not_said_it_reads_them():
    actions: queue.SimpleQueue = queue.SimpleQueue()
    messages = decode_stream_client._requests(actions, lambda: False)
    for action in (start(1, 100, 5), start(2, 200, 5), decode_stream_client._END):
        actions.put(action)
    assert list(messages) == [start(1, 100, 5), start(2, 200, 5)]


async def test_a_decode_stream_says_it_reads_batches_and_the_text_services_stream_sees_it(stream_server):
    """The decode server's DecodeStream headers carry BATCH_KEY; the text service's `_Stream`
    (its reader thread, over a blocking channel) reads them and from then on batches."""
    server, _ = stream_server
    got: list = []
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stream = decode_stream_client._Stream(decode_pb2_grpc.DecoderStub(channel), lambda s, items: got.extend(items))
        await until(lambda: any(type(item) is decode_stream_client._Identified for item in got), "the stream's headers")
        assert stream.batches
        stream.close()


async def test_an_action_that_is_not_set_fails_the_rpc_as_invalid_argument(stream_server):
    """An unset action (and so one from a later contract this server does not know) is refused,
    not dropped: a dropped start would leave its request waiting forever."""
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(decode_pb2.DecodeStreamRequest())
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while True:
            await within(call.read())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "action" in error.value.details()


async def test_draining_refuses_new_starts_and_lets_live_ones_finish(stream_server):
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(start(1, 100, 200))  # the prefill and 199 decode steps of 2 ms (0.4 s)
    assert (await within(call.read())).requests[0].key == 1
    drained = asyncio.create_task(server.drain(LIMIT_S))
    await until(lambda: server.draining, "the drain began", interval_s=0)
    steps_then = decode_steps(server)
    # still live when the drain begins, with most of its work ahead: the drain has to wait for it
    assert server.admission.in_flight == 1 and steps_then <= 150, "the live request ended before the drain began"
    await call.write(start(2, 300, 5))
    events, errors, _ = await read_until_done(call, {1, 2})
    assert errors[2].code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert events[1][-1].finished.usage.completion_tokens == 200  # the live one ran to its end
    assert decode_steps(server) - steps_then >= 40  # ... stepping on while the drain waited
    assert await within(drained) is True


async def test_a_text_client_that_stops_reading_slows_no_one_and_gets_everything_later(where):
    """Through the text service (and its DecodeStream): a client that stops reading neither holds
    the engine nor the other streams; what waits for it is its own output (bounded as above)."""
    from protos.text.v1 import text_pb2_grpc
    from services.client import generate_request
    from services.text_server import start_text_server
    from tokenizer_svc.tokenizer import TextTokenizer

    decode = await scripted_decode_server(
        where, EngineConfig(max_queue_size=4), vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4,
        max_context_length=1024, step_delay_s=0.001,
    )
    text = await start_text_server(TextTokenizer.from_dir(TINY), f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            slow = stub.Generate(generate_request("hello", max_output_tokens=500, ignore_eos=True))
            ids = list((await within(slow.read())).delta.token_ids)  # then this client stops reading
            fast = await stub.Complete(generate_request("hi", max_output_tokens=40, ignore_eos=True), timeout=LIMIT_S)
            assert fast.usage.completion_tokens == 40 == len(fast.token_ids)  # done meanwhile
            # the engine runs the stalled one to its end (500 steps of 1 ms)
            await until(lambda: not decode.engine.stats().slots_in_use, "the stalled request ended", interval_s=0.005)
            finished = None
            while finished is None:
                response = await within(slow.read())
                if response.HasField("finished"):
                    finished = response.finished
                else:
                    ids += response.delta.token_ids
            assert finished.usage.completion_tokens == 500 == len(ids)
            assert ids == [(ids[0] + i) % 512 for i in range(500)]  # the scripted sequence, nothing lost
    finally:
        await text.stop(None)
        await decode.stop(None)


async def test_a_backlog_is_sent_in_responses_of_bounded_size(stream_server, monkeypatch):
    import services.decode_stream

    monkeypatch.setattr(services.decode_stream, "MAX_EVENTS_PER_RESPONSE", 10)
    server, stub = stream_server
    call = stub.DecodeStream()
    await call.write(start(1, 100, 60))
    await call.write(start(2, 200, 60))
    sizes, tokens, finished = [], {1: [], 2: []}, set()
    response = await within(call.read())
    # the backlog builds up while nobody reads (59 steps of 2 ms)
    await until(lambda: not server.engine.stats().slots_in_use, "both requests ended", interval_s=0.005)
    while True:
        sizes.append(sum(len(entry.events) for entry in response.requests))
        for entry in response.requests:
            tokens[entry.key] += [e.token.id for e in entry.events if e.HasField("token")]
            finished |= {entry.key} if entry.events[-1].HasField("finished") else set()
        if finished == {1, 2}:
            break
        response = await within(call.read())
    assert max(sizes[1:]) <= 10 + 2  # the cap, plus at most one step of one request past it
    assert tokens == {1: list(range(101, 161)), 2: list(range(201, 261))}
    call.cancel()


async def test_two_text_services_can_share_one_port(where):
    """gRPC binds with SO_REUSEPORT on Linux, so text-service processes (stateless: a tokenizer
    and a channel) can be added on the same port and the kernel spreads connections among them."""
    from protos.text.v1 import text_pb2_grpc
    from services.client import generate_request
    from services.server import ServerOptions
    from services.text_server import start_text_server
    from tokenizer_svc.tokenizer import TextTokenizer

    decode = await scripted_decode_server(
        where, EngineConfig(max_queue_size=4), vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4,
        max_context_length=128,
    )
    tokenizer = TextTokenizer.from_dir(TINY)
    first = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    second = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}", ServerOptions(port=first.port))
    try:
        assert second.port == first.port
        await first.stop(None)  # the port keeps serving through the other one
        async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            completion = await stub.Complete(generate_request("hello", max_output_tokens=3, ignore_eos=True), timeout=LIMIT_S)
        assert completion.usage.completion_tokens == 3
    finally:
        await second.stop(None)
        await decode.stop(None)


async def test_a_full_engine_refuses_a_start_with_resource_exhausted_and_serves_the_rest(stream_server):
    server, stub = stream_server  # 4 slots and 4 queue places
    call = stub.DecodeStream()
    for key in range(1, 10):  # 200 steps of 2 ms each: none ends before the ninth arrives
        await call.write(start(key, 100 * key, 200))
    events, errors, _ = await read_until_done(call, set(range(1, 10)))
    assert [k for k, e in errors.items() if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] == [9]
    assert all(events[k][-1].finished.usage.completion_tokens == 200 for k in range(1, 9))
    call.cancel()
