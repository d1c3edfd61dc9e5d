"""The scheduler over a paged KV cache (issue 41), with the ScriptedModel, whose page store checks
every active slot's block table against its own sequence at every call (engine.core.scripted_model):
a wrong share, a live page handed to another request, a missing `set_pages` or a recompute that
feeds other ids raises in the engine loop, which fails every request of these tests.

- Overcommit: streams whose KV together far exceeds the pool all complete with exactly the ids,
  finish and usage they get alone; requests were preempted (counted), and no client saw a
  duplicate or a missing token. In process, at issue 41's shapes (64 streams in 16,384
  positions), and through a real decode server. A request preempted mid-prompt goes on from its
  cached pages; a recompute masks control tokens by its whole count.
- A request that could never fit is refused at submit, naming the field and the pool's size.
- A cancel mid-prefill or mid-decode frees every page.
- A random workload (Hypothesis) over submits, aborts, pools, page sizes and prefill modes, the
  engine's own bookkeeping checked against the model's tables at every model call.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.engine import Engine, EngineConfig
from engine.core.errors import InvalidArgument
from engine.core.events import Finished, FinishReason
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.client import decode_request
from services.decode_server import start_decode_server
from support.examples import examples
from support.gated_steps import GatedSteps
from support.recording_sink import Recorder
from support.waiting import until, until_sync

VOCAB = 1000
EOS = frozenset({2})


def expected(prompt, max_output: int | None, ignore_eos: bool, context: int) -> tuple[list[int], FinishReason]:
    """The ids and finish a request gets, worked out by hand: the token after t is t + 1."""
    cap = context - len(prompt) if max_output is None else min(max_output, context - len(prompt))
    ids, t = [], prompt[-1]
    while len(ids) < cap:
        t = (t + 1) % VOCAB
        if t in EOS and not ignore_eos:
            return ids, FinishReason.STOP
        ids.append(t)
    return ids, FinishReason.LENGTH


def request(prompt, n: int | None, ignore_eos: bool = True) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n, ignore_eos=ignore_eos))


def run_alone(prompt, n, ignore_eos) -> Recorder:
    """The request on an engine of its own with a pool of today's size (nothing to preempt)."""
    engine = Engine(ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=1, max_context_length=256))
    engine.start()
    try:
        sink = Recorder()
        engine.submit(request(prompt, n, ignore_eos), sink)
        assert sink.done.wait(5)
        return sink
    finally:
        engine.stop()


# -- overcommit ---------------------------------------------------------------------------------


def overcommit_workload() -> list[tuple[list[int], int | None, bool]]:
    """16 streams of 110 to 140 positions (9 pages of 16 each, 144 pages in all) for a pool of
    32; some share a 32-token prefix, one stops at EOS (990 -> 999, 0, 1, then 2)."""
    shared = list(range(400, 432))
    work = []
    for i in range(16):
        prompt = (shared if i % 3 == 0 else []) + [10 + i, 20 + i, 100 + 37 * i]
        work.append((prompt, 100 if i % 4 else None, i != 5))
    work[5] = ([7, 990], 100, False)
    return work


def test_streams_far_past_the_pool_all_complete_with_what_they_get_alone():
    model = ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=8, max_context_length=140,
                          kv_cache_tokens=32 * 16, fused_chunk_tokens=8, packed_prefill_tokens=64)
    engine = Engine(model, EngineConfig(max_queue_size=16, max_step_tokens=8))
    engine.start()
    work = overcommit_workload()
    try:
        sinks = [Recorder() for _ in work]
        for (prompt, n, ignore_eos), sink in zip(work, sinks):
            engine.submit(request(prompt, n, ignore_eos), sink)
        for sink in sinks:
            assert sink.done.wait(10) and sink.error is None
    finally:
        engine.stop()
    for (prompt, n, ignore_eos), sink in zip(work, sinks):
        ids, reason = expected(prompt, n, ignore_eos, 140)
        assert sink.tokens == ids  # no duplicate, no missing token
        end = sink.batches[-1][-1]
        assert (end.reason, end.usage.prompt_tokens, end.usage.completion_tokens) == (reason, len(prompt), len(ids))
        assert [type(e) for b in sink.batches for e in b].count(Finished) == 1
    assert sinks[5].tokens == [991, 992, 993, 994, 995, 996, 997, 998, 999, 0, 1]
    alone = run_alone(*work[1])
    assert sinks[1].batches[-1] == alone.batches[-1] and sinks[1].tokens == alone.tokens
    stats = engine.stats()
    assert stats.preemptions >= 4  # 144 pages of work through 32
    assert (stats.pages.used, stats.slots_in_use, model.slots_held) == (0, 0, 0)


