"""gpt-oss checkpoints (GptOssForCausalLM): transformers' config.json keys and tensor names, with
the experts either as float tensors (what transformers' save_pretrained writes) or as MXFP4
(what the Hub's openai/gpt-oss-* hold, `quantization_config.quant_method` "mxfp4"), unpacked
to float32 at load (engine.model_store.mxfp4) and then placed in the served dtype.

A layer: Llama's norms, q/k/v/o with biases, `self_attn.sinks` [H] (a logit per query head,
engine.jax_backend.families.gpt_oss), and an MoE MLP of `num_local_experts` experts of
`intermediate_size` features, `num_experts_per_tok` a token: `mlp.router.{weight,bias}`, and
`mlp.experts.gate_up_proj` [X, E, 2F'] (gate and up interleaved, feature by feature: our own
layout) with `gate_up_proj_bias` [X, 2F'], `down_proj` [X, F', E] with `down_proj_bias` [X, E];
or, in MXFP4, `gate_up_proj_blocks` [X, 2F', E / 32, 16] and `_scales` [X, 2F', E / 32] (the
matrix [out, in] per expert), `down_proj_blocks` [X, E, F' / 32, 16] and `_scales`. Which
layers are local (`sliding_window`, 128 in the released models) comes from `layer_types`, or
every other layer from the first without it (transformers' default). RoPE: YaRN
(`rope_parameters`, or the Hub's older `rope_scaling` and `rope_theta`), or any kind the dense
families read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.model_store import mxfp4
from engine.model_store.checkpoint import (
    REQUIRED_KEYS, CheckpointError, ExpertWeights, LayerWeights, ModelConfig, TensorReader, rope_scaling, yarn_scaling,
)
from engine.model_store.families.gemma3 import LOCAL, layer_types

ARCH = "GptOssForCausalLM"
# transformers' GptOssConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 128, "tie_word_embeddings": False,
    "max_position_embeddings": 131_072, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rope_theta": 150_000.0,
    "num_experts_per_tok": 4, "attention_bias": True,
}
QUANT_METHODS = ("mxfp4",)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig: each layer's window, YaRN, the experts and their activation."""
    get = lambda key: raw.get(key, DEFAULTS.get(key))  # noqa: E731
    missing = [k for k in (*REQUIRED_KEYS, "num_local_experts") if k not in raw]
    if missing:
        raise CheckpointError(f"{ARCH}: config.json lacks {', '.join(missing)}")
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant is not None and quant not in QUANT_METHODS:
        raise CheckpointError(
            f"{ARCH}: quantization_config.quant_method {quant!r} is not supported (mxfp4 experts, or none)"
        )
    if not get("attention_bias"):
        raise CheckpointError(f"{ARCH}: attention_bias false is not supported (gpt-oss's q/k/v/o carry biases)")
    n_layers, window = raw["num_hidden_layers"], get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(f"{ARCH}: sliding_window must be a whole number >= 1, got {window!r}")
    experts, k, ffn = raw["num_local_experts"], get("num_experts_per_tok"), raw["intermediate_size"]
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", k), ("intermediate_size", ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{ARCH}: {key} must be a whole number >= 1, got {value!r}")
    if k > experts:
        raise CheckpointError(f"{ARCH}: num_experts_per_tok {k} exceeds the {experts} experts")
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", get("rope_theta")))
    kind = rope.get("rope_type", rope.get("type", "default"))
    n_heads = raw["num_attention_heads"]
    return ModelConfig(
        architecture=ARCH,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=get("head_dim"),
        ffn_size=ffn,
        rope_theta=theta,
        rope_scaling=yarn_scaling(ARCH, rope) if kind == "yarn" else rope_scaling(ARCH, rope),
        rms_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=True,
        qk_norm=False,
        max_position_embeddings=get("max_position_embeddings"),
        sliding_window=None,
        layer_windows=tuple(window if kind_ == LOCAL else None for kind_ in layer_types(raw, n_layers, ARCH, pattern=2)),
        n_experts=experts,
        experts_per_token=k,
        expert_ffn_size=ffn,
        routing="topk_softmax",  # transformers' GptOssTopKRouter: top-k of the biased logits, softmax over those
        moe_layers=(True,) * n_layers,
        o_bias=True,
        attention_sinks=True,
        expert_bias=True,
        swiglu_alpha=float(get("swiglu_alpha")),
        swiglu_limit=float(get("swiglu_limit")),
    )


def layer(read: TensorReader, p: str) -> LayerWeights:
    """One layer: Llama's norms and fused q/k/v (with their biases), o's bias, the sinks, the experts."""
    c, device = read.config, read.place
    E = c.hidden_size
    return LayerWeights(
        attn_norm=read.vector(p + "input_layernorm.weight", E),
        w_qkv=device(read.qkv(p)),
        w_o=device(read.o(p)),
        mlp_norm=read.vector(p + "post_attention_layernorm.weight", E),
        w_gate_up=None,
        w_down=None,
        b_qkv=device(read.qkv_bias(p)),
        q_norm=None,
        k_norm=None,
        experts=experts(read, p + "mlp."),
        b_o=read.vector(p + "self_attn.o_proj.bias", E),
        sinks=read.vector(p + "self_attn.sinks", c.n_heads),
    )


def experts(read: TensorReader, m: str) -> ExpertWeights:
    """The router [E, X] and its bias [X]; the experts stacked, gate_up [X, E, 2F'] and down
    [X, F', E] (float, or unpacked from MXFP4), and their biases."""
    c, device = read.config, read.place
    E, F, X = c.hidden_size, c.expert_ffn_size, c.n_experts
    return ExpertWeights(
        router=device(read.tensor(m + "router.weight", (X, E)).T),
        gate_up=device(_matrix(read, m + "experts.gate_up_proj", X, E, 2 * F)),
        down=device(_matrix(read, m + "experts.down_proj", X, F, E)),
        router_bias=read.vector(m + "router.bias", X),
        gate_up_bias=device(read.tensor(m + "experts.gate_up_proj_bias", (X, 2 * F))),
        down_bias=device(read.tensor(m + "experts.down_proj_bias", (X, E))),
    )


def _matrix(read: TensorReader, name: str, x: int, n_in: int, n_out: int) -> np.ndarray:
    """Experts' matrices [X, in, out] float32: the float tensor `name`, or else `name`_blocks and
    `name`_scales (MXFP4, [X, out, in] on disk) unpacked and transposed."""
    try:
        blocks = read.get(name + "_blocks")
    except CheckpointError:  # not MXFP4: the float tensor (its own error names it if it is missing too)
        return read.tensor(name, (x, n_in, n_out))
    scales = read.get(name + "_scales")
    groups = -(-n_in // mxfp4.BLOCK)
    want = ((x, n_out, groups, mxfp4.BLOCK // 2), (x, n_out, groups))
    if (tuple(blocks.shape), tuple(scales.shape)) != want or n_in % mxfp4.BLOCK:
        raise CheckpointError(
            f"{ARCH}: {name}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)}, expected {want[0]} / {want[1]}"
        )
    return np.ascontiguousarray(mxfp4.unpack(blocks, scales).swapaxes(1, 2))  # [X, in, out]
