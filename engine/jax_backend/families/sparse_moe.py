"""The mixture-of-experts families whose attention is the dense block's: Qwen3-MoE
(Qwen3MoeForCausalLM, with Qwen3's q/k norms) and Mixtral (MixtralForCausalLM, Mistral's
attention). They differ only in config (engine.model_store.families.sparse_moe): the routing,
the experts' sizes, which layers are MoE. A layer with experts (LayerWeights.experts) runs the
shared MoE block (engine.jax_backend.moe) where the dense block runs its gated MLP; a layer
without (Qwen3-MoE's `mlp_only_layers`) runs the dense MLP. Which one is known from the weights'
structure while tracing, so each layer's compiled call holds only its own.

Shapes: B rows, T tokens, E hidden.
"""

from __future__ import annotations

import jax

from engine.jax_backend import moe
from engine.jax_backend.families import dense
from engine.jax_backend.layers import rms_norm
from engine.model_store.checkpoint import LayerWeights, ModelConfig

attention_input, qkv, attention_residual, final_norm = dense.attention_input, dense.qkv, dense.attention_residual, dense.final_norm


def mlp_residual(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> jax.Array:
    """x [B, T, E] plus the MLP of the normed x: the experts' mixture, or a dense layer's MLP."""
    if w.experts is None:
        return dense.mlp_residual(x, w, cfg)
    normed = rms_norm(x, w.mlp_norm, cfg.rms_eps)  # [B, T, E]
    return x + moe.moe_mlp(normed, w.experts, cfg.experts_per_token, cfg.routing, panels=w.panels)
