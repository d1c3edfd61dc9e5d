"""A checkpoint's weights on the JAX device: pytree registration, the dtype, and the [out, in]
copies that the CPU one-row kernel reads.

engine.model_store.checkpoint reads tensors as numpy and defines the weight classes without JAX;
this module registers them as pytrees (so jitted steps take them as arguments) and places each
tensor on the device, cast to the serving dtype, as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.model_store import checkpoint
from engine.model_store.checkpoint import Checkpoint, LayerWeights, Weights


@dataclass(frozen=True)
class OutInWeights:
    """A layer's four projections again, stored [out, in]: what the CPU one-row kernel reads
    (engine.jax_backend.cpu_kernels.gemv). Made by `with_one_row_copies`, never loaded."""

    qkv: jax.Array  # [(H + 2K) * D, E]
    o: jax.Array  # [E, H * D]
    gate_up: jax.Array  # [2F, E]
    down: jax.Array  # [E, F]


for _cls in (OutInWeights, LayerWeights, Weights):
    jax.tree_util.register_dataclass(_cls)

__all__ = ["Checkpoint", "LayerWeights", "OutInWeights", "Weights", "default_dtype", "load_checkpoint", "with_one_row_copies"]


def default_dtype() -> str:
    """float32 on CPU (XLA:CPU's bfloat16 products are far slower there; docs/benchmarks.md),
    bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_checkpoint(model_dir: str | Path, dtype: str | None = None) -> Checkpoint:
    """The checkpoint with every tensor on the default device as `dtype` (default_dtype())."""
    target = jnp.dtype(dtype or default_dtype())

    def place(array: np.ndarray) -> jax.Array:
        return jnp.asarray(array, target)

    return checkpoint.load_checkpoint(model_dir, place)


def with_one_row_copies(layer: LayerWeights) -> LayerWeights:
    """The layer with [out, in] copies of its projections for the CPU one-row kernel (doubles the
    projections' memory; only JaxModel makes them, when its CPU kernels are on)."""
    t = jnp.transpose
    return replace(layer, out_in=OutInWeights(t(layer.w_qkv), t(layer.w_o), t(layer.w_gate_up), t(layer.w_down)))
