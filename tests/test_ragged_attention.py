"""engine.jax_backend.ragged_attention: the Pallas decode-attention kernel (on the CPU in Pallas
interpret mode; on a GPU host the same tests run it compiled by Triton) equals the plain-JAX reference and the engine's own XLA decode attention
(transformer.decode_attention) for ragged lengths, idle rows, GQA and several block and split
sizes, in float32 and bfloat16; stale or NaN cache contents past a row's length never reach it;
wired into transformer.decode (ragged=True) a tiny model decodes the same logits as the XLA path;
the decode layers' default choice is the kernel on a GPU only, and on the CPU leaves the lowered
step exactly as before; and JAX's Triton lowering accepts the kernel (cross-lowered for CUDA).

No GPU runs in CI, so there the Triton code is lowered but never compiled or run. Float32
comparisons run under "highest" matmul precision, so a GPU's XLA products are not TF32.

Tolerances: float32 within 1e-6 absolute + 1e-5 relative (the online softmax sums in another
order; products are exact float32; 1.5e-7 seen). bfloat16 within 8e-3 absolute + 8e-3 relative,
two bf16 steps at outputs near 1 (4e-3 seen): both sides read the same bf16 values, but each
rounds its probabilities to bf16 before the value product at a different point (the kernel's are
unnormalised) and the output is rounded to bf16."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import ragged_attention, transformer
from engine.jax_backend.weights import load_checkpoint

TINY = Path(__file__).parent / "assets" / "tiny-llama"
SLOTS, CONTEXT, HEAD_DIM = 6, 64, 16
LENGTHS = np.array([37, 0, 1, 64, 32], np.int32)  # mid-block, idle, one key, the whole context, a block edge
TOL = {jnp.float32: dict(atol=1e-6, rtol=1e-5), jnp.bfloat16: dict(atol=8e-3, rtol=8e-3)}

INTERPRET = jax.default_backend() != "gpu"
kernel = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret"))


def _inputs(heads: int, kv_heads: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = len(LENGTHS)
    q = rng.standard_normal((rows, heads, HEAD_DIM), np.float32)
    k_cache = rng.standard_normal((SLOTS, kv_heads, CONTEXT, HEAD_DIM), np.float32)
    v_cache = rng.standard_normal((SLOTS, kv_heads, CONTEXT, HEAD_DIM), np.float32)
    return (jnp.asarray(a, dtype) for a in (q, k_cache, v_cache))


def _config(heads: int, kv_heads: int):
    """The fields transformer.decode_attention reads, from a real tiny checkpoint's config."""
    cfg = load_checkpoint(TINY, dtype="float32").config
    return replace(cfg, n_heads=heads, n_kv_heads=kv_heads)


@pytest.mark.parametrize(
    "heads, kv_heads, block_k, splits, dtype",
    [
        (4, 2, 16, 1, jnp.float32),  # GQA, G = 2
        (4, 2, 16, 4, jnp.float32),  # split-K: rows with no key in some spans
        (4, 4, 32, 2, jnp.float32),  # H = K
        (6, 2, None, None, jnp.float32),  # G = 3 (padded to 16), the default block and splits
        (8, 1, 64, 1, jnp.float32),  # MQA, one block for the whole context
        (4, 2, 16, 2, jnp.bfloat16),
        (4, 4, 32, 1, jnp.bfloat16),
    ],
)
def test_kernel_equals_reference_and_xla_attention(heads, kv_heads, block_k, splits, dtype):
    q, k_cache, v_cache = _inputs(heads, kv_heads, dtype)
    got = kernel(q, k_cache, v_cache, LENGTHS, block_k=block_k, splits=splits, interpret=INTERPRET)
    assert got.shape == (len(LENGTHS), heads * HEAD_DIM) and got.dtype == dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[LENGTHS == 0], 0.0)  # an idle row: zeros, never NaN
    want = np.asarray(ragged_attention.reference(q, k_cache, v_cache, LENGTHS), np.float32)
    np.testing.assert_allclose(got, want, **TOL[dtype])
    # The engine's XLA path over the whole context, for the rows with keys (query at position length - 1).
    live = LENGTHS > 0
    rows = len(LENGTHS)
    with jax.default_matmul_precision("highest"):
        xla = transformer.decode_attention(
            q, k_cache[:rows], v_cache[:rows], np.maximum(LENGTHS - 1, 0), _config(heads, kv_heads)
        )
    np.testing.assert_allclose(got[live], np.asarray(xla, np.float32)[live], **TOL[dtype])


