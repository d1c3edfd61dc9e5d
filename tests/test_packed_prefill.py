"""Packed prefill: several whole prompts read in one model call (`Model.prefill_packed`).

The scheduler side (ScriptedModel): a burst of short prompts that the iteration reads whole is
one packed call, and every request gets exactly the events it gets when each prompt is its own
call; prompts past `packed_prefill_tokens` are read one call each; a prompt with a cached prefix
(pages shared at admission) is not packed, and each prompt is looked up in the prefix cache once; a request cancelled during
the packed call gets no events and its slot is free before the next step.
The model side (JaxModel on the tiny checkpoints): a packed call samples what one call per
prompt samples (ids, logprobs, alternatives, masking), leaves the same KV (the decode steps after
it agree), and compiles nothing after warm-up; through the engine, a burst gives the same ids
packed and not.
"""

from __future__ import annotations

import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.events import Finished
from engine.core.model import DecodeInput, ModelUsageError, PromptInput, SlotSetup
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from engine.jax_backend.jax_model import JaxModel
from support import tiny_served
from support.backend import require_cpu
from support.compile_watch import compile_events
from support.gated_steps import GatedSteps
from support.pages import own_pages
from support.recording_sink import Recorder


def _request(prompt, n, **kw) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n), **kw)


def _burst(packed: int, prompts: list[list[int]], model_kw=None, config=None, during=None):
    """A stream decodes; its second step is held while `prompts` arrive (a burst: more wait than
    decode), then let go. -> the model, the running stream's sink and the burst's sinks."""
    model = GatedSteps(lambda step: step == 2, vocab_size=1000, max_batch_size=len(prompts) + 1,
                       max_context_length=256, packed_prefill_tokens=packed, **(model_kw or {}))
    engine = Engine(model, config or EngineConfig(max_step_tokens=16))
    engine.start()
    try:
        running, burst = Recorder(), [Recorder() for _ in prompts]
        engine.submit(_request([10], 20), running)
        assert model.entered.wait(5)
        tickets = [engine.submit(_request(p, 3), sink) for p, sink in zip(prompts, burst)]
        if during is not None:
            during(engine, tickets)
        model.gate.set()
        assert running.done.wait(5) and all(s.done.wait(5) for s in burst)
    finally:
        engine.stop()
    return model, running, burst


def test_a_burst_of_short_prompts_is_one_packed_call_and_sends_what_one_call_each_sends():
    prompts = [[5, 6, 100], [200], [7, 8, 9, 300], [1, 400]]
    packed_model, packed_running, packed = _burst(64, prompts)
    plain_model, plain_running, plain = _burst(0, prompts)
    calls = [c for c in packed_model.calls if c[0] in ("packed", "prefill")]
    assert calls[1:] == [("packed", ((1, 3), (2, 1), (3, 4), (4, 2)))]  # after the running stream's own prefill
    assert [c for c in plain_model.calls if c[0] == "prefill"][1:] == [("prefill", s, 0, n) for s, n in
                                                                         ((1, 3), (2, 1), (3, 4), (4, 2))]
    step = packed_model.calls.index(calls[1]) + 1
    assert packed_model.calls[step][0] == "decode" and set(packed_model.calls[step][1]) >= {1, 2, 3, 4}
    assert [s.batches for s in packed] == [s.batches for s in plain]  # the same events, batch for batch
    assert [s.tokens for s in packed] == [[p[-1] + 1, p[-1] + 2, p[-1] + 3] for p in prompts]
    assert packed_running.tokens == plain_running.tokens == list(range(11, 31))


def test_prompts_past_the_packed_limit_are_read_one_call_each():
    model, _, burst = _burst(10, [[5, 6, 7, 100], [8, 9, 10, 200], [11, 12, 13, 300]])
    calls = [c for c in model.calls if c[0] in ("packed", "prefill")][1:]
    assert calls == [("packed", ((1, 4), (2, 4))), ("prefill", 3, 0, 4)]  # 4 + 4 fit in 10, 4 more do not
    assert [s.tokens for s in burst] == [[101, 102, 103], [201, 202, 203], [301, 302, 303]]


