"""Gemma 2's text decoder block (Gemma2ForCausalLM), as transformers computes it: Gemma 3's block
(engine.jax_backend.families.gemma3: (1 + w) RMSNorms, the sandwich norms around the attention and
the MLP, the GELU-tanh MLP, the query_pre_attn_scalar scale) without q/k norms and with one RoPE
base for every layer, local (sliding-window) or global.

Its soft-capping is not here: the attention scores' cap (ModelConfig.attn_softcap) is applied by
every attention path of engine.jax_backend.transformer (XLA, the C++ kernels, Pallas), between
the scale and the mask, and the final logits' (final_softcap) by transformer.logits.

Shapes: B rows, T tokens, E hidden, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

import jax

from engine.jax_backend.families.gemma3 import (  # noqa: F401 (the block's other pieces are Gemma 3's)
    attention_input, attention_residual, final_norm, mlp_residual, scale_queries,
)
from engine.jax_backend.layers import rope, split_qkv
from engine.model_store.checkpoint import LayerWeights, ModelConfig


def qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig, window: int | None) -> tuple[jax.Array, ...]:
    """The normed x [B, T, E] -> q [B, T, H, D] (pre-scaled as Gemma 3's), k/v [B, T, K, D]; every
    layer rotates alike, windowed or not."""
    q, k, v = split_qkv(x, w, cfg)
    q, k = rope((q, k), positions, cfg)
    return scale_queries(q, cfg), k, v
