"""The JaxModel over a paged KV cache (issue 41): K and V in one pool of pages per layer, each
slot's positions where its block table says (`set_pages`).

Driven directly, as the scheduler would drive it, on the tiny checkpoints (float32 on the CPU:
equal ids are a claim about one backend's arithmetic, support.backend), with the served CPU
kernels and, on tiny-llama, with the XLA attention too:
- pages handed out in no order give the transformers goldens, with every path in the mix:
  chunked prefill, a chunk along a decode step, a packed prefill, decode steps crossing pages;
- slots that share a prefix's pages (a prefix hit: the new slot starts after them, by
  `prefill_chunk` or by a chunk along a step) each get the ids they get alone, while the slot that
  wrote those pages goes on decoding beside them;
- a call that would write or read a position its slot's table has no page for is refused
  (ModelUsageError), changing nothing; a prompt piece writes only its new positions;
- none of it compiles after warm-up: a table is an input of one shape;
- through a real Engine (the scheduler's pages): prompts with prefix hits beside a decoding
  stream, and a pool too small for every stream (preemption and recompute), give the ids each
  prompt gets alone, and compile nothing.
Which pages the scheduler hands out, and when, is tests/test_paged_scheduler.py's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.model import ChunkInput, DecodeInput, ModelUsageError, PromptInput, SlotSetup
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.jax_backend import transformer
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.weights import load_checkpoint
from support import prerequisites
from support.compile_watch import compile_events
from support.pages import own_pages, width
from support.recording_sink import Recorder

ASSETS = Path(__file__).parent / "assets"
GREEDY = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())
PAGE, CONTEXT, SLOTS = 8, 64, 4
pytestmark = pytest.mark.usefixtures("cpu_backend")


@pytest.fixture(
    scope="module",
    # tiny-qwen2 has tiny-llama's heads (4 of 16, 2 kv) and adds only q/k/v biases, which change
    # no page's use (its own goldens are test_transformer_parity's); tiny-qwen3's pages are 32
    # wide, a second kernel width
    params=[("tiny-llama", True), ("tiny-llama", False), ("tiny-qwen3", True)],
    ids=["llama-kernels", "llama-xla", "qwen3-kernels"],
)
def model(request) -> JaxModel:
    """4 slots, context 64, pages of 8 (a short prompt spans several), a pool of 48 pages and the
    null page: more than the slots' 4 x 8, so pages can be handed out in no order. One row bucket
    (`min_rows` 4: every step runs 4 rows, the idle ones masked): a table is read per row the same
    way at any row count, and crossing the row ladder is test_jax_model's claim (its steps read
    their slots' pages too), so the ladder's other two steps, and their chunk-along twins, would
    be compiles that prove nothing here."""
    name, kernels = request.param
    if kernels:
        prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
    m = JaxModel.load(
        ASSETS / name, max_batch_size=SLOTS, max_context_length=CONTEXT, kv_page_size=PAGE,
        kv_cache_tokens=48 * PAGE, min_bucket=8, max_chunk=32, kernels=kernels, dtype="float32", min_rows=SLOTS,
    )
    assert m.kernels == kernels and (m.kv.page_size, m.kv.num_pages) == (PAGE, 49) and m.row_buckets == (SLOTS,)
    assert m.fused_chunk_tokens == 8 if kernels else m.fused_chunk_tokens == 0
    m.warm_up()
    m.golden = json.loads((ASSETS / name / "golden.json").read_text())["cases"]
    return m


def _shuffled(model: JaxModel, seed: int) -> list[list[int]]:
    """A whole context of pages for each slot, drawn in no order from the pool's 48."""
    order = np.random.default_rng(seed).permutation(np.arange(1, model.kv.num_pages)).tolist()
    w = width(model)
    return [order[i * w : (i + 1) * w] for i in range(SLOTS)]


def _decode_until(model: JaxModel, ids: dict[int, list[int]], lengths: dict[int, int], n: dict[int, int]) -> None:
    """Greedy steps of the slots in `ids` (each at its prompt length + ids so far, together) until
    each slot s has n[s] ids."""
    while any(len(v) < n[s] for s, v in ids.items()):
        slots = [s for s, v in ids.items() if len(v) < n[s]]
        inputs = [DecodeInput(s, ids[s][-1], lengths[s] + len(ids[s]) - 1, False) for s in slots]
        for s, sample in zip(slots, model.decode(inputs)):
            ids[s].append(sample.token_id)


