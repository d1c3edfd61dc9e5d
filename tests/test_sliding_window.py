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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, ragged_attention, transformer
from engine.model_store.checkpoint import parse_config
from support import golden_parity, paged_kv, prerequisites

MISTRAL = Path(__file__).parent / "assets" / "tiny-mistral"
CASES = json.loads((MISTRAL / "golden.json").read_text())["cases"]
CFG = parse_config(json.loads((MISTRAL / "config.json").read_text()))
WINDOW = CFG.sliding_window
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5
ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_kernels._cpu_flags() else [])


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # conftest: arrays and calls on the CPU device


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
# The whole attention, the Pallas kernel (interpreted) and its reference jitted too: op by op, each
# of their operations (the interpreter's, per grid step) would compile its own executable.
_whole = jax.jit(transformer.attention, static_argnums=(4, 5))
_pallas = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret", "window"))
_pallas_reference = jax.jit(ragged_attention.reference, static_argnums=(5,))


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
        want = _whole(q[None], keys, values, pos[None], CFG, window)[0]  # [C, H*D]
        got = _chunk(q, k_pages, v_pages, table, jnp.int32(start), CFG, block=8, window=window)
        np.testing.assert_allclose(got, want, atol=1e-5)
        full = _whole(q[None], keys, values, pos[None], CFG, None)[0]
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
    got = _pallas(q, k_pages, v_pages, tables, lengths, block_k=16, splits=2, interpret=True, window=window)
    want = _pallas_reference(q, k_pages, v_pages, tables, lengths, window)
    np.testing.assert_allclose(got, want, atol=1e-5)
    full = _pallas_reference(q, k_pages, v_pages, tables, lengths, None)
    assert not np.allclose(got[4:], full[4:], atol=1e-3)


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def whole_model(request) -> golden_parity.WholeModel:
    """tiny-mistral's weights and its whole-model calls, jitted once per path."""
    return golden_parity.load(MISTRAL, CFG, CONTEXT, request.param)


def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    golden_parity.check_goldens_and_cached_decode(whole_model, CASES, BATCH, ATOL)


def test_a_prompt_prefilled_in_chunks_across_the_window_edge_equals_it_at_once(whole_model):
    golden_parity.check_chunks_across_the_window_edge(whole_model, CASES, BATCH, ATOL)  # 28 tokens in pieces of 5


def test_a_packed_prefill_of_the_prompts_gives_transformers_logits(whole_model):
    golden_parity.check_packed(whole_model, CASES, BATCH, ATOL)


def test_chunks_riding_along_with_decode_steps_give_transformers_logits(whole_model):
    golden_parity.check_chunks_riding_along(whole_model, CASES, BATCH, ATOL)
