"""Automatic prefix caching: a prompt that starts like an earlier one reuses that start's KV.

Three levels: `PrefixCache` alone (matching by whole blocks of ids, exactly; LRU eviction of
leaves only, checked against a simulated pool under random workloads); the scheduler with the
ScriptedModel (which refuses a loaded block whose ids differ from the prompt's, so a wrong match
fails loudly): hits skip prefilling, the stats count them; and the JaxModel on the tiny
checkpoints, through the engine: the same greedy ids with and without the cache, and nothing
compiles after warm-up with chunks and hits in the mix.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.engine import Engine, EngineConfig
from engine.core.model import DecodeInput, SlotSetup
from engine.core.prefix_cache import PrefixCache, PrefixPool
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from engine.jax_backend.jax_model import PREFIX_BLOCK, JaxModel
from support.examples import examples
from support.backend import require_cpu
from support.compile_watch import compile_events
from support.recording_sink import Recorder

ASSETS = Path(__file__).parent / "assets"


# -- PrefixCache ------------------------------------------------------------------------------


def test_a_prompt_matches_the_whole_blocks_it_shares_and_no_more():
    cache = PrefixCache(PrefixPool(block_tokens=4, blocks=8))
    first = list(range(10))  # blocks [0..3], [4..7]; 8, 9 are not a whole block
    assert cache.match(first, 10) == []
    copies = cache.insert(first, 2)
    assert [i for i, _ in copies] == [0, 1]
    pool = [p for _, p in copies]
    assert cache.match(first, 10) == pool
    assert cache.match(first, 1) == pool[:1]  # the caller's limit
    assert cache.match(list(range(6)) + [99, 99], 5) == pool[:1]  # the second block differs
    assert cache.match([0, 1, 2, 3, 4, 5, 6], 5) == pool[:1]  # the second block is not whole
    assert cache.insert(first, 2) == []  # already there: nothing to copy
    assert len(cache) == 2


def test_a_block_is_found_only_after_the_same_prefix():
    """Block two of [A, B] is not block two of [C, B]: a key names the whole prefix."""
    cache = PrefixCache(PrefixPool(block_tokens=2, blocks=8))
    cache.insert([1, 1, 2, 2], 2)
    assert cache.match([3, 3, 2, 2], 2) == []
    copies = cache.insert([3, 3, 2, 2], 2)
    assert [i for i, _ in copies] == [0, 1]  # [2, 2] stored again, under another parent
    assert len(cache) == 4


def test_eviction_takes_the_least_recently_used_leaf():
    cache = PrefixCache(PrefixPool(block_tokens=2, blocks=3))
    a = [1, 1, 2, 2]
    a1, a2 = (p for _, p in cache.insert(a, 2))
    (_, b1), = cache.insert([5, 5], 1)
    cache.match(a, 2)  # a is now the most recent: its leaf a2, then a1
    (_, c1), = cache.insert([7, 7], 1)  # full: b1 is the least recently used leaf
    assert c1 == b1
    assert cache.match([5, 5, 0], 1) == []
    assert cache.match(a, 2) == [a1, a2]
    (_, d1), = cache.insert([8, 8], 1)  # c1 is now the least recent; a1 is never a victim before a2
    assert d1 == c1 and cache.match(a, 2) == [a1, a2]


def test_a_prompt_never_evicts_its_own_chain():
    """One pool block: a two-block prompt keeps its first block and stops there (evicting the
    first to store the second would point the second at a freed parent)."""
    cache = PrefixCache(PrefixPool(block_tokens=2, blocks=1))
    assert [i for i, _ in cache.insert([1, 1, 2, 2], 2)] == [0]
    assert len(cache.match([1, 1, 2, 2, 3], 2)) == 1


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=12), min_size=1, max_size=30), st.integers(1, 6))
def test_every_match_under_eviction_points_at_blocks_holding_that_prefix(prompts, capacity):
    """A simulated pool records the prefix each pool block was filled from; whatever was
    evicted, a match hands back only blocks that hold exactly the matched prefix."""
    b = 2
    cache = PrefixCache(PrefixPool(block_tokens=b, blocks=capacity))
    pool: dict[int, tuple[int, ...]] = {}
    for prompt in prompts:
        chain = cache.match(prompt, len(prompt) // b)
        for i, p in enumerate(chain):
            assert pool[p] == tuple(prompt[: (i + 1) * b])
        for i, p in cache.insert(prompt, len(prompt) // b):
            pool[p] = tuple(prompt[: (i + 1) * b])
        assert len(cache) <= capacity


# -- the scheduler ------------------------------------------------------------------------------


def _request(prompt, n) -> Request:
    return Request("r", tuple(prompt), stopping=StoppingCriteria(n))


def _run(engine: Engine, prompt, n) -> Recorder:
    sink = Recorder()
    engine.submit(_request(prompt, n), sink)
    assert sink.done.wait(5)
    return sink


def test_a_shared_prefix_is_loaded_and_only_the_rest_is_prefilled():
    model = ScriptedModel(vocab_size=1000, max_batch_size=2, max_context_length=256, prefix_blocks=8, prefix_block_tokens=16)
    engine = Engine(model, EngineConfig(max_step_tokens=0))
    engine.start()
    try:
        system = list(range(100, 140))  # 40 tokens: two whole blocks and 8 more
        first = _run(engine, system + [7, 8, 9], 4)
        second = _run(engine, system + [50] * 10, 4)  # blocks 0 and 1 shared, a new block 2
        same = _run(engine, system[:32], 3)  # exactly two blocks: one is loaded, the last token computed
    finally:
        engine.stop()
    assert first.tokens == [10, 11, 12, 13] and second.tokens == [51, 52, 53, 54] and same.tokens == [132, 133, 134]
    loads = [c for c in model.calls if c[0] == "load"]
    prefills = [c[2:] for c in model.calls if c[0] == "prefill"]
    saves = [c for c in model.calls if c[0] == "save"]
    assert prefills == [(0, 43), (32, 50), (16, 32)]
    assert [len(c[2]) for c in loads] == [2, 1]
    assert [[i for i, _ in c[2]] for c in saves] == [[0, 1], [2]]  # only blocks not yet cached are copied
    stats = engine.stats().prefix
    assert (stats.queried_tokens, stats.hit_tokens) == (43 + 50 + 32, 32 + 16)
    assert stats.cached_tokens == 3 * 16 and stats.capacity_tokens == 8 * 16


def test_a_hit_skips_the_budget_and_chunks_start_after_the_prefix():
    model = ScriptedModel(vocab_size=1000, max_batch_size=2, max_context_length=256, step_delay_s=0.002, prefix_blocks=16)
    engine = Engine(model, EngineConfig(max_step_tokens=16))
    engine.start()
    try:
        prefix = list(range(200, 264))  # four blocks
        _run(engine, prefix + [1], 2)
        running = Recorder()
        engine.submit(_request([900], 40), running)  # decoding, so the budget binds
        assert running.started.wait(5)
        hit = _run(engine, prefix + list(range(300, 340)), 3)
        assert running.done.wait(5)
    finally:
        engine.stop()
    assert hit.tokens == [340, 341, 342]
    chunks = [c[2:] for c in model.calls if c[0] == "prefill" and c[1] == 1 and c[2] > 0]
    assert chunks == [(64, 80), (80, 104)]  # 40 computed tokens: a budget, then the last 24 (under two budgets) in one


def test_without_a_pool_nothing_is_cached():
    model = ScriptedModel(vocab_size=1000, max_batch_size=1, max_context_length=128)
    engine = Engine(model, EngineConfig())
    engine.start()
    try:
        _run(engine, list(range(40)), 2)
        _run(engine, list(range(40)), 2)
    finally:
        engine.stop()
    assert not [c for c in model.calls if c[0] in ("load", "save")]
    assert engine.stats().prefix.queried_tokens == 0


# -- the JAX model ------------------------------------------------------------------------------


def _direct_greedy(model: JaxModel, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy ids straight from the model, whole prefill, no cache involved."""
    setup = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())
    ids = [model.prefill(0, prompt, setup, masked=False).token_id]
    for step in range(n - 1):
        ids.append(model.decode([DecodeInput(0, ids[-1], len(prompt) + step, False)])[0].token_id)
    model.release(0)
    return ids


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def cached_model(request) -> JaxModel:
    require_cpu()  # cached and uncached runs give equal ids: a float32 CPU claim (support.backend)
    model = JaxModel.load(
        ASSETS / request.param, max_batch_size=2, max_context_length=128, min_bucket=8, max_chunk=32,
        prefix_cache_tokens=6 * PREFIX_BLOCK, dtype="float32",
    )
    model.warm_up()
    return model


