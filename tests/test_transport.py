"""The delivery path from the engine to the clients: one wake-up per engine step for every
stream, coalesced lists for a consumer that is behind, read-ahead on the text service's upstream,
and a reader that stops reading neither stalls the engine nor other streams."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine, EngineConfig
from engine.core.events import Finished, Token
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2_grpc
from services.channels import read_ahead
from services.client import decode_request
from services.decode_server import start_decode_server


def request(prompt_last: int, n: int) -> Request:
    return Request(f"r{prompt_last}", (1, prompt_last), stopping=StoppingCriteria(max_output_tokens=n, ignore_eos=True))


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
    results = await asyncio.gather(*(collect(async_engine.stream(request(100 * i, 20))) for i in range(1, 9)))
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
        first = await anext(stream)
        assert first == [Token(501)]
        while engine.stats().slots_in_use:  # the engine runs on while this consumer is away
            await asyncio.sleep(0.002)
        rest = await anext(stream)
        assert [e.id for e in rest[:-1]] == list(range(502, 511))
        assert isinstance(rest[-1], Finished) and rest[-1].usage.completion_tokens == 10
        with pytest.raises(StopAsyncIteration):
            await anext(stream)


async def test_leaving_a_coalesced_stream_early_frees_the_slot(engine):
    stream = AsyncEngine(engine).stream(request(300, 200))
    async with contextlib.aclosing(stream):
        await anext(stream)
    for _ in range(100):  # within a few steps of 2 ms
        if engine.stats().slots_in_use == 0:
            break
        await asyncio.sleep(0.002)
    assert engine.stats().slots_in_use == 0


# -- read-ahead (the text service's upstream) ------------------------------------------------


class Source:
    """An async iterator of 0, 1, 2, ... that may fail after `fail_after` items; records closing."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.n, self.fail_after, self.closed, self.sent = n, fail_after, False, 0

    async def items(self):
        try:
            for i in range(self.n):
                if i == self.fail_after:
                    raise ValueError("upstream failed")
                self.sent += 1
                yield i
                await asyncio.sleep(0)
        finally:
            self.closed = True


async def test_read_ahead_batches_what_arrived_in_order():
    source = Source(10)
    batches = read_ahead(source.items())
    async with contextlib.aclosing(batches):
        first = await anext(batches)
        while source.sent < 10:  # the reader runs on while the consumer is away
            await asyncio.sleep(0)
        rest = [b async for b in batches]
    assert first == [0] and sum(rest, []) == list(range(1, 10)) and len(rest) == 1
    assert source.closed


async def test_read_ahead_delivers_the_items_before_an_error_then_raises_it():
    source = Source(10, fail_after=4)
    got = []
    with pytest.raises(ValueError, match="upstream failed"):
        async for batch in read_ahead(source.items()):
            got.extend(batch)
    assert got == [0, 1, 2, 3] and source.closed


async def test_closing_read_ahead_early_stops_reading_and_closes_the_source():
    source = Source(10_000)
    batches = read_ahead(source.items())
    await anext(batches)
    await batches.aclose()
    sent = source.sent
    await asyncio.sleep(0.01)
    assert source.closed and source.sent == sent < 10_000


# -- a reader that stops reading, over gRPC ---------------------------------------------------


async def test_a_reader_that_stops_reading_holds_only_its_own_output_and_slows_no_one():
    """Bound: a stalled reader's request still ends after max_output_tokens (its slot is freed),
    so what waits for it on the server is at most its own output, in our queue or in gRPC's
    flow-control window; the engine and every other stream go on meanwhile."""
    model = ScriptedModel(vocab_size=1000, max_batch_size=4, max_context_length=1024, step_delay_s=0.001)
    server = await start_decode_server(model, EngineConfig(max_queue_size=4))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            slow = stub.Decode(decode_request([1, 100], max_output_tokens=600, ignore_eos=True))
            first = await slow.read()  # then this reader stops reading
            assert first.events[0].token.id == 101
            fast = [e async for r in stub.Decode(decode_request([1, 5], max_output_tokens=50, ignore_eos=True))
                    for e in r.events]
            assert [e.token.id for e in fast[:-1]] == list(range(6, 56))  # done while the slow one waits
            assert fast[-1].finished.usage.completion_tokens == 50
            while server.engine.stats().slots_in_use:  # the stalled request still runs to its end
                await asyncio.sleep(0.005)
            tokens = [e.token.id for e in first.events if e.HasField("token")]
            finished = None
            while finished is None:
                response = await slow.read()
                tokens += [e.token.id for e in response.events if e.HasField("token")]
                if response.events[-1].HasField("finished"):
                    finished = response.events[-1].finished
            assert tokens == list(range(101, 701)) and finished.usage.completion_tokens == 600
    finally:
        await server.stop(None)