def test_pages_in_no_order_give_the_goldens_on_every_path(model):
    """Slot 0 prefilled in chunks, slot 1's prompt read along slot 0's decode steps (with the
    kernels) or in chunks, slots 2 and 3 packed into one call; every slot's pages are shuffled,
    so every page boundary is a jump in the pool. Each gives transformers' greedy ids."""
    a, b, c = model.golden
    tables = _shuffled(model, 0)
    for slot, pages in enumerate(tables):
        model.set_pages(slot, pages)
    prompts = {0: a["prompt_ids"], 1: b["prompt_ids"], 2: c["prompt_ids"], 3: a["prompt_ids"]}
    want = {0: a["greedy_ids"], 1: b["greedy_ids"], 2: c["greedy_ids"], 3: a["greedy_ids"]}
    before = model.compilations()
    with compile_events() as compiles:
        assert model.prefill_chunk(0, prompts[0], 0, 5, GREEDY, False) is None
        ids = {0: [model.prefill_chunk(0, prompts[0], 5, len(prompts[0]), GREEDY, False).token_id]}
        done = 0
        if model.fused_chunk_tokens:  # the first 24 of slot 1's 28 along three of slot 0's steps
            for lo in (0, 8, 16):
                model.dispatch([DecodeInput(0, None, len(prompts[0]) + len(ids[0]) - 1, False)],
                               ChunkInput(1, prompts[1], lo, lo + 8, GREEDY))
                ids[0].append(model.collect()[0].token_id)
            done = 24
        else:
            model.prefill_chunk(1, prompts[1], 0, 13, GREEDY, False)
            done = 13
        ids[1] = [model.prefill_chunk(1, prompts[1], done, len(prompts[1]), GREEDY, False).token_id]
        packed = model.prefill_packed([PromptInput(s, prompts[s], GREEDY, False) for s in (2, 3)])
        ids.update({s: [sample.token_id] for s, sample in zip((2, 3), packed)})
        _decode_until(model, ids, {s: len(p) for s, p in prompts.items()}, {s: 16 for s in prompts})
    for slot in range(SLOTS):
        model.release(slot)
    assert ids == want
    assert model.compilations() == before and compiles == []


