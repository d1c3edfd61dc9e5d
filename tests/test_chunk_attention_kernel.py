"""engine.jax_backend.cpu_kernels.chunk_attention (kernels/chunk_attention.cc): a prefill chunk's
attention by the C++ kernel equals transformer.chunk_attention, the plain-JAX reference, for chunks
of 1, 16 and 64 queries at the start of the context, in the middle and at its end, with and without
grouped heads (G = 3, G = 1), on one thread and split over the pool, in its AVX2 build and (where the
CPU has it) its AVX-512 one; whatever the cache holds past the chunk's end (stale values, NaN)
changes nothing; and transformer.prefill_layers with `kernels=True` calls it and leaves the same
hidden states and caches as plain JAX on tiny checkpoints, in chunks.

Tolerance: float32 both ways, atol 2e-6 / rtol 1e-5 on outputs of magnitude ~1 (the two sum in a
different order and the kernel's exp is a polynomial within ~2 ulp of libm's).

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
from engine.model_store.checkpoint import ModelConfig
from support.attention_config import attention_config

ASSETS = Path(__file__).parent / "assets"

pytestmark = pytest.mark.usefixtures("loaded_kernels")  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them


def _config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return attention_config(heads, kv_heads, head_dim, context=512)


_reference = jax.jit(transformer.chunk_attention, static_argnames=("cfg", "block"))
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


def _inputs(rng, chunk, heads, kv_heads, head_dim, slots, context):
    q = rng.standard_normal((chunk, heads, head_dim), np.float32)
    k_cache = rng.standard_normal((slots, kv_heads, context, head_dim), np.float32)
    v_cache = rng.standard_normal((slots, kv_heads, context, head_dim), np.float32)
    return q, k_cache, v_cache


@pytest.mark.parametrize("chunk", [1, 16, 64])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (6, 2, 40)], ids=["smollm2-G3", "G1", "G3-d40"]
)
def test_kernel_equals_the_jax_reference(chunk, where, heads, kv_heads, head_dim, threads):
    context, slots = 512, 3
    start = {"start": 0, "middle": 203, "end": context - chunk}[where]  # 203: no block boundary
    rng = np.random.default_rng(chunk * 100 + start + head_dim)
    q, k_cache, v_cache = _inputs(rng, chunk, heads, kv_heads, head_dim, slots, context)
    slot = np.int32(1)
    cfg = _config(heads, kv_heads, head_dim)
    got = np.asarray(_kernel(q, k_cache, v_cache, slot, np.int32(start)))
    want = np.asarray(_reference(q, k_cache, v_cache, slot, np.int32(start), cfg=cfg))
    assert got.shape == (chunk, heads * head_dim)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_the_first_query_of_a_prompt_returns_its_own_value():
    """At start 0 query 0 sees key 0 only: its output is value 0 of its kv head, exactly."""
    rng = np.random.default_rng(3)
    q, k_cache, v_cache = _inputs(rng, 16, 9, 3, 64, 2, 64)
    got = np.asarray(_kernel(q, k_cache, v_cache, np.int32(1), np.int32(0))).reshape(16, 9, 64)
    for h in range(9):
        np.testing.assert_allclose(got[0, h], v_cache[1, h // 3, 0], rtol=1e-6)


@pytest.mark.parametrize("start", [0, 100, 240])
def test_what_the_cache_holds_past_the_chunk_is_never_read(start, threads):
    """NaN in every position past the chunk's end, and in other slots, changes no output bit."""
    chunk, context = 16, 256
    rng = np.random.default_rng(11 + start)
    q, k_cache, v_cache = _inputs(rng, chunk, 9, 3, 64, 3, context)
    clean = np.asarray(_kernel(q, k_cache, v_cache, np.int32(1), np.int32(start)))
    for cache in (k_cache, v_cache):
        cache[1, :, start + chunk :] = np.nan
        cache[0], cache[2] = np.nan, np.nan
    dirty = np.asarray(_kernel(q, k_cache, v_cache, np.int32(1), np.int32(start)))
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("wide", _isas(), ids=lambda w: "avx512" if w else "avx2")
def test_the_default_models_long_prompt_shape(count, wide):
    """SmolLM2's heads, a 16-token chunk over ~1,800 cached keys (the shape behind the stall in
    docs/benchmarks.md, "Prefill"): fewer (kv head, tile) pairs than twice the threads, so each
    pair's keys are split too (2-3 ways here) and the partial softmaxes merged."""
    kernels = cpu_kernels.load()
    cpu_kernels.set_threads(kernels, count)
    cpu_kernels.chunk_attention_isa(kernels, avx512=wide)
    rng = np.random.default_rng(5)
    q, k_cache, v_cache = _inputs(rng, 16, 9, 3, 64, 1, 2048)
    cfg = _config(9, 3, 64)
    got = np.asarray(_kernel(q, k_cache, v_cache, np.int32(0), np.int32(1784)))
    want = np.asarray(_reference(q, k_cache, v_cache, np.int32(0), np.int32(1784), cfg=cfg))
    cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
    cpu_kernels.chunk_attention_isa(kernels, avx512=True)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_a_head_dim_the_kernel_does_not_take_is_a_clear_error():
    q = np.zeros((4, 2, 12), np.float32)
    cache = np.zeros((1, 1, 16, 12), np.float32)
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        cpu_kernels.chunk_attention(q, cache, cache, np.int32(0), np.int32(0))


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
        ks, vs, outs = cache.k, cache.v, []
        for lo in range(0, len(prompt), 5):
            tokens = np.zeros(8, np.int32)
            piece = prompt[lo : lo + 5]
            tokens[: len(piece)] = piece
            x = transformer.embed(ckpt.weights.embed, tokens)[None]  # [1, 8, E]
            x, ks, vs = run(layers, ks, vs, x, np.int32(1), np.int32(lo), cfg=cfg, kernels=kernels)
            outs.append(np.asarray(x[0, : len(piece)]))
        results[kernels] = (np.concatenate(outs), np.asarray(ks[-1][1, :, : len(prompt)]))
        text = run.lower(layers, ks, vs, x, np.int32(1), np.int32(0), cfg=cfg, kernels=kernels).as_text()
        assert (cpu_kernels.CHUNK_TARGET in text) == kernels
    np.testing.assert_allclose(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(results[True][1], results[False][1], atol=1e-5, rtol=1e-5)
