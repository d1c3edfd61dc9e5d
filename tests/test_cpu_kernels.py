"""engine.jax_backend.cpu_kernels: the C++ decode attention equals transformer.decode_attention (the JAX
reference) on random inputs of many shapes, on one thread and split across the pool; the one-row
product equals x @ w; and a machine that cannot build the kernels gets None (the engine then runs
plain JAX), never an error.

The model-level evidence (goldens from transformers, batch invariance, no recompiles, no cache
copy) runs with the kernel in tests/test_transformer_parity.py and tests/test_jax_model.py."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, transformer
from engine.model_store.checkpoint import ModelConfig

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="the CPU kernels cannot be built here (no C++ compiler, or no AVX2/FMA)"
)


def _config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=8, hidden_size=heads * head_dim, n_layers=1,
        n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, ffn_size=8, rms_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
        sliding_window=None,
    )


@pytest.mark.parametrize(
    "rows, heads, kv_heads, head_dim, slots, context",
    [
        (1, 9, 3, 64, 4, 64),  # SmolLM2's heads, one row
        (5, 4, 4, 16, 8, 40),  # no grouping (G = 1), a context that is no power of two
        (3, 8, 2, 12, 3, 17),  # a head dim that is no multiple of the vector width; every slot a row
        (32, 9, 3, 64, 32, 512),  # enough keys to split across the pool
    ],
)
def test_kernel_attention_equals_the_jax_reference(rows, heads, kv_heads, head_dim, slots, context):
    rng = np.random.default_rng(rows * 1000 + context)
    cfg = _config(heads, kv_heads, head_dim)
    q = rng.standard_normal((rows, heads, head_dim), np.float32)
    k_cache = rng.standard_normal((slots, kv_heads, context, head_dim), np.float32)
    v_cache = rng.standard_normal((slots, kv_heads, context, head_dim), np.float32)
    positions = rng.integers(0, context, rows).astype(np.int32)
    positions[0], positions[-1] = 0, context - 1  # one key only, and the whole context
    got = jax.jit(cpu_kernels.decode_attention)(q, k_cache, v_cache, positions)
    want = jax.jit(transformer.decode_attention, static_argnames="cfg")(
        q, k_cache[:rows], v_cache[:rows], positions, cfg=cfg
    )
    assert got.shape == (rows, heads * head_dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "k, n",
    [
        (5, 7),  # shorter than one vector
        (64, 100),
        (20, 3),
        (576, 960),  # SmolLM2's q/k/v, o, gate/up and down products
        (576, 576),
        (576, 3072),
        (1536, 576),
    ],
)
def test_one_row_product_equals_matmul(k, n):
    rng = np.random.default_rng(k * 7 + n)
    x = rng.standard_normal((1, 1, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    out_in = jnp.transpose(jnp.asarray(w))
    got = jax.jit(cpu_kernels.gemv)(x, out_in)
    assert got.shape == (1, 1, n)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.sqrt(k), rtol=1e-5)


def test_one_row_copies_are_used_for_one_row_only():
    """A decode step of one row reads the [out, in] copies, prefill and batches the originals:
    with the copies zeroed only the one-row result changes."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    one, many = jnp.ones((1, 1, 8)), jnp.ones((2, 1, 8))
    zeros = jnp.zeros((16, 8))
    np.testing.assert_array_equal(transformer._project(one, w, zeros), np.zeros((1, 1, 16)))
    np.testing.assert_allclose(transformer._project(many, w, zeros), many @ w, rtol=1e-6)
    np.testing.assert_allclose(transformer._project(one, w, None), one @ w, rtol=1e-6)


def test_keys_past_a_rows_position_are_never_read():
    """Whatever the cache holds past position p (stale values from an earlier request), the row's
    output is the same: NaNs there would show up in the result if they were read."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 8), np.float32)
    k_cache = rng.standard_normal((2, 2, 16, 8), np.float32)
    v_cache = rng.standard_normal((2, 2, 16, 8), np.float32)
    positions = np.array([3, 10], np.int32)
    clean = np.asarray(cpu_kernels.decode_attention(q, k_cache, v_cache, positions))
    k_cache[0, :, 4:], v_cache[0, :, 4:] = np.nan, np.nan
    k_cache[1, :, 11:], v_cache[1, :, 11:] = np.nan, np.nan
    dirty = np.asarray(cpu_kernels.decode_attention(q, k_cache, v_cache, positions))
    np.testing.assert_array_equal(dirty, clean)


def test_a_machine_without_a_compiler_gets_plain_jax(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ or clang++ on it
    with caplog.at_level(logging.INFO, logger="engine.jax_backend.cpu_kernels"):
        assert cpu_kernels.load(cpu_kernels.BuildOptions(tmp_path)) is None
    assert "no C++ compiler" in caplog.text


def test_a_failed_build_gets_plain_jax_and_leaves_no_library(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.jax_backend.cpu_kernels"):
        assert cpu_kernels.load(cpu_kernels.BuildOptions(tmp_path, compiler="false")) is None  # always fails
    assert "CPU decode kernels off" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # the staged file was removed


def test_the_library_is_built_once_and_reused():
    first = cpu_kernels.load()
    assert first is not None and first.path.is_file() and first.path.parent.name == "kernels"
    assert cpu_kernels.load() is first
    assert cpu_kernels._build(cpu_kernels.BuildOptions()) == first.path  # same sources, flags and jaxlib: same file, no rebuild