def test_nothing_past_a_rows_length_is_read():
    q, k_cache, v_cache = _inputs(4, 2, jnp.float32, seed=1)
    clean = np.asarray(kernel(q, k_cache, v_cache, LENGTHS, block_k=32, splits=2, interpret=INTERPRET))
    stale = np.arange(CONTEXT)[None, None, :, None] >= np.pad(LENGTHS, (0, SLOTS - len(LENGTHS)))[:, None, None, None]
    k_dirty = jnp.where(stale, jnp.nan, k_cache)  # NaN everywhere past each slot's length
    v_dirty = jnp.where(stale, jnp.nan, v_cache)
    dirty = np.asarray(kernel(q, k_dirty, v_dirty, LENGTHS, block_k=32, splits=2, interpret=INTERPRET))
    np.testing.assert_array_equal(dirty, clean)


def test_unsupported_shapes_fail_in_one_line():
    q = jnp.zeros((1, 2, 24), jnp.float32)
    cache = jnp.zeros((1, 1, 64, 24), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ragged_attention.decode_attention(q, cache, cache, jnp.ones(1, jnp.int32), interpret=True)
    assert not ragged_attention.supported(24, 64) and not ragged_attention.supported(16, 72)
    assert ragged_attention.supported(128, 8192)


def test_the_default_is_the_kernel_on_a_gpu_only():
    """The decode layers' default (ragged=None) is the kernel on a GPU; on the CPU it never
    applies, and the default lowers to exactly the step lowered before the kernel existed."""
    on_gpu = jax.default_backend() == "gpu"
    assert ragged_attention.available() == ragged_attention.applies(HEAD_DIM, CONTEXT) == on_gpu
    ckpt = load_checkpoint(TINY, dtype="float32")
    cache = transformer.init_cache(ckpt.config, 2, CONTEXT, jnp.float32)
    args = (ckpt.weights, cache, np.zeros(2, np.int32), np.zeros(2, np.int32), np.ones(2, bool))

    def lowered(ragged):
        step = jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels", "ragged"))
        return step.lower(*args, cfg=ckpt.config, attend=32, ragged=ragged).as_text()

    assert lowered(None) == lowered(on_gpu)
    assert lowered(True) != lowered(False)  # so the line above can fail: the kernel changes the step


def test_model_decodes_the_same_with_the_kernel():
    """tiny-llama (H=4, K=2, D=16): two slots prefilled with prompts of different lengths and an
    idle slot between them decode four steps; logits with the kernel (interpret mode on the CPU) equal the
    XLA attention's within float32 noise, and the greedy ids are the same."""
    with jax.default_matmul_precision("highest"):
        _decode_both_ways()


def _decode_both_ways():
    ckpt = load_checkpoint(TINY, dtype="float32")
    cfg, weights = ckpt.config, ckpt.weights
    prefill = jax.jit(transformer.prefill, static_argnames="cfg")
    decode = jax.jit(transformer.decode, static_argnames=("cfg", "attend", "ragged"))
    cache = transformer.init_cache(cfg, 3, CONTEXT, jnp.float32)
    prompts = {0: [5, 17, 300, 42, 7, 9, 11], 2: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]}
    ids = np.zeros(3, np.int32)
    for slot, prompt in prompts.items():
        tokens = np.zeros(32, np.int32)
        tokens[: len(prompt)] = prompt
        logits, cache = prefill(weights, cache, tokens, np.int32(len(prompt)), np.int32(slot), cfg=cfg)
        ids[slot] = int(np.argmax(logits))
    active = np.array([True, False, True])
    positions = np.array([len(prompts[0]), 0, len(prompts[2])], np.int32)
    caches = {False: cache, True: jax.tree.map(jnp.copy, cache)}
    tokens = {False: ids.copy(), True: ids.copy()}
    for _ in range(4):
        out = {}
        for ragged in (False, True):
            out[ragged], caches[ragged] = decode(
                weights, caches[ragged], tokens[ragged], positions, active, cfg=cfg, attend=CONTEXT, ragged=ragged
            )
            tokens[ragged] = np.where(active, np.argmax(np.asarray(out[ragged]), axis=-1), 0).astype(np.int32)
        np.testing.assert_allclose(np.asarray(out[True])[active], np.asarray(out[False])[active], atol=1e-4, rtol=0)
        np.testing.assert_array_equal(tokens[True], tokens[False])
        positions = positions + active


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_for_a_cuda_gpu(dtype):
    """Cross-lowering from this CPU: JAX's Pallas Triton lowering accepts the kernel (power-of-two
    tensors, supported ops) and emits one Triton call with grid (rows, kv heads, splits) at an
    8B-like shape. Triton's own compile to GPU code happens only on a GPU and is not tested here."""
    rows, heads, kv_heads, context, head_dim = 8, 32, 8, 1024, 128
    q = jax.ShapeDtypeStruct((rows, heads, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((16, kv_heads, context, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    step = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret"))
    text = step.trace(q, cache, cache, lengths, interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "grid_x = 8 : i32, grid_y = 8 : i32, grid_z = 4 : i32" in text  # 8 x 8 x 4 splits = 256 programs
