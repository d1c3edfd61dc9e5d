"""Quantized weights for XLA's own products: `--weights int8` wherever the CPU kernels are off (an
accelerator, or the CPU with `--cpu-kernels off` or in bfloat16), and `--weights fp8` everywhere.
The CPU kernels' int8 (engine.jax_backend.quantize: blocks of 32 in panels, read by C++) is a
layout for those kernels only; this one is for a GEMM that XLA compiles, so it is kept simple.

Layout: a matrix used as x @ W ([in, out] in engine.model_store.checkpoint) is held as
`ChannelMatrix`: q [N, K] ([out, in], the input contiguous) and one float32 scale per output
channel, scale [N], W.T[n, :] ~ q[n, :] * scale[n]. The embedding [V, E] is already [rows, in]:
its rows are its channels, so a tied head that covers every row is the embedding's own object.
[out, in] is also the operand layout cuBLASLt's fp8 GEMM takes (both operands contiguous along
the contraction), so XLA needs no transpose of the weights for it.

int8 (`product` on an int8 q): symmetric, scale = max |W.T[n, :]| / 127, round to nearest. The
product is dot(x, convert(q)) * scale: a per-output scale commutes with the sum over the input,
so it moves out of the contraction and the dot's weight operand is a bare convert of q. That is
the operand XLA:GPU's GEMM fusion takes into the GEMM (its Triton emitter widens the int8 tile in
registers as it loads it), so a step reads the weights as 1 byte a parameter; the scale is a
multiply on the [R, N] result. A per-block scale (the CPU kernels' blocks of 32) would sit inside
the contraction as a broadcast multiply of the operand, not this plain convert of it. Not yet
seen on a GPU: were the convert not fused, int8 would write and read a widened copy of each
matrix, slower than bfloat16 at batch 1 (benchmarks/gpu_check's weights phase shows which). int8 values are exact in bfloat16 and float32, so the widened operand is exactly q and
the product is the dequantized matrix's, to the activations' rounding. XLA:CPU does not fuse the
convert: there it widens each matrix per call (the CPU's fast int8 is the kernels').

fp8 (`product` on a float8_e4m3fn q): e4m3 with scale = max |W.T[n, :]| / 448 (e4m3's largest
finite value), round to nearest even. The activations are quantized too, at run time, per row:
x_q = x / s_r in e4m3 with s_r = max |x[r, :]| / 448, then one fp8 x fp8 dot_general with float32
results (preferred_element_type), times s_r and scale[n]. Why activations in fp8 rather than
weight-only with an upcast: Hopper's fp8 tensor cores do twice the bfloat16 rate, and only a
product of two fp8 operands gets it (XLA:GPU rewrites such a dot into cuBLASLt's fp8 GEMM): at
batch 256, where the bfloat16 step is far from memory-bound, that is the speed fp8 is for, while
at batch 1 both forms read the same bytes. An upcast fp8 weight would be int8's speed with
e4m3's coarser values. Why per row rather than per tensor: a per-tensor scale is a maximum over
the whole batch, so each sequence's rounding would depend on its batch-mates (and a calibrated
static scale needs data we do not have); per row, a row's result is the same whatever else is in
the step, and the scale is one small reduction over [R, K]. Products of e4m3 values are exact in
float32: on the CPU XLA widens both operands to float32 and multiplies them (checked in
tests/test_gpu_weights.py), which is what the tensor cores compute but for the order (and
Hopper's accumulator width) of the sums.

The embedding and the LM head are int8 channels in both formats: the embedding is a lookup (no
product to speed up), and the head's errors land on the logits that sampling reads, where int8's
finer steps keep near-ties as bfloat16 orders them; int8 still halves their bytes. Norms and
biases stay in the activations' dtype. Quantizing runs on the device (`quantize`, one compile
per matrix shape): the loader places one float32 tensor at a time and quantizes it there, and
benchmarks quantize random weights where they were made.

Shapes: R rows (all leading axes of x), K in, N out, V embedding rows, E hidden.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127.0
FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448: e4m3fn has no infinity, and a larger value converts to NaN
FORMATS = ("int8", "fp8")  # --weights choices this module serves


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ChannelMatrix:
    """A weight matrix as q [N, K] (int8 or float8_e4m3fn) with a float32 scale per output row
    (module docstring)."""

    q: jax.Array  # [N, K] int8 or float8_e4m3fn
    scale: jax.Array  # [N] float32
    dtype: str = field(metadata=dict(static=True))  # the activations' dtype: what `embed` gives back

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's shape as x @ W sees it: [in, out] (the unquantized weight's shape)."""
        return self.q.shape[1], self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


