"""Model families: what one decoder layer does around the shared paged attention, picked by the
checkpoint's architecture (its config.json `architectures`, ModelConfig.architecture).

engine.jax_backend.transformer owns everything about the KV pages and the attention paths (XLA,
the C++ CPU kernels, Pallas) and runs a group of layers; at each layer it asks the family's
`Block` for the three things that differ between families: the queries, keys and values from the
residual stream (norms, projections, RoPE, the attention scale), what the attention's output adds
to the stream, and what the MLP adds. The head's norm is the block's too. Each family is one
module here over engine.jax_backend.layers, its checkpoint side (config keys, tensor names) one
module under engine.model_store.families, and one line in each registry (`BLOCKS` below,
engine.model_store.families.FAMILIES); tests/test_gemma3.py checks that the two name the same
architectures. Every function is traced with a static config: choosing a
block adds no operation to the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax

from engine.jax_backend.families import dense, gemma2, gemma3, gpt_oss, sparse_moe
from engine.model_store.checkpoint import LayerWeights, ModelConfig


@dataclass(frozen=True)
class Block:
    """A family's decoder layer, in the pieces transformer's layer loops call.

    attention_input(x [B, T, E], w, cfg) -> [B, T, E]: the stream normed for the attention.
    qkv(that [B, T, E], w, positions [B, T], cfg, window) -> q [B, T, H, D], k/v [B, T, K, D]: the
        attention's inputs, rotated (and q scaled so that the paths' 1/sqrt(D) gives the family's
        scale); `window` is the layer's sliding window (None: global), for families whose local
        and global layers differ in more than the mask.
    attention_residual(x, out [B, T, E], w, cfg) -> x: the stream after the attention (o applied).
    mlp_residual(x, w, cfg) -> x: the stream after the MLP.
    final_norm(x [..., E], w [E], cfg) -> [..., E]: the norm before the head.
    """

    attention_input: Callable[[jax.Array, LayerWeights, ModelConfig], jax.Array]
    qkv: Callable[[jax.Array, LayerWeights, jax.Array, ModelConfig, int | None], tuple[jax.Array, ...]]
    attention_residual: Callable[[jax.Array, jax.Array, LayerWeights, ModelConfig], jax.Array]
    mlp_residual: Callable[[jax.Array, LayerWeights, ModelConfig], jax.Array]
    final_norm: Callable[[jax.Array, jax.Array, ModelConfig], jax.Array]


DENSE = Block(dense.attention_input, dense.qkv, dense.attention_residual, dense.mlp_residual, dense.final_norm)
GEMMA3 = Block(gemma3.attention_input, gemma3.qkv, gemma3.attention_residual, gemma3.mlp_residual, gemma3.final_norm)
GEMMA2 = Block(gemma2.attention_input, gemma2.qkv, gemma2.attention_residual, gemma2.mlp_residual, gemma2.final_norm)
SPARSE_MOE = Block(sparse_moe.attention_input, sparse_moe.qkv, sparse_moe.attention_residual, sparse_moe.mlp_residual, sparse_moe.final_norm)
GPT_OSS = Block(gpt_oss.attention_input, gpt_oss.qkv, gpt_oss.attention_residual, gpt_oss.mlp_residual, gpt_oss.final_norm)

# One line per family (engine.model_store.families.FAMILIES names the same architectures).
BLOCKS: dict[str, Block] = {
    **{arch: DENSE for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")},
    "Gemma3ForCausalLM": GEMMA3,
    "Gemma2ForCausalLM": GEMMA2,
    "Phi3ForCausalLM": DENSE,  # its fused projections split at load (engine.model_store.families.phi3)
    **{arch: SPARSE_MOE for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")},
    "GptOssForCausalLM": GPT_OSS,
}


def block(cfg: ModelConfig) -> Block:
    """The block of the config's architecture (parse_config admits only those BLOCKS names)."""
    return BLOCKS[cfg.architecture]
