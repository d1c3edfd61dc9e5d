"""Gemma 2 (Gemma2ForCausalLM, issue 44 part 2) against transformers: tests/assets/tiny-gemma2,
made by transformers 5.24 through scripts/make_tiny_checkpoints.py (tied; local (window 8),
global and local layers; attention scores soft-capped at 3 and logits at 12, small enough that
both caps bite; query_pre_attn_scalar 24 != head_dim 16; norm weights drawn around 1, read as
1 + w ~ 2; prompts of 11 and 28 tokens and 16 greedy steps, so the window is outgrown).

- The config: each layer's window, the scale and both caps, from transformers 5's keys and the
  older ones (no layer_types: every other layer global); a cap that is no number refused by name.
- The attention soft-cap in every path, against the XLA reference with the same config: the C++
  CPU kernels (decode and chunk, with and without a window, both ISAs), the Pallas kernel in
  interpret mode; each capped result differs from the uncapped one (the cap bites), and a config
  without a cap lowers to no tanh and the uncapped kernel targets (nothing added).
- The whole model in plain JAX and with the CPU kernels: logits within ATOL and greedy ids equal
  to the goldens; each cached decode step equal to a full prefill of the same history; a prompt
  in chunks of 5 across the window's edges, packed with the others, and riding along with
  another slot's decode steps, each giving transformers' logits.

Float32 on the CPU device, as tests/test_transformer_parity.py (whose module docstring says why)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, families, ragged_attention, transformer
from engine.model_store.checkpoint import CheckpointError, parse_config
from support import golden_parity, paged_kv, prerequisites

GEMMA2 = Path(__file__).parent / "assets" / "tiny-gemma2"
RAW = json.loads((GEMMA2 / "config.json").read_text())
CASES = json.loads((GEMMA2 / "golden.json").read_text())["cases"]
CFG = parse_config(RAW)
UNCAPPED = replace(CFG, attn_softcap=None)
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5
ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_kernels._cpu_flags() else [])


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # conftest: arrays and calls on the CPU device


def test_the_config_gives_each_layer_its_window_the_scale_and_both_caps():
    assert CFG.layer_windows == (8, None, 8) and CFG.sliding_window is None and not CFG.qk_norm
    assert CFG.attn_softcap == 3.0 and CFG.final_softcap == 12.0 and CFG.local_rope_theta is None
    assert CFG.attention_scale == pytest.approx(24**-0.5) and CFG.tie_word_embeddings and CFG.rope_theta == 1e4
    assert families.block(CFG) is families.GEMMA2
    older = {k: v for k, v in RAW.items() if k not in ("rope_parameters", "layer_types")} | {"rope_theta": 1e4}
    assert parse_config(older) == replace(CFG, layer_windows=(8, None, 8))  # every other layer global
    assert parse_config({**RAW, "attn_logit_softcapping": None, "final_logit_softcapping": None}).final_softcap is None
    with pytest.raises(CheckpointError, match="Gemma2ForCausalLM: attn_logit_softcapping must be a number > 0"):
        parse_config({**RAW, "attn_logit_softcapping": -1})


def _scaled_queries(rng, shape):
    return jnp.asarray(4 * rng.standard_normal(shape), jnp.float32)  # scores ~ N(0, 16): the cap of 3 bites


def _pools(rng, tables, lengths, n_pages, page, d):
    """support.paged_kv's pools with 0 where they hold NaN (the XLA reference multiplies the
    values it masks by 0, and 0 x NaN would be NaN)."""
    return (jnp.asarray(np.nan_to_num(a)) for a in paged_kv.pools(rng, tables, lengths, 2, n_pages, page, d))


# The XLA references jitted: one program per (config, window) and shape, where op by op each of
# their dozens of operations compiles its own executable on the first call.
DECODE_REFERENCE = jax.jit(transformer.decode_attention, static_argnums=(5, 6))
CHUNK_REFERENCE = jax.jit(transformer.chunk_attention, static_argnums=(5,), static_argnames=("block", "window"))
# The Pallas kernel (interpreted) and its reference too: the interpreter runs each grid step's
# operations one by one, each compiling its own executable, where jitted the kernel is one program.
PALLAS = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret", "window", "softcap"))
PALLAS_REFERENCE = jax.jit(ragged_attention.reference, static_argnames=("window", "softcap"))


@pytest.mark.parametrize("isa", ISAS)
def test_the_cpu_kernels_soft_cap_as_the_xla_attention_does(isa):
    kernels = prerequisites.cpu_kernels()
    assert cpu_kernels.decode_attention_isa(kernels, isa == "avx512") == isa
    assert cpu_kernels.chunk_attention_isa(kernels, isa == "avx512") == isa
    try:
        rng = np.random.default_rng(5)
        page, heads, d = 8, 4, 16
        positions = np.array([0, 6, 19, 47, 130], np.int32)
        tables, n_pages = paged_kv.tables(rng, positions + 1, page, width=20)
        k, v = _pools(rng, tables, positions + 1, n_pages, page, d)
        q = _scaled_queries(rng, (len(positions), heads, d))
        for window in (None, 8):
            want = DECODE_REFERENCE(q, k, v, tables, positions, CFG, window)  # [R, H*D]
            got = cpu_kernels.decode_attention(q, k, v, tables, positions, window, CFG.attn_softcap)
            np.testing.assert_allclose(got, want, atol=2e-5)
            uncapped = DECODE_REFERENCE(q, k, v, tables, positions, UNCAPPED, window)
            assert not np.allclose(got, uncapped, atol=1e-2)
        start, c = 27, 24  # a chunk over 51 keys
        table, n_pages = paged_kv.tables(rng, [start + c], page, width=8)
        k, v = _pools(rng, table, [start + c], n_pages, page, d)
        q = _scaled_queries(rng, (c, heads, d))
        for window in (None, 8):
            want = CHUNK_REFERENCE(q, k, v, table[0], jnp.int32(start), CFG, block=16, window=window)
            got = cpu_kernels.chunk_attention(q, k, v, table[0], np.int32(start), window, CFG.attn_softcap)
            np.testing.assert_allclose(got, want, atol=2e-5)
            uncapped = CHUNK_REFERENCE(q, k, v, table[0], jnp.int32(start), UNCAPPED, block=16, window=window)
            assert not np.allclose(got, uncapped, atol=1e-2)
    finally:
        cpu_kernels.decode_attention_isa(kernels, True)
        cpu_kernels.chunk_attention_isa(kernels, True)


def test_the_pallas_kernel_in_interpret_mode_soft_caps_as_the_reference():
    rng = np.random.default_rng(3)
    page, width = 8, 12
    lengths = jnp.asarray([0, 5, 21, 60, 96], jnp.int32)  # an idle row, inside and past the window
    r = lengths.shape[0]
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((2, r * width + 1, page, 16)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(1 + rng.permutation(r * width).reshape(r, width), jnp.int32)
    q = _scaled_queries(rng, (r, 4, 16))
    window = 8  # the cap is one line of the kernel, windowed or not: one interpreted run
    got = PALLAS(q, k_pages, v_pages, tables, lengths, block_k=16, splits=2, interpret=True, window=window, softcap=3.0)
    want = PALLAS_REFERENCE(q, k_pages, v_pages, tables, lengths, window=window, softcap=3.0)
    np.testing.assert_allclose(got, want, atol=2e-5)
    live = np.asarray(lengths) > 0  # the reference equals the engine's XLA attention on live rows
    xla = DECODE_REFERENCE(q, k_pages, v_pages, tables, jnp.maximum(lengths - 1, 0), CFG, window)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(xla)[live], atol=2e-5)
    uncapped = PALLAS_REFERENCE(q, k_pages, v_pages, tables, lengths, window=window)
    assert not np.allclose(np.asarray(got)[live], np.asarray(uncapped)[live], atol=1e-2)


def test_without_a_cap_nothing_is_added_to_the_lowered_attention():
    q = jnp.zeros((2, 4, 16), jnp.float32)
    pool = jnp.zeros((2, 9, 8, 16), jnp.float32)
    tables, positions = jnp.ones((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)

    def lowered(cfg, kernels):
        def step(q, k, v, t, p):
            return transformer._decode_seen(q, k, v, t, p, p >= 0, cfg, 32, kernels, False, None)
        return jax.jit(step).lower(q, pool, pool, tables, positions).as_text()

    assert "tanh" in lowered(CFG, False) and "tanh" not in lowered(UNCAPPED, False)
    assert cpu_kernels.CAPPED_ATTENTION_TARGET in lowered(CFG, True)
    plain = lowered(UNCAPPED, True)
    assert cpu_kernels.ATTENTION_TARGET in plain and "capped" not in plain and "tanh" not in plain


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def whole_model(request) -> golden_parity.WholeModel:
    """tiny-gemma2's weights and its whole-model calls, jitted once per path."""
    return golden_parity.load(GEMMA2, CFG, CONTEXT, request.param)


def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    golden_parity.check_goldens_and_cached_decode(whole_model, CASES, BATCH, ATOL)


def test_a_prompt_in_chunks_across_the_window_edge_packed_and_riding_along_gives_transformers_logits(whole_model):
    golden_parity.check_chunks_across_the_window_edge(whole_model, CASES, BATCH, ATOL)  # 28 tokens in pieces of 5
    golden_parity.check_packed(whole_model, CASES, BATCH, ATOL)
    golden_parity.check_chunks_riding_along(whole_model, CASES, BATCH, ATOL)
