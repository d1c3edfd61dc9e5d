"""A checkpoint's weights on the JAX device: pytree registration, the dtype, and the
panel-packed copies that the CPU kernel of products of a few rows reads.

engine.model_store.checkpoint reads tensors as numpy and defines the weight classes without JAX;
this module registers them as pytrees (so jitted steps take them as arguments) and places each
tensor on the device, cast to the serving dtype, as it is read; or, split over a mesh
(`load_sharded`, engine.jax_backend.mesh), reads each to the host and places it shard by shard.
"""

from __future__ import annotations

import collections
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import cpu_kernels
from engine.jax_backend.backend_profile import profile
from engine.model_store import checkpoint
from engine.model_store.checkpoint import Checkpoint, ExpertWeights, LayerWeights, ModelConfig, Weights

if TYPE_CHECKING:
    from engine.jax_backend import mesh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PanelWeights:
    """A layer's four projections again, packed in panels of 32 outputs: what the CPU kernel for
    products of a few rows reads (engine.jax_backend.cpu_kernels.panel_matmul); an MoE layer's
    experts likewise, each expert packed, for the grouped product's kernel
    (cpu_kernels.expert_panel_matmul). Made by `with_panels`, never loaded."""

    qkv: jax.Array  # [ceil(K * (G + 2) * D / 32), E, 32]
    o: jax.Array  # [ceil(E / 32), H * D, 32]
    gate_up: jax.Array | None  # [ceil(2F / 32), E, 32]  (None in an MoE layer: its experts have no panels)
    down: jax.Array | None  # [ceil(E / 32), F, 32]
    experts_gate_up: jax.Array | None = None  # [X, ceil(2F' / 32), E, 32]  an MoE layer's experts, each packed
    experts_down: jax.Array | None = None  # [X, ceil(E / 32), F', 32]


@dataclass(frozen=True)
class PackedHead:
    """The LM head [E, V'] with its panel-packed copy (`with_panels` makes one for the head too):
    transformer.logits reads the copy for up to cpu_kernels.PANEL_ROWS rows."""

    w: jax.Array  # [E, V']
    panels: jax.Array  # [ceil(V' / 32), E, 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape


for _cls in (PanelWeights, PackedHead, ExpertWeights, LayerWeights, Weights):
    jax.tree_util.register_dataclass(_cls)

__all__ = ["Checkpoint", "LayerWeights", "PackedHead", "PanelWeights", "Weights", "default_dtype", "load_channels", "load_checkpoint", "load_int8", "load_sharded", "with_panels"]


def default_dtype() -> str:
    """float32 on CPU (XLA:CPU's bfloat16 products are far slower there; docs/benchmarks.md),
    bfloat16 on accelerators: the backend profile's."""
    return profile().dtype


def load_checkpoint(model_dir: str | Path, dtype: str | None = None) -> Checkpoint:
    """The checkpoint with every tensor on the default device as `dtype` (default_dtype())."""
    target = jnp.dtype(dtype or default_dtype())

    def place(array: np.ndarray) -> jax.Array:
        return jnp.asarray(array, target)

    def place_head(rows: np.ndarray) -> jax.Array:  # [V', E] -> [E, V'], transposed by XLA on the device
        return _transposed(jnp.asarray(rows, target))  # (numpy's transpose of Gemma 3's 671 MB head: ~3 s)

    return checkpoint.load_checkpoint(model_dir, place, place_head)


_transposed = jax.jit(jnp.transpose)


def load_int8(model_dir: str | Path) -> Checkpoint:
    """The checkpoint with weight-only int8 projections, embedding and head
    (engine.jax_backend.quantize); a tied head that covers every embedding row shares the
    embedding's integers (held once). A directory converted from a GGUF (it holds
    `model.gguf`, e.g. the pulled default model) is read from the GGUF's own blocks
    (quantize.gguf_weights); any other has each float32 tensor quantized as it is read."""
    from engine.jax_backend import quantize
    from engine.model_store import families, gguf_blocks, gguf_convert

    model_dir = Path(model_dir)
    cfg = checkpoint.parse_config(json.loads((model_dir / "config.json").read_text()))
    if (model_dir / gguf_convert.GGUF_NAME).is_file():
        get = gguf_blocks.int8_tensor_reader(model_dir / gguf_convert.GGUF_NAME, quantize.quantize_rows)
        head_size = checkpoint.tokenizer_size(model_dir, cfg.vocab_size)
        weights = quantize.gguf_weights(get, cfg, head_size)
        held = collections.Counter(m.bits for layer in weights.layers for m in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
        log.info("int8 from %s: layer matrices held in %s; embedding %d bits; %.1f MiB", gguf_convert.GGUF_NAME,
                 ", ".join(f"{bits} bits: {held[bits]}" for bits in sorted(held)), weights.embed.bits,
                 quantize.weight_bytes(weights) / 2**20)
        return Checkpoint(cfg, weights, checkpoint.eos_token_ids(model_dir), head_size)
    ckpt = checkpoint.load_checkpoint(  # the head's rows [V', E] quantized as they are read, not transposed there and back
        model_dir, quantize.int8_place((cfg.vocab_size, cfg.hidden_size)), lambda rows: quantize.pack(*quantize.quantize_rows(rows))
    )
    w = ckpt.weights
    if cfg.tie_word_embeddings and w.lm_head.shape == w.embed.shape:
        # The head's integers once. A family whose embedding is its rows scaled (Gemma's sqrt(E))
        # looks up the head's matrix with its scales multiplied, as from a GGUF (quantize.scaled);
        # the scaled embedding itself must never be the head (logits sqrt(E) times too large).
        scale = families.FAMILIES[cfg.architecture].embed_scale
        tied = replace(w, embed=quantize.scaled(w.lm_head, scale(cfg))) if scale else replace(w, lm_head=w.embed)
        ckpt = replace(ckpt, weights=tied)
    return ckpt


def load_channels(model_dir: str | Path, fmt: str, dtype: str | None = None) -> Checkpoint:
    """The checkpoint with per-channel quantized matrices for XLA's own products
    (engine.jax_backend.channel_quant: `fmt` "int8" or "fp8" projections, int8 embedding and
    head), norms in `dtype` (default_dtype()); each float32 tensor is quantized on the device as
    it is read, so the model never exists whole in float32. A tied head that covers every
    embedding row is the embedding's own ChannelMatrix (held once)."""
    from engine.jax_backend import channel_quant

    model_dir = Path(model_dir)
    cfg = checkpoint.parse_config(json.loads((model_dir / "config.json").read_text()))
    head_size = checkpoint.tokenizer_size(model_dir, cfg.vocab_size)
    place = channel_quant.channel_place(
        fmt, jnp.dtype(dtype or default_dtype()).name, (cfg.vocab_size, cfg.hidden_size), (cfg.hidden_size, head_size)
    )
    ckpt = checkpoint.load_checkpoint(model_dir, place)
    w = ckpt.weights
    if cfg.tie_word_embeddings and w.lm_head.shape == w.embed.shape:
        ckpt = replace(ckpt, weights=replace(w, lm_head=w.embed))
    return ckpt


def load_sharded(model_dir: str | Path, dtype: str | None, size: int) -> tuple[Checkpoint, ModelConfig, "mesh.Plan"]:
    """The checkpoint over a mesh of `size` devices (engine.jax_backend.mesh): its weights in
    shards, the config the forward pass runs with there (kv heads replicated when `size`
    exceeds them), and the plan. The sizes are checked against config.json before any tensor
    is read. While the shards are placed the host holds the whole model once, in the serving
    dtype (for a 70B model in bfloat16, ~140 GB of host memory during loading)."""
    from engine.jax_backend import mesh

    if not jax.distributed.is_initialized():  # (a group asked for its local devices when it joined)
        mesh.request_cpu_devices(size)
    model_dir = Path(model_dir)
    cfg = checkpoint.parse_config(json.loads((model_dir / "config.json").read_text()))
    plan = mesh.make_plan(cfg, size, checkpoint.tokenizer_size(model_dir, cfg.vocab_size))
    target = jnp.dtype(dtype or default_dtype())
    host = checkpoint.load_checkpoint(model_dir, lambda array: array.astype(target))  # numpy, cast as read
    weights = mesh.shard_weights(host.weights, host.config, plan, target)
    return replace(host, weights=weights), mesh.parallel_config(host.config, size), plan


def packed_head(lm_head: jax.Array) -> PackedHead:
    """The head with its panel-packed copy (adds the head's size again in memory)."""
    return PackedHead(lm_head, cpu_kernels.pack_panels(lm_head))


def with_panels(layer: LayerWeights) -> LayerWeights:
    """The layer with panel-packed copies of its projections for the CPU kernel of products of a
    few rows (doubles the projections' memory; only JaxModel makes them, when its CPU kernels are
    on)."""
    def pack(w: jax.Array | None) -> jax.Array | None:
        return None if w is None else cpu_kernels.pack_panels(w)

    experts = layer.experts
    packed_experts = (None, None) if experts is None else tuple(
        jax.vmap(cpu_kernels.pack_panels)(w) for w in (experts.gate_up, experts.down)
    )  # for the grouped product's kernel (cpu_kernels.expert_panel_matmul)
    return replace(layer, panels=PanelWeights(pack(layer.w_qkv), pack(layer.w_o), pack(layer.w_gate_up), pack(layer.w_down), *packed_experts))


def read_every_step(layers: tuple[LayerWeights, ...], head: jax.Array | PackedHead, final_norm: jax.Array) -> tuple:
    """Of a model's decode layers and head (`decode_weights`'), the arrays a decode step of a few
    rows streams through whole: where a projection has its panel copy, the copy and not the
    matrix it copies (which products of more rows than cpu_kernels.PANEL_ROWS read), and the
    head's panel copy likewise. The embedding table is not among them: a step reads one of its
    rows an input. What JaxModel moves into huge pages (engine.jax_backend.host_memory)."""
    def read(layer: LayerWeights) -> LayerWeights:
        if layer.panels is None:
            return layer
        return replace(layer, w_qkv=None, w_o=None, w_gate_up=None, w_down=None)

    return tuple(read(layer) for layer in layers), head.panels if isinstance(head, PackedHead) else head, final_norm


def decode_weights(weights: Weights, panels: bool) -> tuple[tuple[LayerWeights, ...], jax.Array | PackedHead]:
    """The layers and head a model's steps read: with `panels` (the CPU kernels, float32 weights),
    with their panel-packed copies for products of a few rows (cpu_kernels.panel_matmul); never
    for quantized matrices (engine.jax_backend.quantize, channel_quant), which have products of
    their own."""
    if not panels or not isinstance(weights.layers[0].w_qkv, jax.Array):
        return weights.layers, weights.lm_head
    return tuple(with_panels(layer) for layer in weights.layers), packed_head(weights.lm_head)
