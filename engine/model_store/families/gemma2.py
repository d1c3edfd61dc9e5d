"""Gemma 2 text checkpoints (Gemma2ForCausalLM, transformers' config.json keys and tensor names).

Its layers are Gemma 3's without the q/k norms (the same four norms, stored without Gemma's +1,
read by engine.model_store.families.gemma3.layer), the embedding scaled by sqrt(hidden) as Gemma
3's; local (sliding-window) and global layers alternate (`layer_types`, or in older files every
other layer global) and all rotate with one base (rope_theta, or transformers 5's
rope_parameters). What is Gemma 2's own: the soft-capping of attention scores
(`attn_logit_softcapping`) and of the final logits (`final_logit_softcapping`), each None in
config.json for none.
"""

from __future__ import annotations

from typing import Any

from engine.model_store.checkpoint import CheckpointError, ModelConfig, rope_scaling
from engine.model_store.families import gemma3

ARCH = "Gemma2ForCausalLM"
# transformers' Gemma2Config defaults, for keys a config.json may leave out
DEFAULTS = {
    "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 10_000.0,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
}

layer = gemma3.layer
embed_scale = gemma3.embed_scale


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig with each layer's window, the attention scale and the two caps."""
    get, n_layers, window = gemma3.checked(raw, ARCH, DEFAULTS)
    kinds = gemma3.layer_types(raw, n_layers, ARCH, pattern=2)
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    return ModelConfig(
        architecture=ARCH,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_layers=n_layers,
        n_heads=raw["num_attention_heads"],
        n_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"),
        ffn_size=raw["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
        rope_scaling=rope_scaling(ARCH, rope),
        rms_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=False,
        qk_norm=False,
        max_position_embeddings=get("max_position_embeddings"),
        sliding_window=None,
        layer_windows=tuple(window if kind == gemma3.LOCAL else None for kind in kinds),
        attention_scale=float(get("query_pre_attn_scalar")) ** -0.5,
        attn_softcap=_cap(get("attn_logit_softcapping"), "attn_logit_softcapping"),
        final_softcap=_cap(get("final_logit_softcapping"), "final_logit_softcapping"),
    )


def _cap(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise CheckpointError(f"{ARCH}: {key} must be a number > 0 or null, got {value!r}")
    return float(value)
