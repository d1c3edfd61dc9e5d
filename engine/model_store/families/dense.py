"""The dense (Llama-shaped) families' checkpoints: Llama, Mistral, Qwen2 and Qwen3, one block
(engine.jax_backend.families.dense) configured by ModelConfig's flags: Qwen2's q/k/v biases,
Qwen3's q/k norms, a sliding window for every layer (Mistral, or Qwen with use_sliding_window).
config.json in transformers 4 (`rope_scaling`/`rope_theta`) or 5 (`rope_parameters`) keys.
"""

from __future__ import annotations

from typing import Any

from engine.model_store.checkpoint import (
    REQUIRED_KEYS, CheckpointError, LayerWeights, ModelConfig, TensorReader, rope_scaling,
)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    arch = (raw.get("architectures") or [raw.get("model_type")])[0]
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{arch}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise CheckpointError(f"{arch}: attention_bias / mlp_bias checkpoints are not supported")
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        raise CheckpointError(f"{arch}: config.json lacks {', '.join(missing)}")
    n_heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    window = raw.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise CheckpointError(f"{arch}: sliding_window must be a whole number >= 1 or null, got {window!r}")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
        ffn_size=raw["intermediate_size"],
        rope_theta=theta,
        rope_scaling=rope_scaling(arch, rope),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        qk_norm=arch == "Qwen3ForCausalLM",
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        sliding_window=window,
    )


def layer(read: TensorReader, p: str, mlp: bool = True) -> LayerWeights:
    """A Llama / Mistral / Qwen2 / Qwen3 layer (transformers' names under prefix `p`);
    post_attention_layernorm is the MLP's input norm here. `mlp=False`: without the dense MLP's
    weights (None), for a layer whose MLP is something else (engine.model_store.families.sparse_moe)."""
    c, device = read.config, read.place
    E, D = c.hidden_size, c.head_dim
    return LayerWeights(
        attn_norm=read.vector(p + "input_layernorm.weight", E),
        w_qkv=device(read.qkv(p)),
        w_o=device(read.o(p)),
        mlp_norm=read.vector(p + "post_attention_layernorm.weight", E),
        w_gate_up=device(read.gate_up(p)) if mlp else None,
        w_down=device(read.down(p)) if mlp else None,
        b_qkv=device(read.qkv_bias(p)) if c.qkv_bias else None,
        q_norm=read.vector(p + "self_attn.q_norm.weight", D) if c.qk_norm else None,
        k_norm=read.vector(p + "self_attn.k_norm.weight", D) if c.qk_norm else None,
    )