def test_a_preempted_request_keeps_its_masking_and_counts():
    """min_output_tokens masks the EOS at token numbers below it, so the recompute after a
    preemption must mask by the tokens emitted in all, not since it resumed. The late request's
    ids reach EOS (2) at its 66th token (936 -> 937 ... 999, 0, 1, 2), past min 60: it stops there,
    preempted on the way or not; counted from its resumption, the EOS would be masked."""
    model = GatedSteps(lambda step: step == 1, vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=2,
                       max_context_length=96, kv_cache_tokens=26 * 4, page_size=4)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        big, late = Recorder(), Recorder()
        engine.submit(request(range(100, 176), 20), big)  # 76 + 20 positions: 24 of the 26 pages
        assert model.entered.wait(5)  # its first step held, so that the other runs beside it from here
        engine.submit(Request("m", (936,), stopping=StoppingCriteria(80, min_output_tokens=60)), late)
        model.gate.set()
        assert big.done.wait(10) and late.done.wait(10)
    finally:
        model.gate.set()
        engine.stop()
    assert engine.stats().preemptions == 1
    assert big.tokens == list(range(176, 196))
    assert late.tokens == list(range(937, 1000)) + [0, 1]
    end = late.batches[-1][-1]
    assert (end.reason, end.stop_token_id, end.usage.completion_tokens) == (FinishReason.STOP, 2, 65)


async def test_overcommitted_streams_through_a_decode_server():
    """The same through gRPC: every stream's events as the client reads them, and the
    preemptions in the server's engine. The first decode step is held until all 16 requests
    are in the engine, so the pool is overcommitted however slowly the host sends them."""
    model = GatedSteps(lambda step: step == 1, vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=8,
                       max_context_length=140, kv_cache_tokens=32 * 16)
    server = await start_decode_server(model, EngineConfig(max_queue_size=16, max_step_tokens=8))
    work = overcommit_workload()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)

            async def one(prompt, n, ignore_eos):
                events = [e async for r in stub.Decode(decode_request(prompt, max_output_tokens=n, ignore_eos=ignore_eos))
                          for e in r.events]
                return [e.token.id for e in events if e.HasField("token")], events[-1].finished

            streams = asyncio.gather(*(one(*w) for w in work))
            def held() -> bool:
                stats = server.engine.stats()
                return model.entered.is_set() and stats.queue_depth + stats.slots_in_use == len(work)

            await until(held, "the 16 requests in the engine, its first decode step held")
            model.gate.set()
            results = await streams
        preemptions = server.engine.stats().preemptions
    finally:
        await server.stop(None)
    for (prompt, n, ignore_eos), (ids, finished) in zip(work, results):
        want, reason = expected(prompt, n, ignore_eos, 140)
        assert ids == want
        assert finished.usage.completion_tokens == len(want) and finished.usage.prompt_tokens == len(prompt)
        assert finished.reason == (decode_pb2.FINISH_REASON_STOP if reason == FinishReason.STOP else decode_pb2.FINISH_REASON_LENGTH)
    assert preemptions >= 4


class Ordered(Recorder):
    """A Recorder that also notes, in one list shared by many, each first token and each finish."""

    def __init__(self, log: list[tuple[str, int]], key: int) -> None:
        super().__init__()
        self.log, self.key = log, key

    def events(self, events) -> None:
        if not self.started.is_set():
            self.log.append(("first", self.key))
        super().events(events)
        if self.done.is_set():
            self.log.append(("finished", self.key))


