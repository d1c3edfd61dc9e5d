"""Phi-3 and Phi-4 checkpoints (Phi3ForCausalLM: Phi-3-mini and -medium, Phi-3.5-mini, Phi-4,
Phi-4-mini): the dense block (engine.jax_backend.families.dense) under transformers' Phi-3 tensor
names, whose q/k/v and gate/up projections are each one fused matrix.

- `qkv_proj` [H * D + 2 * K * D, E] holds q's rows, then k's, then v's; `gate_up_proj` [2F, E]
  the gate's, then the up's. Both are split at load and laid out as every dense layer's
  (LayerWeights: per kv head, its queries, key and value; gate and up interleaved), so nothing
  downstream (the kernels, int8, tensor parallelism) knows the checkpoint fused them.
- `sliding_window` (Phi-3-mini-4k: 2047) is every layer's window, as Mistral's.
- RoPE: the default, or `longrope` (Phi-3-*-128k, Phi-3.5, Phi-4-mini; "su" and "yarn" are its
  older names in these configs) with one short and one long factor per rotated pair and cos/sin
  scaled by the attention factor (given, or sqrt(1 + ln(factor) / ln(original))) with factor
  max_position_embeddings / original_max_position_embeddings when not given): the long factors
  from original_max_position_embeddings on (engine.jax_backend.layers.rope). And
  `partial_rotary_factor` (Phi-4-mini: 0.75): only that part of each head rotates.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from engine.model_store.checkpoint import CheckpointError, LayerWeights, ModelConfig, RopeScaling, TensorReader
from engine.model_store.families import dense

ARCH = "Phi3ForCausalLM"


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig: the dense keys (dense.parse_config), then Phi-3's RoPE."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    config = dense.parse_config({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None})
    fraction = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary = int(config.head_dim * fraction)
    if not 0 < fraction <= 1 or rotary % 2:
        raise CheckpointError(f"{ARCH}: partial_rotary_factor {fraction} gives {rotary} rotated dims of "
                              f"{config.head_dim}; it must be an even number > 0")
    return replace(config, rope_scaling=_scaling(raw, rope, rotary), rotary_dim=None if rotary == config.head_dim else rotary)


def _scaling(raw: dict[str, Any], rope: dict[str, Any], rotary: int) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("longrope", "su", "yarn"):  # transformers' Phi3Config takes only these
        raise CheckpointError(f"{ARCH}: unsupported rope_parameters.rope_type {kind!r} (default, longrope)")
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original < 1:
        raise CheckpointError(f"{ARCH}: longrope needs original_max_position_embeddings >= 1, got {original!r}")
    short, long = rope.get("short_factor"), rope.get("long_factor")
    for key, factors in (("short_factor", short), ("long_factor", long)):
        if not isinstance(factors, list) or len(factors) != rotary // 2:
            raise CheckpointError(f"{ARCH}: rope_parameters.{key} must list {rotary // 2} numbers (one per rotated pair)")
    factor = float(rope.get("factor") or raw.get("max_position_embeddings", original) / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope", factor, original_max_position_embeddings=original, short_factor=tuple(map(float, short)),
        long_factor=tuple(map(float, long)), attention_factor=float(attention),
    )


def layer(read: TensorReader, p: str) -> LayerWeights:
    """One layer: the fused qkv_proj and gate_up_proj split (the module docstring) into the dense
    layout; post_attention_layernorm is the MLP's input norm, as in Llama."""
    c, device = read.config, read.place
    E, F, HD, KD = c.hidden_size, c.ffn_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    q, k, v = np.split(read.tensor(p + "self_attn.qkv_proj.weight", (HD + 2 * KD, E)), [HD, HD + KD])  # [HD|KD|KD, E]
    gate, up = np.split(read.tensor(p + "mlp.gate_up_proj.weight", (2 * F, E)), 2)  # [F, E] each
    return LayerWeights(
        attn_norm=read.vector(p + "input_layernorm.weight", E),
        w_qkv=device(read.by_kv_head(q, k, v).T),
        w_o=device(read.o(p)),
        mlp_norm=read.vector(p + "post_attention_layernorm.weight", E),
        w_gate_up=device(read.interleave(gate, up)),
        w_down=device(read.down(p)),
        b_qkv=None,
        q_norm=None,
        k_norm=None,
    )
