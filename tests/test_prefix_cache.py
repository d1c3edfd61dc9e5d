"""Automatic prefix caching by sharing KV pages: a prompt that starts like an earlier one puts the
earlier one's pages in its own block table and computes only the rest.

The scheduler with the ScriptedModel, whose page store holds the id written at each position and
checks every active slot's table against its own sequence at every call: a page shared with the
wrong prompt, or a table not refreshed after a swap, fails loudly. A hit skips its prefill (the
model counts the positions it computes); concurrent requests hold a shared prefix's pages once
(the page stats); a prompt computed twice ends up held once. The allocator alone is
tests/test_kv_pages.py; the JaxModel's side (the same greedy ids with and without hits) is with
the model's tests.
"""

from __future__ import annotations

from engine.core.engine import Engine, EngineConfig
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from support.gated_steps import GatedSteps
from support.recording_sink import Recorder


def _request(prompt, n) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n))


def _run(engine: Engine, prompt, n) -> Recorder:
    sink = Recorder()
    engine.submit(_request(prompt, n), sink)
    assert sink.done.wait(5)
    return sink


def test_a_shared_prefix_is_not_prefilled_again():
    model = ScriptedModel(vocab_size=1000, max_batch_size=2, max_context_length=256)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        system = list(range(100, 140))  # 40 tokens: two full pages and 8 more
        first = _run(engine, system + [7, 8, 9], 4)
        second = _run(engine, system + [50] * 10, 4)  # pages 0 and 1 shared, its page 2 its own
        same = _run(engine, system[:32], 3)  # exactly two pages: the last is computed (it samples), into a twin
    finally:
        engine.stop()
    assert first.tokens == [10, 11, 12, 13] and second.tokens == [51, 52, 53, 54] and same.tokens == [132, 133, 134]
    assert [c[2:] for c in model.calls if c[0] == "prefill"] == [(0, 43), (32, 50), (16, 32)]
    assert model.prefill_tokens == 43 + 18 + 16
    stats = engine.stats().pages
    assert (stats.queried_tokens, stats.hit_tokens) == (43 + 50 + 32, 32 + 16)
    # first's pages 0 and 1, second's page 2; same's twin of page 1 was swapped for it and freed
    assert (stats.used, stats.cached, stats.evicted) == (0, 3, 0)


def test_concurrent_requests_hold_a_shared_prefix_once():
    """Two prompts of 69 tokens (4 full pages in common, then 5 of their own) decoding together
    hold 6 pages, not 10: the page stats after every delivery never show more."""
    model = GatedSteps(lambda step: step == 1, vocab_size=1000, max_batch_size=2, max_context_length=256)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    used: list[int] = []
    engine.after_delivery(lambda: used.append(engine.stats().pages.used))
    engine.start()
    try:
        prefix = list(range(300, 364))
        first, second = Recorder(), Recorder()
        engine.submit(_request(prefix + [1, 2, 3, 4, 5], 11), first)
        assert model.entered.wait(5)  # its first step held: it has its first token, and its pages are published
        engine.submit(_request(prefix + [6, 7, 8, 9, 10], 11), second)
        model.gate.set()
        assert first.done.wait(5) and second.done.wait(5)
    finally:
        model.gate.set()
        engine.stop()
    assert first.tokens == list(range(6, 17)) and second.tokens == list(range(11, 22))
    assert max(used) == 6  # 69 + 11 positions fit in each one's 5 pages: 4 shared, 1 each
    assert engine.stats().pages.hit_tokens == 64 and model.prefill_tokens == 69 + 5


def test_a_prefix_computed_twice_at_once_ends_up_held_once():
    """Two prompts with the same 3 full pages admitted in one iteration (while a running
    request's step is held), neither finding the other's pages, not yet written: each computes
    them; the second to publish swaps its pages for the first's, and the model's table follows
    (its checks would fail a table left on the freed pages, which the next request takes and
    writes)."""
    model = GatedSteps(lambda step: step == 1, vocab_size=1000, max_batch_size=4, max_context_length=256)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        running = Recorder()
        engine.submit(_request([900], 5), running)
        assert model.entered.wait(5)
        prefix = list(range(500, 548))
        sinks = [Recorder() for _ in range(3)]
        engine.submit(_request(prefix + [10], 30), sinks[0])
        engine.submit(_request(prefix + [20], 30), sinks[1])
        model.gate.set()
        assert sinks[0].started.wait(5) and sinks[1].started.wait(5)
        engine.submit(_request(list(range(700, 760)), 10), sinks[2])
        assert all(s.done.wait(5) for s in sinks) and running.done.wait(5)
    finally:
        model.gate.set()
        engine.stop()
    assert [s.tokens for s in sinks] == [list(range(11, 41)), list(range(21, 51)), list(range(760, 770))]
    assert model.prefill_tokens == 1 + 49 + 49 + 60  # the prefix computed twice
    stats = engine.stats().pages
    assert stats.used == 0 and stats.cached == 3 + 3  # the prefix once, and the last prompt's 3 full pages