@pytest.mark.parametrize("output, preempted", [(200, False), (550, True)])
def test_the_issue_shapes_64_streams_in_16384_positions(output, preempted):
    """Issue 41's capacity and overcommit shapes on the scheduler: --max-batch-size 64,
    --max-context-length 2048, --kv-cache-tokens 16384 (what 8 full contexts took). 64 streams
    of ~250 positions all decode together: each gets its first token before any finishes. 64 of
    ~600 (38,400 positions) all complete with their own ids, through preemptions."""
    model = ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=64, max_context_length=2048,
                          kv_cache_tokens=16384)
    engine = Engine(model, EngineConfig(max_queue_size=64, max_step_tokens=0))
    log: list[tuple[str, int]] = []
    sinks = [Ordered(log, i) for i in range(64)]
    engine.start()
    try:
        for i, sink in enumerate(sinks):
            engine.submit(request([i, 3 + i] * 24 + [7 * i], output), sink)  # 49 prompt tokens
        for sink in sinks:
            assert sink.done.wait(60) and sink.error is None
    finally:
        engine.stop()
    for i, sink in enumerate(sinks):
        assert sink.tokens == [(7 * i + 1 + k) % VOCAB for k in range(output)]
        assert sink.batches[-1][-1].usage.completion_tokens == output
    if not preempted:
        first_finish = log.index(next(entry for entry in log if entry[0] == "finished"))
        assert sum(kind == "first" for kind, _ in log[:first_finish]) == 64
    assert (engine.stats().preemptions > 0) == preempted
    assert engine.stats().pages.used == 0


@pytest.mark.parametrize("fused", [0, 8])
def test_a_request_preempted_mid_prefill_goes_on_from_its_cached_pages(fused):
    """A decoding request that outgrows the pool while a later one is still reading its prompt
    (2 tokens a step beside it; with `fused`, its pending chunk riding on the step that never
    comes) preempts that one: readmitted, the victim's prompt goes on from the full pages it had
    written, which stayed cached, and both get exactly their ids."""
    model = GatedSteps(lambda step: step == 1, vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=2,
                       max_context_length=96, kv_cache_tokens=30 * 4, page_size=4, fused_chunk_tokens=fused)
    engine = Engine(model, EngineConfig(max_step_tokens=2))
    engine.start()
    try:
        big, late = Recorder(), Recorder()
        engine.submit(request(range(100, 176), 20), big)  # 76 + 20 positions: 24 of the 30 pages
        assert model.entered.wait(5)  # its first step held, so the other arrives at position 77
        engine.submit(request(range(300, 332), 3), late)  # 8 pages, read in 2-token chunks
        model.gate.set()
        assert big.done.wait(10) and late.done.wait(10)
    finally:
        model.gate.set()
        engine.stop()
    assert big.tokens == list(range(176, 196)) and late.tokens == [332, 333, 334]
    assert engine.stats().preemptions == 1
    chunks = [c[1:] for c in model.calls if c[0] == "prefill"][1:]  # the late one's (the big one's is whole, first)
    # read in slot 1 up to its preemption (a pending chunk dropped unread), then again once the big
    # one freed slot 0: from the end of the full pages it had written, which stayed cached, so
    # only the written part of a partial page is computed twice
    written = chunks[-2][2]
    assert chunks[0][0] == 1 and chunks[-2][0] == 1 and chunks[-1][0] == 0
    assert [start for _, start, _ in chunks[:-1]] == [0] + [end for _, _, end in chunks[:-2]]
    assert chunks[-1][1] == written // 4 * 4 > 0
    assert model.prefill_tokens == 76 + 32 + written % 4
    stats = engine.stats()
    assert (stats.preemptions, stats.pages.used, stats.pages.hit_tokens) == (1, 0, chunks[-1][1])


# -- refusals -----------------------------------------------------------------------------------


def test_a_request_that_could_never_fit_is_refused_naming_the_limit():
    model = ScriptedModel(vocab_size=VOCAB, max_batch_size=2, max_context_length=256, kv_cache_tokens=128)
    engine = Engine(model)
    engine.start()
    try:
        with pytest.raises(InvalidArgument, match=r"KV cache of 128 tokens; at most 28 fit") as caught:
            engine.submit(request(range(100), 29), Recorder())
        assert caught.value.field == "stopping.max_output_tokens"
        with pytest.raises(InvalidArgument, match=r"unset \(up to the context\)") as caught:
            engine.submit(request(range(10), None), Recorder())  # up to 246 tokens of output
        assert caught.value.field == "stopping.max_output_tokens"
        with pytest.raises(InvalidArgument, match="128 tokens") as caught:
            engine.submit(request(range(130), 1), Recorder())
        assert caught.value.field == "prompt_token_ids"
        fits = Recorder()
        engine.submit(request(range(100), 28), fits)  # the whole pool, alone: admitted with no reserve
        assert fits.done.wait(5) and fits.tokens == list(range(100, 128))
    finally:
        engine.stop()