def _alone(model: JaxModel, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy ids of `prompt` in slot 3 with pages of its own, whole prefill, nothing else running."""
    own_pages(model, 3)
    ids = {3: [model.prefill(3, prompt, GREEDY, False).token_id]}
    _decode_until(model, ids, {3: len(prompt)}, {3: n})
    model.release(3)
    return ids[3]


def test_slots_sharing_a_prefixs_pages_each_get_their_own_ids(model):
    """Slot 0 writes a 37-token prompt into shuffled pages and decodes; slot 1 then starts after
    the first four of those very pages (32 positions: a prefix hit, no copy) with its own pages
    for the rest, by `prefill_chunk` from 32; slot 2 does the same by a chunk along a decode step
    where the model takes one. Their steps run together; each slot's ids equal its prompt's
    alone, and the shared pages hold slot 0's prompt throughout."""
    rng = np.random.default_rng(3)
    x = tuple(int(t) for t in rng.integers(3, 250, 37))
    y = x[:32] + tuple(int(t) for t in rng.integers(3, 250, 9))  # shares 32 positions: 4 whole pages
    z = x[:32] + tuple(int(t) for t in rng.integers(3, 250, 14))
    want = {0: _alone(model, x, 10), 1: _alone(model, y, 8), 2: _alone(model, z, 8)}
    tables = _shuffled(model, 1)
    shared = 32 // PAGE
    before = model.compilations()
    with compile_events() as compiles:
        model.set_pages(0, tables[0])
        ids = {0: [model.prefill(0, x, GREEDY, False).token_id]}
        _decode_until(model, ids, {0: len(x)}, {0: 3})
        model.set_pages(1, tables[0][:shared] + tables[1][shared:])
        ids[1] = [model.prefill_chunk(1, y, 32, len(y), GREEDY, False).token_id]
        model.set_pages(2, tables[0][:shared] + tables[2][shared:])
        if model.fused_chunk_tokens:  # the hit's first chunk along a step of slots 0 and 1
            inputs = [DecodeInput(s, None, len(p) + len(ids[s]) - 1, False) for s, p in ((0, x), (1, y))]
            model.dispatch(inputs, ChunkInput(2, z, 32, 40, GREEDY))
            for s, sample in zip((0, 1), model.collect()):
                ids[s].append(sample.token_id)
            ids[2] = [model.prefill_chunk(2, z, 40, len(z), GREEDY, False).token_id]
        else:
            ids[2] = [model.prefill_chunk(2, z, 32, len(z), GREEDY, False).token_id]
        _decode_until(model, ids, {0: len(x), 1: len(y), 2: len(z)}, {s: len(v) for s, v in want.items()})
    for slot in range(3):
        model.release(slot)
    assert ids == want
    assert model.compilations() == before and compiles == []


def test_a_call_past_its_slots_table_is_refused_and_changes_nothing(model):
    """Every path checks that the table names a page for each position it writes or reads (JAX
    would write such a position into the null page and read garbage back); page ids and
    tables outside the pool are refused too."""
    prompt = tuple(range(3, 3 + 2 * PAGE - 1))  # 15 tokens: two pages
    model.set_pages(0, [5])  # one page: positions 0..7
    with pytest.raises(ModelUsageError, match="no page for position 14"):
        model.prefill(0, prompt, GREEDY, False)
    with pytest.raises(ModelUsageError, match="no page"):
        model.prefill_packed([PromptInput(0, prompt, GREEDY, False), PromptInput(1, (1, 2), GREEDY, False)])
    model.set_pages(0, [5, 6])
    with pytest.raises(ModelUsageError, match="whole pages"):  # a hit is whole pages
        model.prefill_chunk(0, prompt, 3, len(prompt), GREEDY, False)
    with pytest.raises(ModelUsageError, match="page outside 1..48"):
        model.set_pages(0, [5, model.kv.num_pages])
    with pytest.raises(ModelUsageError, match="page outside"):
        model.set_pages(0, [0])  # the null page holds nobody's KV
    with pytest.raises(ModelUsageError, match="a table holds 8"):
        model.set_pages(0, list(range(1, 10)))
    assert model.prefill(0, prompt, GREEDY, False).token_id >= 0  # [5, 6] still: two pages, 15 positions
    first = model.decode([DecodeInput(0, None, 15, False)])[0].token_id  # position 15: the second page's last
    with pytest.raises(ModelUsageError, match="no page in its slot's table"):
        model.decode([DecodeInput(0, first, 16, False)])  # position 16 needs a third page
    model.set_pages(0, [5, 6, 8])  # a decode step's new page, as the scheduler gives it
    if model.fused_chunk_tokens:
        with pytest.raises(ModelUsageError, match="no page for position 7"):  # slot 1 has no pages
            model.dispatch([DecodeInput(0, first, 16, False)], ChunkInput(1, prompt, 0, 8, GREEDY))
    assert model.decode([DecodeInput(0, first, 16, False)])[0].token_id >= 0
    model.release(0)
    model.release(1)
    with pytest.raises(ModelUsageError, match="no page"):  # release cleared the table
        model.prefill(0, (1, 2), GREEDY, False)


# -- through the engine: the scheduler's pages ---------------------------------------------------


def _through_engine(model: JaxModel, requests: list[tuple[tuple[int, ...], int]], step_tokens: int):
    """Greedy ids of each (prompt, n) through a real Engine, one after the other beside a
    background stream that decodes throughout; -> (ids per request, the engine's stats)."""
    engine = Engine(model, EngineConfig(max_step_tokens=step_tokens))
    engine.start()
    try:
        background = Recorder()
        engine.submit(Request("bg", (11, 12, 13), SamplingParams(temperature=0.0), StoppingCriteria(40)), background)
        got = []
        for prompt, n in requests:
            sink = Recorder()
            engine.submit(Request("r", prompt, SamplingParams(temperature=0.0), StoppingCriteria(n)), sink)
            assert sink.done.wait(60)
            got.append(sink.tokens)
        assert background.done.wait(60)
        return got, engine.stats()
    finally:
        engine.stop()


def test_prefix_hits_through_the_engine_give_the_same_ids_and_compile_nothing(model):
    """Prompts that share starts of 0 to 5 pages, run through the engine (chunked prefill beside a
    decoding stream, hits starting after their shared pages): each gives the ids the model gives
    it alone with pages of its own; the repeated prompt is a hit; nothing compiles."""
    rng = np.random.default_rng(1)
    system = tuple(int(t) for t in rng.integers(3, 250, 40))
    prompts = [
        system + (5, 6, 7),
        system[:25] + tuple(int(t) for t in rng.integers(3, 250, 12)),
        system + (9,) * 12,
        system[:16],
        tuple(int(t) for t in rng.integers(3, 250, 30)),
        system + (5, 6, 7),
    ]
    want = [_alone(model, p, 6) for p in prompts]
    before = model.compilations()
    with compile_events() as compiles:
        got, stats = _through_engine(model, [(p, 6) for p in prompts], step_tokens=16)
    assert got == want
    assert stats.pages.hit_tokens >= 40  # the repeated prompt's 5 pages, at least
    assert model.compilations() == before and compiles == []


@pytest.mark.parametrize("model", [("tiny-llama", True)], ids=["llama-kernels"], indirect=True)
def test_a_pool_too_small_for_every_stream_preempts_and_changes_no_id(model):
    """tiny-llama with the served kernels and a pool of 14 pages of 8 (112 positions) for 4
    slots, 4 streams of 12-token prompts and 36 tokens each (4 x 6 pages in all): all four are
    admitted (2 pages each), then outgrow the pool; the engine preempts and recomputes, and
    every stream gets the ids it gets alone, with no compile. The pool is the fixture's model's
    first 14 pages: its `kv` says 15 pages (the null page and 14) to the engine, which sizes its
    page allocator from it and so hands out no other page (a pool of another size on the device
    would be another warm-up, of the same shapes)."""
    m = model
    full = m.kv
    m.kv = dataclasses.replace(full, num_pages=15)
    try:
        _preempted_streams_change_no_id(m)
    finally:
        m.kv = full


def _preempted_streams_change_no_id(m: JaxModel) -> None:
    rng = np.random.default_rng(5)
    prompts = [tuple(int(t) for t in rng.integers(3, 250, 12)) for _ in range(4)]
    want = []
    for p in prompts:
        m.set_pages(3, list(range(1, 8)))  # 7 pages: 56 positions, enough for one stream alone
        ids = {3: [m.prefill(3, p, GREEDY, False).token_id]}
        _decode_until(m, ids, {3: len(p)}, {3: 36})
        m.release(3)
        want.append(ids[3])
    engine = Engine(m, EngineConfig(max_step_tokens=16))
    sinks = [Recorder() for _ in prompts]
    before = m.compilations()
    with compile_events() as compiles:
        engine.start()
        try:
            for p, sink in zip(prompts, sinks):
                engine.submit(Request("r", p, SamplingParams(temperature=0.0), StoppingCriteria(36)), sink)
            assert all(sink.done.wait(120) for sink in sinks)
            stats = engine.stats()
        finally:
            engine.stop()
    assert [sink.tokens for sink in sinks] == want
    assert stats.preemptions > 0
    assert m.compilations() == before and compiles == []


def test_a_chunk_writes_only_its_new_positions_into_its_pages():
    """A prompt piece that starts before its new positions (the last piece near the context's
    end recomputes a few written ones, which may sit in pages other slots share) and pads past
    its prompt writes K/V at positions [new_from, new_to) alone, each in the page its table
    names; the rest goes to the null page."""
    ckpt = load_checkpoint(ASSETS / "tiny-llama", "float32")
    cfg = ckpt.config
    rng = np.random.default_rng(2)
    k, v = transformer.init_pool(cfg, 9, PAGE, jnp.float32)  # [K, 9, 8, D]
    before = [rng.random(k[0].shape, np.float32) for _ in range(2 * cfg.n_layers)]
    table = np.array([7, 2, 5, 0, 0, 0, 0, 0], np.int32)  # positions 0..23 in pages 7, 2, 5
    x = transformer.embed(ckpt.weights.embed, np.arange(3, 19, dtype=np.int32))[None]  # 16 tokens from position 0
    run = jax.jit(transformer.prefill_layers, static_argnames="cfg")
    _, ks, vs = run(
        ckpt.weights.layers, tuple(map(jnp.asarray, before[::2])), tuple(map(jnp.asarray, before[1::2])), x, table,
        np.int32(0), np.int32(5), np.int32(11), cfg=cfg,
    )
    for old, new in zip(before[::2] + before[1::2], ks + vs):
        changed = {(int(n), int(o)) for _, n, o, _ in np.argwhere(old != np.asarray(new)) if n != 0}  # (page, offset)
        assert changed == {(7, 5), (7, 6), (7, 7), (2, 0), (2, 1), (2, 2)}, changed  # positions 5..10
