"""Gemma 3's text decoder block (Gemma3ForCausalLM), as transformers computes it.

Against the dense block: every RMSNorm scales by (1 + w) in float32 (layers.rms_norm_unit_offset);
the attention's and the MLP's outputs are normed again before their residual adds (a "sandwich":
post-attention, pre- and post-feedforward norms); q and k are normed per head; the MLP is
GELU-tanh gated; the attention scale is query_pre_attn_scalar ** -0.5, not 1/sqrt(D); local
(sliding-window) and global layers rotate with different bases (rope_local_base_freq, and
rope_theta with any scaling). The embedding's scale by sqrt(hidden) is folded into the embedding
rows at load (engine.model_store.families.gemma3), so nothing here or in the callers sees it.

The attention paths (XLA, the C++ kernels, Pallas) all divide by sqrt(D); rather than teach each
a scale, q is multiplied by scale * sqrt(D) here, after RoPE, so their product is transformers'.

Shapes: B rows, T tokens, E hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend.layers import apply_rope, gated_mlp, rms_norm_unit_offset, rope_frequencies, split_qkv
from engine.model_store.checkpoint import LayerWeights, ModelConfig

norm = rms_norm_unit_offset
gelu_tanh = functools.partial(jax.nn.gelu, approximate=True)  # transformers' gelu_pytorch_tanh


def attention_input(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return norm(x, w.attn_norm, cfg.rms_eps)


def qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig, window: int | None) -> tuple[jax.Array, ...]:
    """The normed x [B, T, E] -> q [B, T, H, D] (pre-scaled, see the module docstring), k/v
    [B, T, K, D]; a layer with a window (a local one) rotates with the local base."""
    q, k, v = split_qkv(x, w, cfg)
    q, k = norm(q, w.q_norm, cfg.rms_eps), norm(k, w.k_norm, cfg.rms_eps)
    if window is None:
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [D/2]
    else:
        inv_freq = rope_frequencies(cfg.head_dim, cfg.local_rope_theta, None)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    return scale_queries(q, cfg), k, v


def scale_queries(q: jax.Array, cfg: ModelConfig) -> jax.Array:
    """q [..., D] times attention_scale * sqrt(D): the paths then divide by sqrt(D) (module docstring)."""
    q_scale = cfg.attention_scale * np.sqrt(cfg.head_dim)
    return (q.astype(jnp.float32) * q_scale).astype(q.dtype)


def attention_residual(x: jax.Array, out: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return x + norm(out, w.post_attn_norm, cfg.rms_eps)


def mlp_residual(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return x + norm(gated_mlp(norm(x, w.mlp_norm, cfg.rms_eps), w, gelu_tanh), w.post_mlp_norm, cfg.rms_eps)


def final_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    return norm(x, w, cfg.rms_eps)
