"""Weight-only int8 (`--weights int8`): every projection, the embedding and the LM head held as
int8 blocks with float32 scales; activations and the KV cache stay float32.

Layout: a matrix used as x @ W ([in, out] in engine.model_store.checkpoint) is stored transposed,
[out, in], as `Int8Matrix`: q [N, K] int8 and scale [N, K / 32] float32, W.T[n, j] =
q[n, j] * scale[n, j // 32]. That is llama.cpp's Q8_0 (blocks of 32 along the input with one
scale; it keeps the scale in float16), symmetric, round to nearest: scale = max|block| / 127. The
embedding [V, E] is already [rows, in]; a tied head shares it (same object) when it covers every
row, so the model holds those bytes once.

Products: `matmul` sends up to DIRECT_ROWS rows (decode steps, short prompt chunks) to the C++
kernel (engine.jax_backend.cpu_kernels.int8_matmul), which converts in registers as the bytes
stream in; more rows (long prompt chunks) dequantize the matrix in XLA and run its float32 GEMM,
where the convert costs little per row. XLA:CPU does not fuse that convert into the dot, so the
kernel is needed for the few-row case (docs/benchmarks.md). CPU only: the engine refuses int8
where the kernels are off (another backend, no compiler) and under tensor parallelism.

Quantizing reads the float32 checkpoint on the host one tensor at a time as it is placed
(`int8_place`), so the model never exists whole in float32 memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import cpu_kernels

BLOCK = cpu_kernels.INT8_BLOCK
DIRECT_ROWS = 64  # up to this many rows, the C++ kernel; above it, dequantize + XLA's GEMM
WEIGHTS = ("float32", "int8")  # what --weights accepts ("float32": the dtype's own weights)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Matrix:
    """A weight matrix as int8 blocks, stored [out, in] (module docstring)."""

    q: jax.Array  # [N, K] int8
    scale: jax.Array  # [N, K / BLOCK] float32

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's shape as x @ W sees it: [in, out] (the float32 weight's shape)."""
        n, k = self.q.shape
        return k, n

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (q [N, K] int8, scale [N, K / BLOCK] float32), blocks along K."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"int8 weights need every input dimension to be a multiple of {BLOCK}, got {k}")
    blocks = np.asarray(w, np.float32).reshape(n, k // BLOCK, BLOCK)
    scale = np.abs(blocks).max(axis=-1) / 127.0  # [N, K / BLOCK]
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), scale.astype(np.float32)


def dequantize(m: Int8Matrix) -> jax.Array:
    """The float32 matrix W.T [N, K] (tests; the many-row path)."""
    n, k = m.q.shape
    return (m.q.reshape(n, k // BLOCK, BLOCK).astype(jnp.float32) * m.scale[..., None]).reshape(n, k)


def matmul(x: jax.Array, m: Int8Matrix) -> jax.Array:
    """x [..., in] @ W -> [..., out] float32 (module docstring for which path runs)."""
    rows = x.size // x.shape[-1]
    if rows <= DIRECT_ROWS:
        return cpu_kernels.int8_matmul(x, m.q, m.scale)
    return jnp.matmul(x.astype(jnp.float32), dequantize(m).T)


def embed(m: Int8Matrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` of an int8 embedding [V, E] as float32: tokens [...] -> [..., E]."""
    q, scale = m.q[tokens], m.scale[tokens]  # [..., E], [..., E / BLOCK]
    e = q.shape[-1]
    return (q.reshape(*q.shape[:-1], e // BLOCK, BLOCK).astype(jnp.float32) * scale[..., None]).reshape(q.shape)


def int8_place(embedding_shape: tuple[int, int]):
    """A `place` for engine.model_store.checkpoint.load_weights: each 2-D weight as an Int8Matrix
    on the device, transposed from [in, out] to [out, in] except the embedding (the one tensor of
    `embedding_shape`, [V, E], already [rows, in]); 1-D tensors (norms, biases) as float32."""

    def place(array: np.ndarray) -> jax.Array | Int8Matrix:
        if array.ndim != 2:
            return jnp.asarray(array, jnp.float32)
        rows = array if array.shape == embedding_shape else np.ascontiguousarray(array.T)
        q, scale = quantize_rows(rows)
        return Int8Matrix(jnp.asarray(q), jnp.asarray(scale))

    return place


def weight_bytes(tree) -> int:
    """Bytes of the distinct arrays in a pytree of weights (a shared head counted once)."""
    return sum({id(leaf): leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)}.values())
