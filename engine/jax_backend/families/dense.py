"""The dense pre-norm block of Llama, Mistral, Qwen2, Qwen3 and Phi-3 / Phi-4 (the families that
are "Llama plus a flag": ModelConfig.qkv_bias, qk_norm, sliding_window, rotary_dim and longrope's
RopeScaling): RMSNorm, q/k/v (bias, per-head q/k norm), RoPE, attention, o, residual; RMSNorm,
SiLU-gated MLP, residual. (Phi-3's fused qkv_proj and gate_up_proj are split at load,
engine.model_store.families.phi3.)

Shapes: B rows, T tokens, E hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

import jax

from engine.jax_backend.layers import gated_mlp, rms_norm, rope, split_qkv
from engine.model_store.checkpoint import LayerWeights, ModelConfig


def attention_input(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, w.attn_norm, cfg.rms_eps)


def qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig, window: int | None) -> tuple[jax.Array, ...]:
    """Project, optionally bias and q/k-norm, then rotate: the normed x [B, T, E] -> q [B,T,H,D],
    k/v [B,T,K,D]. Every layer rotates alike, windowed or not."""
    q, k, v = split_qkv(x, w, cfg)
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_eps)
    q, k = rope((q, k), positions, cfg)
    return q, k, v


def attention_residual(x: jax.Array, out: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return x + out


def mlp_residual(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    return x + gated_mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w, jax.nn.silu)


def final_norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, w, cfg.rms_eps)