async def test_the_refusal_reaches_a_client_as_invalid_argument():
    model = ScriptedModel(vocab_size=VOCAB, max_batch_size=2, max_context_length=256, kv_cache_tokens=128)
    server = await start_decode_server(model)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = decode_pb2_grpc.DecoderStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Decode(decode_request([5] * 100, max_output_tokens=50)):
                    pass
    finally:
        await server.stop(None)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stopping.max_output_tokens" in caught.value.details() and "KV cache of 128 tokens" in caught.value.details()


# -- cancels free pages ---------------------------------------------------------------------------


class GatedChunk(ScriptedModel):
    """Holds the first prefill chunk that starts past position 0 until the test opens the gate."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def prefill_chunk(self, slot, prompt_token_ids, start, end, setup, masked):
        if start > 0 and not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(10)
        return super().prefill_chunk(slot, prompt_token_ids, start, end, setup, masked)


def test_a_cancel_mid_prefill_frees_every_page():
    model = GatedChunk(vocab_size=VOCAB, max_batch_size=2, max_context_length=256, step_delay_s=0.002)
    engine = Engine(model, EngineConfig(max_step_tokens=16))
    engine.start()
    try:
        running = Recorder()
        engine.submit(request([900], 200), running)  # decoding: the budget binds, the long prompt is chunked
        assert running.started.wait(5)
        cancelled = Recorder()
        ticket = engine.submit(request(range(100, 200), 5), cancelled)  # 100 tokens: 7 pages at admission
        assert model.entered.wait(5)
        engine.abort(ticket)
        model.gate.set()
        until_sync(lambda: engine.stats().pages.used <= 13, "only the running request's pages held")  # its 200 + 1 positions
    finally:
        model.gate.set()
        engine.abort(1)
        engine.stop()
    assert cancelled.batches == []
    until_sync(lambda: engine.stats().pages.used == 0, "every page free")


def test_a_cancel_mid_decode_frees_every_page():
    model = ScriptedModel(vocab_size=VOCAB, max_batch_size=2, max_context_length=256, step_delay_s=0.005)
    engine = Engine(model)
    engine.start()
    try:
        sinks = [Recorder(), Recorder()]
        tickets = [engine.submit(request(range(i * 100, i * 100 + 40), 200), s) for i, s in enumerate(sinks)]
        for sink in sinks:
            assert sink.started.wait(5)
        assert engine.stats().pages.used >= 2 * 3
        for ticket in tickets:
            engine.abort(ticket)
        until_sync(lambda: engine.stats().pages.used == 0 and engine.stats().slots_in_use == 0, "every page free")
        assert engine.stats().pages.cached == 2 * 2  # each prompt's two full pages stay for a later hit
    finally:
        engine.stop()
    assert not any(s.done.is_set() for s in sinks) and model.slots_held == 0


# -- a random workload ----------------------------------------------------------------------------


class Checked(ScriptedModel):
    """The scripted model that also checks the engine's bookkeeping at every prefill and step
    (on the engine thread, so it sees a consistent state): each active slot's table in the model
    is the allocator's, and the allocator holds exactly the active requests. Its first call
    waits for `gate`, so that a whole workload is queued before anything runs (the pool is then
    contended from the start, not request by request)."""

    engine: Engine
    gate: threading.Event

    def _engine_agrees(self) -> None:
        assert self.gate.wait(10)
        pages = self.engine._pages
        active = self.engine._active
        for slot, live in active.items():
            assert self.table(slot) == pages.pages(live.ticket), (slot, live.ticket)
        assert sorted(pages._seqs) == sorted(live.ticket for live in active.values())
        s = pages.stats()
        assert s.used + s.cached + s.free == s.total

    def prefill_chunk(self, *args):
        self._engine_agrees()
        return super().prefill_chunk(*args)

    def prefill_packed(self, prompts):
        self._engine_agrees()
        return super().prefill_packed(prompts)

    def dispatch(self, inputs, chunk=None):
        self._engine_agrees()
        return super().dispatch(inputs, chunk)


PREFIXES = [[], list(range(600, 616)), list(range(600, 640)), list(range(700, 708))]
requests_st = st.lists(
    st.tuples(
        st.sampled_from(range(len(PREFIXES))),
        st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12),  # the prompt's own tail
        st.one_of(st.none(), st.integers(1, 80), st.integers(1, 80)),  # max_output_tokens
        st.booleans(),  # ignore_eos
        st.one_of(st.none(), st.integers(0, 20)),  # aborted after this many tokens (None: never)
    ),
    min_size=1, max_size=20,
)


HEAVY = [(i % 4, [30 + i, 40 + 7 * i], 70 + i % 3, True, None) for i in range(10)]  # ~21 pages of 4 each


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(work=HEAVY, page_size=4, pool_pages=30, batch=4, step_tokens=0, fused=0, packed=64)  # preemption by decode
@example(  # long prompts read in chunks of 4 beside decoding streams: victims mid-prefill, a chunk pending
    work=[(2, list(range(50, 50 + 20 + i)), 30, True, 40 if i == 3 else None) for i in range(8)],
    page_size=4, pool_pages=40, batch=5, step_tokens=4, fused=8, packed=0,
)
@given(
    work=requests_st,
    page_size=st.sampled_from([4, 8, 16]),
    pool_pages=st.integers(4, 30),
    batch=st.integers(1, 5),
    step_tokens=st.sampled_from([0, 4, 16]),
    fused=st.sampled_from([0, 8]),
    packed=st.sampled_from([0, 64]),
)
def test_a_random_workload_keeps_every_invariant(work, page_size, pool_pages, batch, step_tokens, fused, packed):
    """Every request not aborted gets exactly its worked-out ids and finish; an aborted one a
    prefix of them and no Finished; the model's checks hold at every call; at the end no page is
    used and no slot held. A request that could never fit is refused at submit, and only such."""
    context = 96
    model = Checked(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=batch, max_context_length=context,
                    kv_cache_tokens=pool_pages * page_size, page_size=page_size,
                    fused_chunk_tokens=fused, packed_prefill_tokens=packed)
    engine = Engine(model, EngineConfig(max_queue_size=len(work), max_step_tokens=step_tokens))
    model.engine, model.gate = engine, threading.Event()
    engine.start()
    results = []
    try:
        for prefix, tail, n, ignore_eos, abort_after in work:
            prompt = PREFIXES[prefix] + tail
            sink = AbortingRecorder(engine, abort_after)
            cap = context - len(prompt) if n is None else min(n, context - len(prompt))
            if len(prompt) + cap > pool_pages * page_size:
                with pytest.raises(InvalidArgument):
                    engine.submit(request(prompt, n, ignore_eos), sink)
                continue
            sink.given(engine.submit(request(prompt, n, ignore_eos), sink))
            results.append((sink, expected(prompt, n, ignore_eos, context)))
        model.gate.set()
        for sink, _ in results:
            sink.ended.wait(10)
        assert all(sink.ended.is_set() for sink, _ in results)
        until_sync(lambda: engine.stats().slots_in_use == engine.stats().queue_depth == 0, "the aborted ones freed")
    finally:
        model.gate.set()
        engine.stop()
    for sink, (ids, reason) in results:
        assert sink.error is None
        if sink.aborted:
            assert sink.tokens == ids[: len(sink.tokens)] and not sink.done.is_set()
        else:
            end = sink.batches[-1][-1]
            assert sink.tokens == ids and (end.reason, end.usage.completion_tokens) == (reason, len(ids))
    assert engine.stats().pages.used == 0 and model.slots_held == 0


class AbortingRecorder(Recorder):
    """Aborts its request (from the engine thread, as a client's cancel would land between steps)
    once it has `abort_after` tokens; `ended` once it finished or was aborted."""

    def __init__(self, engine: Engine, abort_after: int | None) -> None:
        super().__init__()
        self.engine, self.abort_after = engine, abort_after
        self.ticket: int | None = None
        self._ticket_given = threading.Event()  # submit returned (its events may come before)
        self.aborted = False
        self.ended = threading.Event()

    def given(self, ticket: int) -> None:
        self.ticket = ticket
        self._ticket_given.set()

    def events(self, events) -> None:
        super().events(events)
        if self.done.is_set():
            self.ended.set()
        elif self.abort_after is not None and len(self.tokens) >= self.abort_after and not self.aborted:
            assert self._ticket_given.wait(5)
            self.aborted = True
            self.engine.abort(self.ticket)
            self.ended.set()

    def fail(self, error) -> None:
        super().fail(error)
        self.ended.set()