def _beside_a_cached_prefix(prompts: list[list[int]]):
    """A request caches `SYSTEM`'s two pages and its first step is held while `prompts` arrive
    (every prompt read whole); -> the model's prefill calls after the first request's and the
    prefix stats."""
    model = GatedSteps(lambda step: step == 1, vocab_size=1000, max_batch_size=4, max_context_length=256,
                       packed_prefill_tokens=128)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        warm = Recorder()
        engine.submit(_request(SYSTEM + [7], 3), warm)
        assert model.entered.wait(5)
        sinks = [Recorder() for _ in prompts]
        for prompt, sink in zip(prompts, sinks):
            engine.submit(_request(prompt, 2), sink)
        model.gate.set()
        assert warm.done.wait(5) and all(s.done.wait(5) for s in sinks)
        stats = engine.stats().pages
    finally:
        engine.stop()
    assert [s.tokens for s in sinks] == [[p[-1] + 1, p[-1] + 2] for p in prompts]
    calls = [c for c in model.calls if c[0] in ("packed", "prefill")]
    return calls[1:], stats


SYSTEM = list(range(100, 132))  # two whole pages of 16


def test_a_prompt_with_a_cached_prefix_is_not_packed_and_each_prompt_is_looked_up_once():
    calls, stats = _beside_a_cached_prefix([[1, 2, 300], SYSTEM + [8, 400], [3, 500]])
    # the hit (its pages shared at admission) is left out of the group; the rest of that prompt after
    assert calls == [("packed", ((1, 3), (3, 2))), ("prefill", 2, 32, 34)]
    assert (stats.queried_tokens, stats.hit_tokens) == (33 + 3 + 34 + 2, 32)  # once each


def test_a_lone_prompt_left_by_a_hit_is_a_plain_prefill_looked_up_once():
    calls, stats = _beside_a_cached_prefix([[1, 2, 300], SYSTEM + [8, 400]])
    assert calls == [("prefill", 1, 0, 3), ("prefill", 2, 32, 34)]  # one left to pack: no packed call
    assert (stats.queried_tokens, stats.hit_tokens) == (33 + 3 + 34, 32)


class CancelDuringPacked(GatedSteps):
    """Cancels the request of `ticket` (set by the test) while its packed prefill runs."""

    engine: Engine
    ticket: int

    def prefill_packed(self, prompts):
        self.engine.abort(self.ticket)
        return super().prefill_packed(prompts)


def test_a_request_cancelled_during_a_packed_prefill_gets_nothing_and_frees_its_slot():
    model = CancelDuringPacked(lambda step: step == 2, vocab_size=1000, max_batch_size=3, max_context_length=256,
                               packed_prefill_tokens=64)
    engine = Engine(model, EngineConfig(max_step_tokens=16))
    model.engine = engine
    engine.start()
    try:
        running, kept, cancelled = Recorder(), Recorder(), Recorder()
        engine.submit(_request([10], 6), running)
        assert model.entered.wait(5)
        engine.submit(_request([5, 100], 3), kept)
        model.ticket = engine.submit(_request([6, 200], 3), cancelled)
        model.gate.set()
        assert running.done.wait(5) and kept.done.wait(5)
        steps_after = [c for c in model.calls if c[0] == "decode"][2:]
        later = Recorder()  # all three slots again: the cancelled one's was freed
        engine.submit(_request([7, 700], 2), later)
        assert later.done.wait(5)
    finally:
        engine.stop()
    assert [c for c in model.calls if c[0] == "packed"] == [("packed", ((1, 2), (2, 2)))]
    assert kept.tokens == [101, 102, 103] and cancelled.batches == [] and later.tokens == [701, 702]
    assert all(2 not in c[1] for c in steps_after)  # no step ever ran for the cancelled slot
    assert running.tokens == list(range(11, 17))


def test_the_scripted_model_refuses_a_packed_prefill_past_its_limit_or_with_a_slot_twice():
    model = ScriptedModel(packed_prefill_tokens=4)
    setup = SlotSetup(SamplingParams(seed=1), frozenset())
    with pytest.raises(ModelUsageError):
        model.prefill_packed([PromptInput(0, (1, 2, 3), setup, False), PromptInput(1, (4, 5), setup, False)])
    with pytest.raises(ModelUsageError):
        model.prefill_packed([PromptInput(0, (1,), setup, False), PromptInput(0, (2,), setup, False)])


# -- model side -------------------------------------------------------------------------------


GREEDY = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())


class CountingPacked(JaxModel):
    """The JAX model, counting its packed prefills (the prompts of each)."""

    def prefill_packed(self, prompts):
        self.packed_calls = [*getattr(self, "packed_calls", []), len(prompts)]
        return super().prefill_packed(prompts)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def model(request) -> CountingPacked:
    """The checkpoint in the shared configuration (support.tiny_served: 4 slots, context 64,
    float32 on the CPU, where equal ids are a claim about one backend's arithmetic), one model per
    checkpoint, whose one-call-a-prompt and packed runs go one after the other (each test frees
    its slots and restores what it changes). tiny-llama is warmed up, for the claim that a packed
    call compiles nothing after warm-up: the shapes warm-up makes are the configuration's (slots,
    context, buckets), which the three share; the other two compile only what their tests run, as
    they run it."""
    require_cpu()
    model = tiny_served.load(request.param, cls=CountingPacked)
    model.warmed = request.param == "tiny-llama"
    if model.warmed:
        model.warm_up()
    return model


