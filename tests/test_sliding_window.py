"""Sliding-window attention (issue 44, part 3): a query at position p sees the keys at positions
p - window + 1 .. p, transformers' convention (masking_utils.sliding_window_overlay: kv_idx >
q_idx - sliding_window), in every attention path.

- Each attention function against the plain causal one over the window's keys alone: the XLA
  prefill-chunk and decode attention, the C++ CPU kernels (both ISAs; positions the window does
  not reach are NaN, so a kernel that read them would show it), and the Pallas GPU kernel in
  interpret mode.
- tiny-mistral (tests/assets/tiny-mistral: MistralForCausalLM with a window of 8, made by
  transformers through scripts/make_tiny_checkpoints.py; prompts of 11 and 28 tokens, 16 greedy
  steps) against transformers' goldens: logits within ATOL and greedy ids equal, each cached
  decode step equal to a full prefill of the same history, and a prompt prefilled in chunks of 5
  (every chunk straddling a window edge) equal to it prefilled at once; in plain JAX and with the
  CPU kernels; and the other two ways the engine reads a prompt: packed end to end with the
  others (transformer.packed_prefill_layers), and in chunks riding along with another slot's
  decode steps (transformer.mixed_layers).

Float32 on the CPU device, as tests/test_transformer_parity.py (whose module docstring says why)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, packed_prefill, ragged_attention, transformer
from engine.jax_backend.weights import load_checkpoint, with_panels
from engine.model_store.checkpoint import parse_config
from support import paged_kv, prerequisites

MISTRAL = Path(__file__).parent / "assets" / "tiny-mistral"
CASES = json.loads((MISTRAL / "golden.json").read_text())["cases"]
CFG = parse_config(json.loads((MISTRAL / "config.json").read_text()))
WINDOW = CFG.sliding_window
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5
ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_kernels._cpu_flags() else [])


@pytest.fixture(autouse=True)
def on_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def test_the_checkpoint_window_bites_and_follows_transformers_convention():
    assert WINDOW == 8 and max(len(c["prompt_ids"]) for c in CASES) > 3 * WINDOW
    k, q = np.arange(12)[None, :], np.arange(12)[:, None]
    seen = np.asarray(transformer.in_window(k, q, 4))
    assert np.flatnonzero(seen[10]).tolist() == [7, 8, 9, 10]  # 10 - k < 4
    assert np.flatnonzero(seen[2]).tolist() == [0, 1, 2]
    assert np.flatnonzero(np.asarray(transformer.in_window(k, q, None))[10]).tolist() == list(range(11))


def _pool(rng, n_pages, page, kv=2, d=16):
    return (rng.standard_normal((kv, n_pages, page, d)).astype(np.float32) for _ in range(2))


_chunk = jax.jit(transformer.chunk_attention, static_argnames=("cfg", "block", "window"))
_decode = jax.jit(transformer.decode_attention, static_argnames=("cfg", "window"))


@pytest.mark.parametrize("window", [3, 8, 21])
def test_the_xla_chunk_and_decode_attention_see_only_the_window(window):
    rng = np.random.default_rng(window)
    page, width = 4, 16  # 64 positions
    k_pages, v_pages = _pool(rng, width + 1, page)
    table = jnp.asarray(1 + rng.permutation(width), jnp.int32)  # [W]
    keys = transformer.gather_pages(k_pages, table)[None].swapaxes(1, 2)  # [1, S, K, D]
    values = transformer.gather_pages(v_pages, table)[None].swapaxes(1, 2)
    for start, c in ((0, 8), (5, 8), (13, 8), (40, 16)):  # chunks across the window's edge
        q = jnp.asarray(rng.standard_normal((c, 4, 16)), jnp.float32)  # [C, H, D]
        pos = start + jnp.arange(c)
        want = transformer.attention(q[None], keys, values, pos[None], CFG, window)[0]  # [C, H*D]
        got = _chunk(q, k_pages, v_pages, table, jnp.int32(start), CFG, block=8, window=window)
        np.testing.assert_allclose(got, want, atol=1e-5)
        full = transformer.attention(q[None], keys, values, pos[None], CFG)[0]
        assert start + c <= window or not np.allclose(got, full, atol=1e-3)  # the window changed something
        rows = _decode(q, k_pages, v_pages, jnp.tile(table, (c, 1)), pos, CFG, window)
        np.testing.assert_allclose(rows, want, atol=1e-5)


def _windowed_reference(q, k, v, table, last, window):
    """One query at position `last` over the window's keys, float64 (support.paged_kv)."""
    lo = max(0, last - window + 1)
    keys, values = paged_kv.gather(k, table, last + 1)[:, lo:], paged_kv.gather(v, table, last + 1)[:, lo:]
    return paged_kv.attention(q, keys, values, last + 1 - lo)


