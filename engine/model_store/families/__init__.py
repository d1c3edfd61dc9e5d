"""The checkpoint side of each model family: its config.json keys and its tensor names, one module
per family, one line per architecture in `FAMILIES`, keyed by config.json's `architectures`
(engine.model_store.checkpoint reads through it). The forward side is engine.jax_backend.families
(its `BLOCKS`, keyed alike). No JAX here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.model_store.checkpoint import LayerWeights, ModelConfig, TensorReader
from engine.model_store.families import dense, gemma2, gemma3, gpt_oss, phi3, sparse_moe


@dataclass(frozen=True)
class Family:
    """parse_config: config.json -> ModelConfig (CheckpointError for what the family cannot run);
    layer: one layer's tensors under a prefix ("model.layers.{i}.") -> LayerWeights;
    embed_scale: the factor the embedding's rows are stored multiplied by (None: as read);
    post_norms: whether each layer also norms the attention's and the MLP's outputs (Gemma), two
    more [E] vectors a layer (the memory check at load counts them)."""

    parse_config: Callable[[dict[str, Any]], ModelConfig]
    layer: Callable[[TensorReader, str], LayerWeights]
    embed_scale: Callable[[ModelConfig], float] | None = None
    post_norms: bool = False


DENSE = Family(dense.parse_config, dense.layer)
FAMILIES: dict[str, Family] = {
    **{arch: DENSE for arch in dense.ARCHITECTURES},  # Llama, Mistral, Qwen2, Qwen3
    "Gemma3ForCausalLM": Family(gemma3.parse_config, gemma3.layer, gemma3.embed_scale, post_norms=True),
    "Gemma2ForCausalLM": Family(gemma2.parse_config, gemma2.layer, gemma2.embed_scale, post_norms=True),
    "Phi3ForCausalLM": Family(phi3.parse_config, phi3.layer),
    **{arch: Family(sparse_moe.parse_config, sparse_moe.layer) for arch in sparse_moe.ARCHITECTURES},  # Qwen3-MoE, Mixtral
    gpt_oss.ARCH: Family(gpt_oss.parse_config, gpt_oss.layer),
}