@functools.partial(jax.jit, static_argnames=("fmt", "dtype"))
def quantize(rows: jax.Array, fmt: str, dtype: str) -> ChannelMatrix:
    """rows [N, K] (any float dtype) -> a ChannelMatrix of `fmt` ("int8" or "fp8"), each row
    scaled by its own largest magnitude (an all-zero row gets scale 0 and q 0)."""
    top = INT8_MAX if fmt == "int8" else FP8_MAX
    w = rows.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1) / top  # [N]
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    scaled = jnp.clip(w / safe, -top, top)  # [N, K]
    q = jnp.round(scaled).astype(jnp.int8) if fmt == "int8" else scaled.astype(FP8)  # (round half to even)
    return ChannelMatrix(q, scale, dtype)


def dequantize(m: ChannelMatrix) -> jax.Array:
    """W.T [N, K] float32, the values the products use (tests)."""
    return m.q.astype(jnp.float32) * m.scale[:, None]


def _contract_last(x: jax.Array, q: jax.Array, out: jnp.dtype) -> jax.Array:
    """x [..., K] . q [N, K] over K -> [..., N] in `out` (the weights stay [N, K]: no transpose)."""
    return jax.lax.dot_general(x, q, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out)


def quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Activations x [..., K] -> (x_q [..., K] e4m3, s [..., 1] float32), x ~ x_q * s per row
    (module docstring: why per row)."""
    x32 = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / FP8_MAX  # [..., 1]
    safe = jnp.where(s > 0, s, 1.0)
    return jnp.clip(x32 / safe, -FP8_MAX, FP8_MAX).astype(FP8), s


def product(x: jax.Array, m: ChannelMatrix) -> jax.Array:
    """x [..., K] @ W -> [..., N] float32: int8 weight-only, or fp8 x fp8 (module docstring)."""
    if m.q.dtype == jnp.int8:
        y = _contract_last(x, m.q.astype(x.dtype), jnp.float32)  # [..., N]: the convert is the GEMM operand's
        return y * m.scale
    xq, s = quantize_rows_fp8(x)  # [..., K] e4m3, [..., 1]
    y = _contract_last(xq, m.q, jnp.float32)  # [..., N]: fp8 x fp8, float32 results
    return y * s * m.scale


def embed(m: ChannelMatrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` [...] of an embedding held as channels [V, E] -> [..., E] in m.dtype."""
    rows = m.q[tokens].astype(jnp.float32) * m.scale[tokens][..., None]  # [..., E]
    return rows.astype(m.dtype)


def channel_place(fmt: str, dtype: str, embedding_shape: tuple[int, int], head_shape: tuple[int, int]):
    """A `place` for engine.model_store.checkpoint.load_weights: each 2-D weight quantized on the
    device as a ChannelMatrix, from [in, out] to [out, in], except the embedding (`embedding_shape`,
    [V, E], already [rows, in]); the embedding and the head (`head_shape`, [E, V']) in int8, the
    projections in `fmt`; 1-D tensors (norms, biases) in `dtype`. A projection that happens to
    have the head's shape is held as the head is (int8: the same result, read at int8's speed)."""
    if fmt not in FORMATS:
        raise ValueError(f"per-channel weights are {' or '.join(FORMATS)}, not {fmt!r}")

    def place(array: np.ndarray) -> jax.Array | ChannelMatrix:
        if array.ndim != 2:
            return jnp.asarray(array, dtype)
        rows = array if array.shape == embedding_shape else np.ascontiguousarray(array.T)
        kind = "int8" if array.shape in (embedding_shape, head_shape) else fmt
        return jax.block_until_ready(quantize(jnp.asarray(rows, jnp.float32), kind, dtype))

    return place


def quantize_weights(weights, fmt: str, dtype: str):
    """engine.model_store.checkpoint.Weights of plain arrays ([in, out] projections, embedding
    [V, E], head [E, V']) -> the same with ChannelMatrix matrices as `channel_place` makes them,
    quantized on the device where they are (benchmarks' random weights); a head that is the
    embedding transposed (tied) becomes the embedding's object."""
    from dataclasses import replace

    def project(w: jax.Array) -> ChannelMatrix:
        return quantize(jnp.transpose(w), fmt, dtype)

    layers = tuple(
        replace(layer, w_qkv=project(layer.w_qkv), w_o=project(layer.w_o), w_gate_up=project(layer.w_gate_up),
                w_down=project(layer.w_down))
        for layer in weights.layers
    )
    embed_m = quantize(weights.embed, "int8", dtype)
    head = weights.lm_head
    tied = head.shape == weights.embed.shape[::-1] and bool(jnp.array_equal(jnp.transpose(head), weights.embed))
    head_m = embed_m if tied else quantize(jnp.transpose(head), "int8", dtype)
    return jax.block_until_ready(replace(weights, embed=embed_m, layers=layers, lm_head=head_m))