def _nan_before(pool, table, first):
    """The pool with positions [0, first) of the sequence read through `table` set to NaN."""
    pool = pool.copy()
    for p in range(first):
        pool[:, table[p // pool.shape[2]], p % pool.shape[2]] = np.nan
    return pool


@pytest.mark.parametrize("isa", ISAS)
def test_the_cpu_kernels_read_and_see_only_the_window(isa):
    kernels = prerequisites.cpu_kernels()
    assert cpu_kernels.decode_attention_isa(kernels, isa == "avx512") == isa
    assert cpu_kernels.chunk_attention_isa(kernels, isa == "avx512") == isa
    try:
        rng = np.random.default_rng(7)
        page, heads, d = 8, 4, 16
        # Decode: rows at positions inside the first window, on a page edge and far past it.
        window, positions = 20, np.array([5, 19, 20, 47, 130], np.int32)
        tables, n_pages = paged_kv.tables(rng, positions + 1, page, width=20)
        k, v = paged_kv.pools(rng, tables, positions + 1, 2, n_pages, page, d)
        q = rng.standard_normal((len(positions), heads, d)).astype(np.float32)
        for r, last in enumerate(positions):  # pages wholly before a row's window are never read
            first_page = max(0, last + 1 - window) // page * page
            k, v = _nan_before(k, tables[r], first_page), _nan_before(v, tables[r], first_page)
        got = np.asarray(cpu_kernels.decode_attention(q, k, v, tables, positions, window))
        want = np.stack([_windowed_reference(q[r], k, v, tables[r], last, window) for r, last in enumerate(positions)])
        np.testing.assert_allclose(got, want, atol=2e-5)
        # A chunk of 24 queries starting at 300: key blocks (128) before its first window are not read.
        start, c, window = 300, 24, 40
        table, n_pages = paged_kv.tables(rng, [start + c], page, width=48)
        k, v = paged_kv.pools(rng, table, [start + c], 2, n_pages, page, d)
        k, v = _nan_before(k, table[0], 256), _nan_before(v, table[0], 256)
        q = rng.standard_normal((c, heads, d)).astype(np.float32)
        got = np.asarray(cpu_kernels.chunk_attention(q, k, v, table[0], np.int32(start), window))
        want = np.stack([_windowed_reference(q[i], k, v, table[0], start + i, window) for i in range(c)])
        np.testing.assert_allclose(got, want, atol=2e-5)
    finally:
        cpu_kernels.decode_attention_isa(kernels, True)
        cpu_kernels.chunk_attention_isa(kernels, True)


def test_the_pallas_kernel_in_interpret_mode_sees_only_the_window():
    rng = np.random.default_rng(3)
    page, width, window = 8, 12, 21
    lengths = jnp.asarray([0, 5, 21, 22, 60, 96], jnp.int32)  # idle, inside, on and past the edge, far past
    r = lengths.shape[0]
    k_pages, v_pages = _pool(rng, r * width + 1, page)
    tables = jnp.asarray(1 + rng.permutation(r * width).reshape(r, width), jnp.int32)
    q = jnp.asarray(rng.standard_normal((r, 4, 16)), jnp.float32)
    got = ragged_attention.decode_attention(
        q, k_pages, v_pages, tables, lengths, block_k=16, splits=2, interpret=True, window=window
    )
    want = ragged_attention.reference(q, k_pages, v_pages, tables, lengths, window)
    np.testing.assert_allclose(got, want, atol=1e-5)
    full = ragged_attention.reference(q, k_pages, v_pages, tables, lengths)
    assert not np.allclose(got[4:], full[4:], atol=1e-3)


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def whole_model(request):
    """tiny-mistral's weights and its whole-model calls, jitted once per path."""
    kernels = request.param
    if kernels:
        prerequisites.cpu_kernels()
    with jax.default_device(jax.devices("cpu")[0]):
        weights = load_checkpoint(MISTRAL, dtype="float32").weights
    if kernels:
        weights = replace(weights, layers=tuple(map(with_panels, weights.layers)))

    def chunk(weights, cache, tokens, length, slot, start, cfg):  # prefill_chunk, on the kernels when asked
        x = transformer.embed(weights.embed, tokens)[None]  # [1, C, E]
        table = cache.tables[slot]
        x, ks, vs = transformer.prefill_layers(
            weights.layers, cache.k, cache.v, x, table, start, start, start + length, cfg, kernels
        )
        last = jax.lax.dynamic_index_in_dim(x[0], length - 1, keepdims=False)
        return transformer.logits(last, weights.final_norm, weights.lm_head, cfg), transformer.KVCache(ks, vs, cache.tables)

    def packed(weights, cache, tokens, pages, positions, prompts, cfg):  # -> logits at every token [T, V']
        x = transformer.embed(weights.embed, tokens)  # [1, T, E]
        x, _, _ = transformer.packed_prefill_layers(weights.layers, cache.k, cache.v, x, pages, positions, prompts, cfg)
        return transformer.logits(x[0], weights.final_norm, weights.lm_head, cfg)

    def mixed(weights, cache, token, position, chunk, start, cfg, kernels):
        """Slot 0 decodes `token` at `position` while chunk [C] of slot 1 at `start` rides along."""
        x = transformer.embed(weights.embed, token[None])[:, None]  # [1, 1, E]
        c = transformer.embed(weights.embed, chunk)  # [C, E]
        x, ks, vs = transformer.mixed_layers(
            weights.layers, cache.k, cache.v, x, cache.tables[:1], position[None], jnp.ones(1, bool), c,
            cache.tables[1], start, start + chunk.shape[0], cfg, CONTEXT, kernels,
        )
        logits = transformer.logits(x[0, 0], weights.final_norm, weights.lm_head, cfg)
        return logits, transformer.KVCache(ks, vs, cache.tables)

    calls = {
        "chunk": jax.jit(chunk, static_argnames="cfg", donate_argnums=1),
        "packed": jax.jit(packed, static_argnames="cfg"),
        "mixed": jax.jit(mixed, static_argnames=("cfg", "kernels"), donate_argnums=1),
        "decode": jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels"), donate_argnums=1),
    }
    return weights, kernels, calls


def _prefill(whole_model, cache, ids, slot, piece):
    """ids prefilled into `slot` in pieces of `piece` tokens (each padded to `piece`) -> logits, cache."""
    weights, _, calls = whole_model
    for lo in range(0, len(ids), piece):
        part = ids[lo : lo + piece]
        tokens = np.zeros(piece, np.int32)
        tokens[: len(part)] = part
        logits, cache = calls["chunk"](weights, cache, tokens, np.int32(len(part)), np.int32(slot), np.int32(lo), cfg=CFG)
    return np.asarray(logits), cache


def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    weights, kernels, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    for slot, case in enumerate(CASES):
        prompt = case["prompt_ids"]
        logits, cache = _prefill(whole_model, cache, prompt, slot, CONTEXT)
        np.testing.assert_allclose(logits, case["first_logits"], atol=ATOL, rtol=0)
        greedy = [int(np.argmax(logits))]
        for step, expected in enumerate(case["steps"][1:], start=1):
            ids, positions, active = (np.zeros(BATCH, np.int32) for _ in range(3))
            ids[slot], positions[slot], active[slot] = greedy[-1], len(prompt) + step - 1, 1
            logits, cache = calls["decode"](
                weights, cache, ids, positions, active.astype(bool), cfg=CFG, attend=CONTEXT, kernels=kernels
            )
            row = np.asarray(logits)[slot]
            np.testing.assert_allclose(row[expected["ids"]], expected["logits"], atol=ATOL, rtol=0)
            # The same history prefilled whole into a spare slot (its pages are rewritten each time).
            full, cache = _prefill(whole_model, cache, prompt + greedy, BATCH - 1, CONTEXT)
            np.testing.assert_allclose(row, full, atol=ATOL, rtol=0)
            greedy.append(int(np.argmax(row)))
        assert greedy == case["greedy_ids"], f"case {slot}"


def test_a_prompt_prefilled_in_chunks_across_the_window_edge_equals_it_at_once(whole_model):
    case = max(CASES, key=lambda c: len(c["prompt_ids"]))  # 28 tokens: chunks of 5 end on both sides of each edge
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    whole, cache = _prefill(whole_model, cache, case["prompt_ids"], 0, CONTEXT)
    pieces, cache = _prefill(whole_model, cache, case["prompt_ids"], 1, 5)
    np.testing.assert_allclose(pieces, whole, atol=ATOL, rtol=0)
    np.testing.assert_allclose(pieces, case["first_logits"], atol=ATOL, rtol=0)


def test_a_packed_prefill_of_the_prompts_gives_transformers_logits(whole_model):
    weights, _, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    lengths = [len(c["prompt_ids"]) for c in CASES]
    size = CONTEXT
    tokens = np.zeros((1, size), np.int32)
    tokens[0, : sum(lengths)] = [t for c in CASES for t in c["prompt_ids"]]
    pages, positions, prompts = packed_prefill.token_arrays(
        np.asarray(cache.tables), list(range(BATCH)), lengths, size, cache.k[0].shape[2]
    )
    logits = calls["packed"](weights, cache, tokens, pages, positions, prompts, cfg=CFG)  # [T, V']
    for case, end in zip(CASES, np.cumsum(lengths), strict=True):
        np.testing.assert_allclose(np.asarray(logits)[end - 1], case["first_logits"], atol=ATOL, rtol=0)


def test_chunks_riding_along_with_decode_steps_give_transformers_logits(whole_model):
    """Slot 1's 28-token prompt written 5 tokens at a time beside slot 0's decode steps
    (transformer.mixed_layers), each step's logits slot 0's golden ones; then its last piece."""
    weights, kernels, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    first, long = CASES[0], CASES[1]
    logits, cache = _prefill(whole_model, cache, first["prompt_ids"], 0, 16)
    last, start, step = int(np.argmax(logits)), 0, 1
    while len(long["prompt_ids"]) - start > 5:
        chunk = np.asarray(long["prompt_ids"][start : start + 5], np.int32)
        logits, cache = calls["mixed"](
            weights, cache, np.int32(last), np.int32(len(first["prompt_ids"]) + step - 1), chunk, np.int32(start),
            cfg=CFG, kernels=kernels,
        )
        expected = first["steps"][step]
        np.testing.assert_allclose(np.asarray(logits)[expected["ids"]], expected["logits"], atol=ATOL, rtol=0)
        last, start, step = first["greedy_ids"][step], start + 5, step + 1
    rest = long["prompt_ids"][start:]
    tokens = np.zeros(16, np.int32)
    tokens[: len(rest)] = rest
    logits, cache = calls["chunk"](weights, cache, tokens, np.int32(len(rest)), np.int32(1), np.int32(start), cfg=CFG)
    np.testing.assert_allclose(np.asarray(logits), long["first_logits"], atol=ATOL, rtol=0)
