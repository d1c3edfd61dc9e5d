"""Mixture-of-experts checkpoints whose attention is the dense families': Qwen3-MoE
(Qwen3MoeForCausalLM) and Mixtral (MixtralForCausalLM), transformers' config.json keys and tensor
names as the Hugging Face Hub holds them (one tensor per expert and projection).

Both are the dense block (engine.model_store.families.dense: Qwen3-MoE with Qwen3's q/k norms,
Mixtral as Mistral, a sliding window if its config sets one) with the MLP of some or all layers
replaced by a router and experts (engine.jax_backend.moe):
- Qwen3-MoE: `num_experts` experts of `moe_intermediate_size` features, `num_experts_per_tok` per
  token; softmax over the experts, top-k, renormalised when `norm_topk_prob`; a layer i is MoE
  unless it is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (such a
  layer has the dense MLP of `intermediate_size`). Tensors `mlp.gate` (router), `mlp.experts.{j}.
  {gate,up,down}_proj`.
- Mixtral: `num_local_experts` experts of `intermediate_size` features, every layer MoE; top-k of
  the logits, softmax over those k. Tensors `block_sparse_moe.gate`, `block_sparse_moe.experts.{j}.
  w1` (gate), `w3` (up), `w2` (down).
Shared experts (Qwen2-MoE, DeepSeek) are not in either and not read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from engine.model_store.checkpoint import CheckpointError, ExpertWeights, LayerWeights, ModelConfig, TensorReader
from engine.model_store.families import dense

QWEN3_MOE, MIXTRAL = "Qwen3MoeForCausalLM", "MixtralForCausalLM"
ARCHITECTURES = (QWEN3_MOE, MIXTRAL)
# per family: the MoE MLP's prefix in a layer, and its experts' (gate, up, down) tensor names
NAMES = {
    QWEN3_MOE: ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    MIXTRAL: ("block_sparse_moe.", ("w1", "w3", "w2")),
}


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> the dense config of the attention (Qwen3's or Mistral's) plus the experts."""
    arch = raw["architectures"][0]
    like = "Qwen3ForCausalLM" if arch == QWEN3_MOE else "MistralForCausalLM"
    try:
        attention = dense.parse_config({**raw, "architectures": [like]})
    except CheckpointError as error:  # named as the checkpoint names itself
        raise CheckpointError(str(error).replace(like, arch)) from None
    n_layers = attention.n_layers
    if arch == QWEN3_MOE:
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        expert_ffn = raw.get("moe_intermediate_size")
        routing = "softmax_renormalized" if raw.get("norm_topk_prob", False) else "softmax"
        step, dense_only = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        if not isinstance(step, int) or step < 1:
            raise CheckpointError(f"{arch}: decoder_sparse_step must be a whole number >= 1, got {step!r}")
        moe = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n_layers))
    else:
        experts, expert_ffn, routing, moe = raw.get("num_local_experts"), raw["intermediate_size"], "topk_softmax", (True,) * n_layers
    k = raw.get("num_experts_per_tok")
    for key, value in (("the expert count", experts), ("num_experts_per_tok", k), ("the experts' intermediate size", expert_ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{arch}: {key} must be a whole number >= 1, got {value!r}")
    if k > experts:
        raise CheckpointError(f"{arch}: num_experts_per_tok {k} exceeds the {experts} experts")
    return replace(
        attention, architecture=arch, n_experts=experts, experts_per_token=k, expert_ffn_size=expert_ffn,
        routing=routing, moe_layers=moe,
    )


def layer(read: TensorReader, p: str) -> LayerWeights:
    """One layer: the dense family's attention and norms; its MLP dense (`mlp.{gate,up,down}_proj`)
    or, in an MoE layer, a router and experts (and no dense MLP)."""
    c = read.config
    if not c.moe_layers[int(p.rstrip(".").rsplit(".", 1)[1])]:  # p: "model.layers.{i}."
        return dense.layer(read, p)
    return replace(dense.layer(read, p, mlp=False), experts=experts(read, p))


def experts(read: TensorReader, p: str) -> ExpertWeights:
    """The router [E, X] and the experts stacked: gate_up [X, E, 2F'] (interleaved), down [X, F', E]."""
    c = read.config
    E, F, X = c.hidden_size, c.expert_ffn_size, c.n_experts
    prefix, (gate, up, down) = NAMES[c.architecture]
    m = p + prefix
    gate_ups, downs = [], []
    for j in range(X):
        g = read.tensor(f"{m}experts.{j}.{gate}.weight", (F, E))  # [F', E]
        u = read.tensor(f"{m}experts.{j}.{up}.weight", (F, E))
        gate_ups.append(np.stack([g, u], axis=1).reshape(2 * F, E).T)  # [E, 2F'], feature f at 2f, 2f + 1
        downs.append(read.tensor(f"{m}experts.{j}.{down}.weight", (E, F)).T)  # [F', E]
    return ExpertWeights(
        router=read.place(read.tensor(m + "gate.weight", (X, E)).T),  # [E, X]
        gate_up=read.place(np.stack(gate_ups)),
        down=read.place(np.stack(downs)),
    )

