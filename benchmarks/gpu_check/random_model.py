"""Models of a given shape with random weights, for speed measurements without a download.

`random_weights` builds the engine's `Weights` pytree directly on the default device, layer by
layer with `jax.random` in the serving dtype (no file is read and nothing passes through the
host); `random_model` wraps it in a `JaxModel`, the serving model, so a
measurement runs exactly what `tokenwire decode-server` runs. `write_random_checkpoint` writes a
Hugging Face directory instead (float16 safetensors, config.json, a tokenizer), for the one place
a model must be a directory: the decode-server process of the stack measurement.

Weights are N(0, 1/fan_in) (norms 1), so activations stay near 1 through any depth and no
bfloat16 value overflows; what they predict is noise, which speed does not care about.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from benchmarks.gpu_check.plan import Shape
from engine.core.model import ModelInfo
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.weights import LayerWeights, Weights
from engine.model_store.checkpoint import ModelConfig, parse_config


# XLA's own RngBitGenerator: compiles in a fraction of threefry's time, and the bits need not be
# reproducible across backends (nothing compares them).
RNG = "rbg"


def model_config(shape: Shape) -> ModelConfig:
    """The engine's static config for `shape`, through the same parser a checkpoint goes through."""
    return parse_config(shape.config_json())


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)


@functools.partial(jax.jit, static_argnames=("shapes", "dtype"))
def _normals(key: jax.Array, shapes: tuple[tuple[int, ...], ...], dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """One array per shape, N(0, 1/shape[0]): a layer's matrices in one compiled call."""
    return tuple(_normal(k, shape, dtype) for k, shape in zip(jax.random.split(key, len(shapes)), shapes))


def random_weights(cfg: ModelConfig, dtype: str, seed: int = 0) -> Weights:
    """Weights of `cfg`'s shapes on the default device; the head covers the whole vocabulary."""
    dt = jnp.dtype(dtype)
    E, F, D, H, K, V = cfg.hidden_size, cfg.ffn_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size
    keys = iter(jax.random.split(jax.random.key(seed, impl=RNG), cfg.n_layers + 1))
    ones = jnp.ones((E,), dt)
    matrices = ((E, (H + 2 * K) * D), (H * D, E), (E, 2 * F), (F, E))  # w_qkv, w_o, w_gate_up, w_down

    def layer() -> LayerWeights:
        qkv, o, gate_up, down = _normals(next(keys), matrices, dt)
        return LayerWeights(ones, qkv, o, ones, gate_up, down, b_qkv=None, q_norm=None, k_norm=None)

    layers = tuple(layer() for _ in range(cfg.n_layers))
    embed, head = _normals(next(keys), ((V, E), (E, V)), dt)
    head = jnp.transpose(embed) if cfg.tie_word_embeddings else head
    return jax.block_until_ready(Weights(embed=embed, layers=layers, final_norm=ones, lm_head=head))


def random_model(
    shape: Shape, dtype: str, weights: Weights | None = None, *, max_batch_size: int, max_context_length: int,
    **knobs,
) -> tuple[JaxModel, Weights]:
    """A JaxModel of `shape` (knobs as JaxModel.load takes them: min_bucket, min_attend,
    max_chunk, ...), on `weights` when given (models of one shape share them) or fresh ones."""
    cfg = model_config(shape)
    weights = weights if weights is not None else random_weights(cfg, dtype)
    info = ModelInfo(shape.name, cfg.vocab_size, max_context_length, max_batch_size, frozenset())
    return JaxModel(cfg, weights, info, jnp.dtype(dtype), **knobs), weights


def write_random_checkpoint(directory: Path, shape: Shape, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Hugging Face Llama directory of `shape` with random float16 weights and the tokenizer
    files of `tokenizer_dir` (the vocabulary should be the tokenizer's size)."""
    directory.mkdir(parents=True, exist_ok=True)
    E, F, D, H, K, V = shape.hidden, shape.ffn, shape.head_dim, shape.heads, shape.kv_heads, shape.vocab
    keys = iter(jax.random.split(jax.random.key(seed, impl=RNG), 7 * shape.layers + 2))

    def normal(rows: int, cols: int) -> np.ndarray:  # HF layout [out, in]
        return np.asarray(jnp.transpose(_normal(next(keys), (cols, rows), jnp.float16)))

    ones = np.ones(E, np.float16)
    tensors = {"model.embed_tokens.weight": normal(V, E), "model.norm.weight": ones}
    if not shape.tied:
        tensors["lm_head.weight"] = normal(V, E)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones,
            p + "self_attn.q_proj.weight": normal(H * D, E), p + "self_attn.k_proj.weight": normal(K * D, E),
            p + "self_attn.v_proj.weight": normal(K * D, E), p + "self_attn.o_proj.weight": normal(E, H * D),
            p + "mlp.gate_proj.weight": normal(F, E), p + "mlp.up_proj.weight": normal(F, E),
            p + "mlp.down_proj.weight": normal(E, F),
        }
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(shape.config_json(), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory
