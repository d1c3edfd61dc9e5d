"""engine.jax_backend.cpu_kernels.chunk_attention (kernels/chunk_attention.cc): a prefill chunk's
attention by the C++ kernel over paged KV equals a float64 reference that gathers the sequence's
keys through its block table (support.paged_kv: shuffled pages), for chunks of 1, 16 and 64 queries
at the start of the context, in the middle and at its end, with and without grouped heads (G = 3,
G = 1), pages of 8, 16 and 32 with chunks ending on and one past a page boundary, two sequences
sharing prefix pages, on one thread and split over the pool, in its AVX2 build and (where the CPU
has it) its AVX-512 one; whatever the pools hold past the chunk's end or in pages the table does
not name (NaN) changes nothing; a table entry outside the pools and shapes that do not fit are
clear errors; and transformer.prefill_layers with `kernels=True` calls it and leaves the same
hidden states and caches as plain JAX on tiny checkpoints, in chunks.

Tolerance: atol 2e-6 / rtol 1e-5 on outputs of magnitude ~1 (float32 against float64; the kernel's
exp is a polynomial within ~2 ulp of libm's).

Greedy ids: tests/test_prefill_chunked.py and tests/test_prefix_cache.py run JaxModel, whose
kernels (this one included) are on wherever they load, chunked against whole prefill and cached
against uncached."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, transformer
from engine.jax_backend.weights import load_checkpoint
from support import paged_kv

ASSETS = Path(__file__).parent / "assets"

pytestmark = pytest.mark.usefixtures("loaded_kernels")  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
# What a custom call's error surfaces as: JaxRuntimeError from a jitted call's first (compiling)
# run, ValueError (INVALID_ARGUMENT) from a later run through JAX's C++ dispatch.
KERNEL_ERROR = (jax.errors.JaxRuntimeError, ValueError)


_kernel = jax.jit(cpu_kernels.chunk_attention)


def _isas() -> list[bool]:
    """AVX2, and AVX-512 where this CPU has it (the kernel picks it there by default)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return [False]
    wide = cpu_kernels.chunk_attention_isa(kernels, avx512=True) == "avx512"
    return [False, True] if wide else [False]


@pytest.fixture(
    params=[(threads, wide) for wide in _isas() for threads in (1, 2)],
    ids=lambda p: f"{p[0]}-threads-{'avx512' if p[1] else 'avx2'}",
)
def threads(request):
    """Each case on one thread and split over two, with each instruction set this CPU runs."""
    kernels = cpu_kernels.load()
    count, wide = request.param
    cpu_kernels.set_threads(kernels, count)
    assert cpu_kernels.chunk_attention_isa(kernels, avx512=wide) == ("avx512" if wide else "avx2")
    yield count
    cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
    cpu_kernels.chunk_attention_isa(kernels, avx512=True)


def _case(seed, chunk, start, heads, kv_heads, head_dim, page_size=16, width=None, lengths=None, shared=0):
    """A chunk of queries at positions start..start+chunk-1 of sequence 0, its pools and table
    (support.paged_kv: shuffled pages, NaN wherever no sequence has a key; `lengths` adds other
    sequences, `shared` prefix pages of sequence 1), and the float64 reference [C, H * D]."""
    rng = np.random.default_rng(seed)
    lengths = [start + chunk, *(lengths or [])]
    width = width or -(-lengths[0] // page_size) + 2  # entries past the sequence's pages are 0
    tables, pages = paged_kv.tables(rng, lengths, page_size, width, shared)
    k_pages, v_pages = paged_kv.pools(rng, tables, lengths, kv_heads, pages, page_size, head_dim)
    q = rng.standard_normal((chunk, heads, head_dim), np.float32)
    keys, values = (paged_kv.gather(pool, tables[0], lengths[0]) for pool in (k_pages, v_pages))
    want = np.stack([paged_kv.attention(q[i], keys, values, start + i + 1) for i in range(chunk)])
    return (q, k_pages, v_pages, tables, np.int32(start)), want


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 40)], ids=["smollm2-G3", "G1", "G3-d40"]
)
def test_kernel_equals_the_paged_reference(chunk, where, heads, kv_heads, head_dim, threads):
    """Pages of 16 over a 512-position table; whatever the pools hold past the chunk's end, and in
    pages the table does not name, is NaN, which would show in the output if it were read."""
    start = {"start": 0, "middle": 203, "end": 512 - chunk}[where]  # 203: no page or block boundary
    (q, k_pages, v_pages, tables, lo), want = _case(chunk * 100 + start + head_dim, chunk, start, heads, kv_heads,
                                                    head_dim, width=32)
    got = np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo))
    assert got.shape == (chunk, heads * head_dim)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("chunk, start", [(16, 48), (17, 64), (16, 200), (5, 123)],
                         ids=["ends-on-a-page", "one-past-a-page", "middle", "short"])
def test_page_sizes_and_boundaries(page_size, chunk, start, threads):
    """A chunk that starts on a page boundary (a prefix hit's), ends exactly on one or one past it,
    under each page size."""
    args, want = _case(page_size + chunk + start, chunk, start, 9, 3, 64, page_size)
    q, k_pages, v_pages, tables, lo = args
    np.testing.assert_allclose(np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo)), want, atol=2e-6, rtol=1e-5)


def test_sequences_sharing_prefix_pages_each_read_their_own_table():
    """Sequence 1 starts with sequence 0's first 5 pages (a prefix hit) and goes on in pages of its
    own: each chunk's attention equals its own table's reference."""
    args, want = _case(21, 16, 100, 9, 3, 64, lengths=[150], shared=5)
    q, k_pages, v_pages, tables, lo = args
    np.testing.assert_array_equal(tables[0, :5], tables[1, :5])
    np.testing.assert_allclose(np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo)), want, atol=2e-6, rtol=1e-5)
    keys, values = (paged_kv.gather(pool, tables[1], 150) for pool in (k_pages, v_pages))
    want_1 = np.stack([paged_kv.attention(q[i], keys, values, 134 + i + 1) for i in range(16)])
    got_1 = np.asarray(_kernel(q, k_pages, v_pages, tables[1], np.int32(134)))
    np.testing.assert_allclose(got_1, want_1, atol=2e-6, rtol=1e-5)


def test_the_first_query_of_a_prompt_returns_its_own_value():
    """At start 0 query 0 sees key 0 only: its output is value 0 of its kv head, exactly."""
    (q, k_pages, v_pages, tables, lo), _ = _case(3, 16, 0, 9, 3, 64)
    got = np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo)).reshape(16, 9, 64)
    for h in range(9):
        np.testing.assert_allclose(got[0, h], v_pages[h // 3, tables[0, 0], 0], rtol=1e-6)


@pytest.mark.parametrize("start", [0, 100, 240])
def test_what_the_pools_hold_past_the_chunk_is_never_read(start, threads):
    """The same bits whether every position no sequence holds is NaN or a finite value."""
    (q, k_pages, v_pages, tables, lo), _ = _case(11 + start, 16, start, 9, 3, 64)
    dirty = np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo))
    k_pages[np.isnan(k_pages)], v_pages[np.isnan(v_pages)] = 1.0, 2.0
    clean = np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo))
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("wide", _isas(), ids=lambda w: "avx512" if w else "avx2")
def test_the_default_models_long_prompt_shape(count, wide):
    """SmolLM2's heads, a 16-token chunk over ~1,800 cached keys (the shape behind the stall in
    docs/benchmarks.md, "Prefill"): fewer (kv head, tile) pairs than twice the threads, so each
    pair's keys are split too (2-3 ways here) and the partial softmaxes merged."""
    kernels = cpu_kernels.load()
    (q, k_pages, v_pages, tables, lo), want = _case(5, 16, 1784, 9, 3, 64, width=128)
    cpu_kernels.set_threads(kernels, count)
    cpu_kernels.chunk_attention_isa(kernels, avx512=wide)
    try:
        got = np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo))
    finally:
        cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
        cpu_kernels.chunk_attention_isa(kernels, avx512=True)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_a_position_past_the_table_is_clamped_into_it():
    """A bucket's padding queries past the table's end see the table's positions, like its last
    position: finite, and equal to that query's output."""
    (q, k_pages, v_pages, tables, _), _ = _case(13, 16, 48, 9, 3, 64, width=4)  # the table holds 64 positions
    q[8:] = q[15]
    got = np.asarray(_kernel(q, k_pages, v_pages, tables[0], np.int32(48)))  # positions 48..63
    past = np.asarray(_kernel(q, k_pages, v_pages, tables[0], np.int32(56)))  # positions 56..71: 64.. clamped to 63
    assert np.isfinite(past).all()
    np.testing.assert_allclose(past[8:], np.broadcast_to(got[15], (8, got.shape[1])), rtol=1e-6, atol=1e-7)


def test_a_head_dim_the_kernel_does_not_take_is_a_clear_error():
    q = np.zeros((4, 2, 12), np.float32)
    pool = np.zeros((1, 2, 16, 12), np.float32)
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        cpu_kernels.chunk_attention(q, pool, pool, np.zeros(2, np.int32), np.int32(0))


@pytest.mark.parametrize("entry", [-1, "pages"])
def test_a_table_entry_outside_the_pools_is_an_error_and_the_process_goes_on(entry):
    args, want = _case(17, 16, 40, 9, 3, 64)
    q, k_pages, v_pages, tables, lo = args
    bad = tables[0].copy()
    bad[2] = k_pages.shape[1] if entry == "pages" else entry
    for _ in range(2):  # the first run and a cached one
        with pytest.raises(KERNEL_ERROR, match=rf"table\[2\] = {bad[2]} is not a page of the pools \(0..{k_pages.shape[1] - 1}\)"):
            np.asarray(_kernel(q, k_pages, v_pages, bad, lo))
    np.testing.assert_allclose(np.asarray(_kernel(q, k_pages, v_pages, tables[0], lo)), want, atol=2e-6, rtol=1e-5)


def test_shapes_that_do_not_fit_are_a_clear_error():
    (q, k_pages, v_pages, tables, lo), _ = _case(19, 16, 40, 9, 3, 64)
    with pytest.raises(KERNEL_ERROR, match=r"expected q \[C, H, D\] .* table \[W\].*got q \[16, 9, 64\], k_pages \[3, \d+, 16, 64\], .* table \[1, 6\]"):
        np.asarray(_kernel(q, k_pages, v_pages, tables[:1], lo))
    with pytest.raises(KERNEL_ERROR, match="expected q"):  # pools of two shapes
        np.asarray(_kernel(q, k_pages, v_pages[:2], tables[0], lo))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_prefill_layers_with_the_kernel_equal_plain_jax(name):
    """A prompt prefilled in 5-token chunks (a bucket of 8) through a tiny checkpoint's layers with
    `kernels=True` calls the custom call and leaves the same hidden states and caches as plain JAX."""
    ckpt = load_checkpoint(ASSETS / name, dtype="float32")
    cfg, layers = ckpt.config, ckpt.weights.layers
    prompt = json.loads((ASSETS / name / "golden.json").read_text())["cases"][0]["prompt_ids"] * 3
    run = jax.jit(transformer.prefill_layers, static_argnames=("cfg", "kernels"))
    results = {}
    for kernels in (False, True):
        cache = transformer.init_cache(cfg, 2, 64, np.float32)
        ks, vs, outs, table = cache.k, cache.v, [], cache.tables[1]  # slot 1's pages
        for lo in range(0, len(prompt), 5):
            tokens = np.zeros(8, np.int32)
            piece = prompt[lo : lo + 5]
            tokens[: len(piece)] = piece
            x = transformer.embed(ckpt.weights.embed, tokens)[None]  # [1, 8, E]
            x, ks, vs = run(layers, ks, vs, x, table, np.int32(lo), np.int32(lo), np.int32(lo + len(piece)), cfg=cfg, kernels=kernels)
            outs.append(np.asarray(x[0, : len(piece)]))
        written = transformer.gather_pages(ks[-1], table)[:, : len(prompt)]  # [K, T, D]
        results[kernels] = (np.concatenate(outs), np.asarray(written))
        zero = np.int32(0)
        text = run.lower(layers, ks, vs, x, table, zero, zero, zero, cfg=cfg, kernels=kernels).as_text()
        assert (cpu_kernels.CHUNK_TARGET in text) == kernels
    np.testing.assert_allclose(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
