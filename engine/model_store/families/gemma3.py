"""Gemma 3 text checkpoints (Gemma3ForCausalLM, transformers' config.json keys and tensor names).

Its layers hold four norms (input, post-attention, pre- and post-feedforward) and q/k norms, all
stored without Gemma's +1 (engine.jax_backend.families.gemma3 adds it). Which layers are local
(sliding-window) comes from `layer_types` or, in older files, every `sliding_window_pattern`-th
layer being global; the local layers rotate with `rope_local_base_freq` (transformers 5:
rope_parameters.sliding_attention.rope_theta), the global ones with rope_theta and any scaling.
The embedding's rows are stored multiplied by sqrt(hidden), as transformers scales them at run
time (in float32 here, once: in bfloat16 transformers rounds sqrt(hidden) to bfloat16 first).
A Gemma 3 config that sets soft-capping (Gemma 2's; Gemma 3 checkpoints leave it unset) is
refused: the Gemma 3 block is not tested with it. Gemma 2 is engine.model_store.families.gemma2,
which reuses this module's layer reader and layer kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.model_store.checkpoint import (
    REQUIRED_KEYS, CheckpointError, LayerWeights, ModelConfig, TensorReader, rope_scaling,
)

ARCH = "Gemma3ForCausalLM"
LOCAL, GLOBAL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults, for keys a config.json may leave out
DEFAULTS = {
    "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
}


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig with each layer's window, the local RoPE base and the attention scale."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise CheckpointError(f"{ARCH}: {key} is set; logit soft-capping (Gemma 2) is not supported")
    get, n_layers, window = checked(raw, ARCH, DEFAULTS)
    kinds = layer_types(raw, n_layers)
    local, global_ = _rope(raw)
    n_heads = raw["num_attention_heads"]
    return ModelConfig(
        architecture=ARCH,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"),
        ffn_size=raw["intermediate_size"],
        rope_theta=float(global_.get("rope_theta", DEFAULTS["rope_theta"])),
        rope_scaling=rope_scaling(ARCH, global_),
        rms_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=False,
        qk_norm=True,
        max_position_embeddings=get("max_position_embeddings"),
        sliding_window=None,
        layer_windows=tuple(window if kind == LOCAL else None for kind in kinds),
        local_rope_theta=float(local.get("rope_theta", DEFAULTS["rope_local_base_freq"])),
        attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
    )



def checked(raw: dict[str, Any], arch: str, defaults: dict[str, Any]) -> tuple[Callable[[str], Any], int, int]:
    """What Gemma 2 and 3 configs share: the required keys, a GELU-tanh MLP, no attention bias or
    bidirectional attention, a whole-number window (CheckpointError naming the key else).
    -> (a getter that falls back to `defaults`, the layer count, the window)."""
    get = lambda key: raw.get(key, defaults.get(key))  # noqa: E731
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        raise CheckpointError(f"{arch}: config.json lacks {', '.join(missing)}")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{arch}: unsupported hidden_activation {act!r} (only gelu_pytorch_tanh)")
    if raw.get("attention_bias") or raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{arch}: attention_bias / use_bidirectional_attention checkpoints are not supported")
    window = get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(f"{arch}: sliding_window must be a whole number >= 1, got {window!r}")
    return get, raw["num_hidden_layers"], window

def layer_types(raw: dict[str, Any], n_layers: int, arch: str = ARCH, pattern: int = DEFAULTS["sliding_window_pattern"]) -> list[str]:
    """Each layer's kind: `layer_types`, or for configs that predate it transformers' rule, every
    `pattern`-th layer global (Gemma 3: sliding_window_pattern, default 6; Gemma 2: every other)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", pattern))
        kinds = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - {LOCAL, GLOBAL}:
        raise CheckpointError(f"{arch}: layer_types must name {LOCAL!r} or {GLOBAL!r} for each of {n_layers} layers")
    return list(kinds)


def _rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(local, global) RoPE parameters from transformers 5's per-kind `rope_parameters` or the
    older rope_theta / rope_local_base_freq / rope_scaling keys."""
    params = raw.get("rope_parameters") or {}
    if LOCAL in params or GLOBAL in params:
        local, global_ = dict(params.get(LOCAL) or {}), dict(params.get(GLOBAL) or {})
    else:
        local = {"rope_theta": raw.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"])}
        global_ = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", DEFAULTS["rope_theta"])}
    if rope_scaling(ARCH, local) is not None:
        raise CheckpointError(f"{ARCH}: rope scaling on the sliding-window layers is not supported")
    return local, global_


def layer(read: TensorReader, p: str) -> LayerWeights:
    """One layer: transformers' post_attention_layernorm is the attention's output norm here, not
    the MLP's input norm as in Llama; pre_feedforward_layernorm is that."""
    c, device = read.config, read.place
    E, D = c.hidden_size, c.head_dim
    return LayerWeights(
        attn_norm=read.vector(p + "input_layernorm.weight", E),
        w_qkv=device(read.qkv(p)),
        w_o=device(read.o(p)),
        mlp_norm=read.vector(p + "pre_feedforward_layernorm.weight", E),
        w_gate_up=device(read.gate_up(p)),
        w_down=device(read.down(p)),
        b_qkv=None,
        q_norm=read.vector(p + "self_attn.q_norm.weight", D) if c.qk_norm else None,  # Gemma 2 has none
        k_norm=read.vector(p + "self_attn.k_norm.weight", D) if c.qk_norm else None,
        post_attn_norm=read.vector(p + "post_attention_layernorm.weight", E),
        post_mlp_norm=read.vector(p + "post_feedforward_layernorm.weight", E),
    )


def embed_scale(config: ModelConfig) -> float:
    return config.hidden_size**0.5