def test_prefix_cached_runs_give_the_same_greedy_ids_and_compile_nothing(cached_model):
    """Prompts that share starts of 0 to 5 blocks (and a pool too small for all, so some are
    evicted), run through the engine with chunked prefill beside a decoding stream: each
    gives the ids the model gives it alone, with no cache; nothing compiles."""
    model = cached_model
    rng = np.random.default_rng(1)
    system = tuple(int(t) for t in rng.integers(3, 250, 80))
    prompts = [
        system + (5, 6, 7),
        system[:50] + tuple(int(t) for t in rng.integers(3, 250, 20)),
        system + (9,) * 12,
        system[:16],
        tuple(int(t) for t in rng.integers(3, 250, 70)),
        system + (5, 6, 7),
    ]
    want = [_direct_greedy(model, p, 6) for p in prompts]
    before = model.compilations()
    engine = Engine(model, EngineConfig(max_step_tokens=24))
    engine.start()
    try:
        with compile_events() as compiles:
            background = Recorder()
            engine.submit(Request("bg", (11, 12, 13), SamplingParams(temperature=0.0), StoppingCriteria(60)), background)
            got = []
            for p in prompts:
                sink = Recorder()
                engine.submit(Request("r", p, SamplingParams(temperature=0.0), StoppingCriteria(6)), sink)
                assert sink.done.wait(60)
                got.append(sink.tokens)
            assert background.done.wait(60)
    finally:
        engine.stop()
    assert got == want
    stats = engine.stats().prefix
    assert stats.hit_tokens >= 5 * PREFIX_BLOCK  # the repeated prompt, at least
    assert model.compilations() == before and compiles == []
