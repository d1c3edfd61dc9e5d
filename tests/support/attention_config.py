"""`attention_config`: the smallest ModelConfig an attention test needs (one layer; only the head
counts, the head dim and the context matter to attention)."""

from __future__ import annotations

from engine.model_store.checkpoint import ModelConfig


def attention_config(heads: int, kv_heads: int, head_dim: int, context: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=8, hidden_size=heads * head_dim, n_layers=1,
        n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, ffn_size=8, rms_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=context, tie_word_embeddings=True, qkv_bias=False, qk_norm=False,
        sliding_window=None,
    )
