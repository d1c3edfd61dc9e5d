"""gpt-oss's decoder block (GptOssForCausalLM), as transformers computes it.

Against the dense block: q, k, v and o carry biases (ModelConfig.qkv_bias, o_bias); RoPE is YaRN
(layers.rope: frequencies blended by wavelength, cos and sin scaled by its attention factor);
every layer's MLP is a mixture of experts (engine.jax_backend.moe) routed by the top-k of the
router's biased logits then a softmax over those k, each expert with biases on its gate_up and
down and the clamped SwiGLU below; local (128-token sliding window) and global layers alternate
(ModelConfig.layer_windows, applied by the attention paths, which also take each layer's
attention sinks: LayerWeights.sinks, one logit per query head in its softmax's denominator).
The norms are Llama's RMSNorm.

Shapes: B rows, T tokens, E hidden, M routed rows, F' an expert's features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.jax_backend import moe
from engine.jax_backend.families import dense
from engine.jax_backend.layers import rms_norm
from engine.model_store.checkpoint import LayerWeights, ModelConfig

attention_input, qkv, final_norm = dense.attention_input, dense.qkv, dense.final_norm


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's expert activation, gate/up [M, F'] -> [M, F'] (transformers' GptOssExperts):
    the gate clamped above at `limit`, up clamped to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def attention_residual(x: jax.Array, out: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    """x [B, T, E] plus the attention's output after o, plus o's bias."""
    return x + (out + w.b_o)


def mlp_residual(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    """x [B, T, E] plus the experts' mixture of the normed x."""
    glu = functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    normed = rms_norm(x, w.mlp_norm, cfg.rms_eps)  # [B, T, E]
    return x + moe.moe_mlp(normed, w.experts, cfg.experts_per_token, cfg.routing, glu=glu, panels=w.panels)