def test_a_packed_prefill_samples_and_writes_what_one_call_a_prompt_does(model):
    prompts = [(5, 6, 7), (9,), tuple(range(11, 28)), (3, 4)]  # 23 tokens: the 32 bucket, 9 of padding
    slots = [2, 0, 3, 1]
    setups = [
        SlotSetup(SamplingParams(temperature=0.0, seed=0, top_logprobs=3), frozenset()),
        SlotSetup(SamplingParams(temperature=0.8, top_k=20, seed=7), frozenset()),
        GREEDY,
        SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset(range(0, 500, 2))),  # even ids masked
    ]
    masked = [False, False, False, True]

    def steps() -> list[list[int]]:
        """Five decode steps of every slot (the same KV in every slot: the same ids after)."""
        return [
            [x.token_id for x in model.decode([DecodeInput(s, None, len(p) + step, False) for s, p in zip(slots, prompts)])]
            for step in range(5)
        ]

    def release() -> None:
        for s in slots:
            model.release(s)

    try:
        for s in slots:
            own_pages(model, s)
        want = [model.prefill(s, p, u, m) for s, p, u, m in zip(slots, prompts, setups, masked)]
        want_steps = steps()
        release()
        for s in slots:
            own_pages(model, s)
        with compile_events() as compiled:
            got = model.prefill_packed([PromptInput(s, p, u, m) for s, p, u, m in zip(slots, prompts, setups, masked)])
            got_steps = steps()
        assert compiled == [] or not model.warmed
        assert [x.token_id for x in got] == [x.token_id for x in want]
        assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=1e-4)
        assert len(got[0].top_logprobs) == 3 and [i for i, _ in got[0].top_logprobs] == [i for i, _ in want[0].top_logprobs]
        assert got[3].token_id % 2 == 1  # the mask held
        assert got_steps == want_steps  # the same KV in every slot: the steps after agree
    finally:
        release()


def test_a_packed_prefill_refuses_a_slot_in_use_and_too_many_tokens(model):
    packed = model
    own_pages(packed, 0), own_pages(packed, 1)
    with pytest.raises(ModelUsageError, match="tokens in one packed prefill"):
        packed.prefill_packed([PromptInput(0, (1,) * 40, GREEDY, False), PromptInput(1, (1,) * 30, GREEDY, False)])
    packed.prefill(0, (1, 2), GREEDY, False)
    try:
        with pytest.raises(ModelUsageError, match="slot 0 is in use"):
            packed.prefill_packed([PromptInput(1, (1,), GREEDY, False), PromptInput(0, (2,), GREEDY, False)])
    finally:
        packed.release(0)
        packed.release(1)


def test_a_burst_through_the_engine_gives_the_same_ids_packed_and_not(model):
    """The first request's first token is delivered; from that delivery (on the engine thread)
    three more arrive together, and the next iteration reads their prompts: one packed call,
    or one call each with packing off."""
    limit = model.packed_prefill_tokens
    assert limit > 0
    results, calls = [], []
    for packing in (0, limit):
        model.packed_calls = []
        model.packed_prefill_tokens = packing
        engine = Engine(model, EngineConfig(max_step_tokens=0))
        sinks = [Recorder() for _ in range(4)]
        requests = [_request([3 + i, 40 + i, 7], 6, sampling=SamplingParams(temperature=0.0, seed=1)) for i in range(4)]
        arrived = []

        def burst(engine=engine, sinks=sinks, requests=requests, arrived=arrived):
            if not arrived and sinks[0].batches:
                arrived.append(True)
                for request, sink in zip(requests[1:], sinks[1:]):
                    engine.submit(request, sink)

        engine.after_delivery(burst)
        engine.start()
        try:
            engine.submit(requests[0], sinks[0])
            assert all(s.done.wait(30) for s in sinks)
        finally:
            engine.stop()
            model.packed_prefill_tokens = limit
        assert all(isinstance(s.batches[-1][-1], Finished) for s in sinks)
        results.append([s.tokens for s in sinks])
        calls.append(model.packed_calls)
    assert calls == [[], [3]]  # packing off: no packed call; on: the three together
    assert results[0] == results[1] and all(len(t) == 6 for t in results[0])
