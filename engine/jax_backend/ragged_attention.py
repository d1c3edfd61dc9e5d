"""Ragged decode attention for the GPU: a Pallas kernel where each row reads only its own live
keys, in place from the slot KV cache.

Why: without it a GPU decode step attends over an "attend bucket", a window of the cache up to a
power of two above the longest row, for every row, and XLA may copy that sliced window before its
products; at large batch and context that is most of the cache read every step, whatever the rows'
real lengths. Here the cache goes to the kernel whole and untouched: program (row r, kv head k,
split j) walks split j's keys of slot r, kv head k in blocks of `block_k`, and stops at the row's
live length, so a step reads sum(lengths) keys, not R x bucket, and nothing is copied.

What holds:
- GQA: one program serves the G = H / K query heads of a kv head, so each key block is read once
  for all of them. G is padded with zero queries to `Gp` (a power of two, at least 16: Triton's
  dot wants 16 rows); the padding's outputs are dropped.
- Online softmax (flash attention) over key blocks, in float32 whatever the cache dtype. Keys
  past the live length in the last block are masked, and their values zeroed, so stale (even NaN)
  cache contents past a row's length never reach its output.
- Split-K (flash decoding): the context is cut into `splits` spans so that few rows still fill
  the GPU; each span returns its partial sums and running max, combined in plain JAX after.
- An idle row (length 0) reads nothing and gets zeros: finite, and ignored by the caller.

Where it runs: `applies()` says whether the decode layers use it (a GPU backend, the Pallas
Triton lowering importable, shapes it supports); engine.jax_backend.transformer.decode_layers
calls `decode_attention` then. On the CPU the engine keeps its own paths (the C++ kernel,
engine.jax_backend.cpu_kernels, or the bucketed XLA attention), bit for bit. On the CPU this
module runs only in Pallas interpret mode, for tests (`interpret=None` picks it off a GPU).
The GPU lowering was written against JAX 0.10's Triton lowering; nothing GPU-only is imported
until a kernel is lowered for a GPU.

Shapes: B cache slots, R rows (the first R slots), H query heads, K kv heads, G = H / K, Gp G
padded, D head dim, S cache positions, P splits, Bk keys per block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from engine.jax_backend.backend_profile import profile

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16
DEFAULT_BLOCK_K = 64  # keys per loop iteration
MIN_GROUP = 16  # query rows per program: the G heads of a kv head, zero-padded up to this
TARGET_PROGRAMS = 256  # split the context until rows x kv heads x splits reaches this (about 2 per SM)
MAX_SPLITS = 16


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def available() -> bool:
    """Whether this process can run the kernel compiled: a GPU backend, and JAX's Pallas Triton
    lowering importable. Fixed for a process's life (its backend is), so cached."""
    if profile().name != "gpu":
        return False
    try:
        from jax.experimental.pallas import triton  # noqa: F401  (GPU-only piece, imported late)
    except ImportError:
        return False
    return True


def supported(head_dim: int, context: int) -> bool:
    """Whether the kernel takes these shapes: Triton tensors have power-of-two sizes, so D must be
    a power of two >= 16, and key blocks of >= 16 must tile the context S."""
    return _power_of_two(head_dim) and head_dim >= MIN_BLOCK and context % MIN_BLOCK == 0


def applies(head_dim: int, context: int) -> bool:
    """The one predicate for "decode attention is the ragged Pallas kernel here": `available()`
    and `supported()`. When it holds, a decode step's attention ignores the attend bucket, so
    one attend shape (the context) is enough. Not under tensor parallelism: a Pallas call is
    opaque to XLA's partitioner (the caller passes `ragged=False` to the decode layers then)."""
    return available() and supported(head_dim, context)


def _block_k(context: int, block_k: int | None) -> int:
    """The largest power of two <= `block_k` (default DEFAULT_BLOCK_K) that divides the context."""
    want = DEFAULT_BLOCK_K if block_k is None else block_k
    if not _power_of_two(want) or want < MIN_BLOCK:
        raise ValueError(f"block_k must be a power of two >= {MIN_BLOCK}, got {want}")
    b = want
    while context % b:
        b //= 2
    if b < MIN_BLOCK:
        raise ValueError(f"the context {context} is not a multiple of {MIN_BLOCK}")
    return b


def _splits(rows: int, kv_heads: int, context: int, block_k: int, splits: int | None) -> int:
    """Spans the context is cut into: as given, or the fewest powers of two that bring the
    programs to TARGET_PROGRAMS (MAX_SPLITS at most); each span a whole number of key blocks."""
    blocks = context // block_k
    if splits is not None:
        if splits < 1 or blocks % splits:
            raise ValueError(f"splits must divide the {blocks} key blocks of {block_k}, got {splits}")
        return splits
    p = 1
    while rows * kv_heads * p < TARGET_PROGRAMS and p < MAX_SPLITS and blocks % (2 * p) == 0:
        p *= 2
    return p


def _kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k: int, scale: float, precision):
    """One (row, kv head, split): lengths_ref [] (the row's live keys), q_ref [Gp, D], k_ref/v_ref
    [S / P, D] (this split's positions of the row's slot and kv head, read in place) -> o_ref
    [Gp, D] unnormalised float32 sums, m_ref [Gp] the running max, l_ref [Gp] the softmax
    denominator. A split with no live keys runs no iteration: o = 0, l = 0, m = float32 min."""
    span = k_ref.shape[0]
    live = jnp.clip(lengths_ref[()] - pl.program_id(2) * span, 0, span)  # live keys in this split
    q = q_ref[...]  # [Gp, D]
    gp, d = q.shape

    def body(i, carry):
        o, m, l = carry  # [Gp, D], [Gp], [Gp] float32
        at = pl.multiple_of(i * block_k, block_k)
        seen = at + jnp.arange(block_k) < live  # [Bk]
        k = k_ref[pl.ds(at, block_k), :]  # [Bk, D]
        s = _dot(q, k, 1, precision) * scale  # [Gp, Bk] float32
        s = jnp.where(seen[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))  # finite: every block walked holds a live key
        corr = jnp.exp(m - m_new)  # [Gp]
        p = jnp.exp(s - m_new[:, None])  # [Gp, Bk]
        v = jnp.where(seen[:, None], v_ref[pl.ds(at, block_k), :], 0)  # [Bk, D]; stale values never count
        pv = _dot(p.astype(v.dtype), v, 0, precision)  # [Gp, D] float32
        return o * corr[:, None] + pv, m_new, l * corr + p.sum(axis=1)

    init = (
        jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), jnp.finfo(jnp.float32).min, jnp.float32),  # not -inf: the combine subtracts maxima
        jnp.zeros((gp,), jnp.float32),
    )
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(live, block_k), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _dot(a: jax.Array, b: jax.Array, b_contracting: int, precision) -> jax.Array:
    """a [M, N] times b ([N, P] when b_contracting is 0, [P, N] when 1) -> [M, P], summed in float32."""
    dims = (((1,), (b_contracting,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    block_k: int | None = None,
    splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """One query per row over the first lengths[r] keys of slot r: q [R, H, D], k/v caches
    [B, K, S, D] (R <= B; row r is slot r), lengths [R] in [0, S] -> [R, H * D] in q's dtype.

    `block_k` keys per iteration and `splits` spans of the context (static; defaults fitted to
    the shapes); `interpret`: run the kernel in Pallas interpret mode (None: unless lowered for a
    GPU, decided per platform at lowering, so that a step lowered for CUDA on a CPU host, as the
    tests do, holds the compiled kernel).
    A length of 0 gives a zero row. Float32 products are exact float32 (no TF32)."""
    r, h, d = q.shape
    _, kv, s, _ = k_cache.shape
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if not supported(d, s):
        raise ValueError(f"ragged attention needs a power-of-two head dim >= {MIN_BLOCK} and a context "
                         f"that is a multiple of {MIN_BLOCK}, got head dim {d} and context {s}")
    if interpret is None:
        run = functools.partial(decode_attention, block_k=block_k, splits=splits)
        return jax.lax.platform_dependent(
            q, k_cache, v_cache, lengths,
            cuda=functools.partial(run, interpret=False), rocm=functools.partial(run, interpret=False),
            default=functools.partial(run, interpret=True),
        )
    g = h // kv
    gp = max(MIN_GROUP, pl.next_power_of_2(g))
    bk = _block_k(s, block_k)
    p = _splits(r, kv, s, bk, splits)
    span = s // p
    qg = jnp.pad(q.reshape(r, kv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [R, K, Gp, D]
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)  # [R]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_k=bk, scale=1.0 / math.sqrt(d), precision=precision)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(r, kv, p),
        in_specs=[
            pl.BlockSpec((None,), lambda i, k, j: (i,)),  # lengths
            pl.BlockSpec((None, None, gp, d), lambda i, k, j: (i, k, 0, 0)),  # q
            pl.BlockSpec((None, None, span, d), lambda i, k, j: (i, k, j, 0)),  # k cache, in place
            pl.BlockSpec((None, None, span, d), lambda i, k, j: (i, k, j, 0)),  # v cache, in place
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, k, j: (j, i, k, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((p, r, kv, gp, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((p, r, kv, gp), jnp.float32),  # m
            jax.ShapeDtypeStruct((p, r, kv, gp), jnp.float32),  # l
        ],
        compiler_params=None if interpret else _gpu_params(),
        interpret=interpret,
        name="tokenwire_ragged_decode_attention",
    )(lengths, qg, k_cache, v_cache)
    # Combine the splits: rescale each to the common max, then normalise once.
    top = jax.lax.optimization_barrier(m.max(axis=0))  # [R, K, Gp]; the barrier as in JAX's own decode op
    w = jnp.exp(m - top[None])  # [P, R, K, Gp]; an empty split has o = l = 0
    denom = (l * w).sum(axis=0)  # [R, K, Gp]
    out = (o * w[..., None]).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]  # [R, K, Gp, D]
    return out[:, :, :g].reshape(r, h * d).astype(q.dtype)


def _gpu_params():
    """Triton launch parameters (a GPU-only import, made only when lowering for a GPU)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array) -> jax.Array:
    """The same attention in plain JAX, in float32, for tests: q [R, H, D], caches [B, K, S, D],
    lengths [R] -> [R, H * D] in q's dtype; zero rows where the length is 0."""
    r, h, d = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    qf = q.astype(jnp.float32).reshape(r, kv, g, d)  # [R, K, G, D]
    kf, vf = k_cache[:r].astype(jnp.float32), v_cache[:r].astype(jnp.float32)  # [R, K, S, D]
    seen = jnp.arange(s)[None, :] < lengths[:, None]  # [R, S]
    scores = jnp.einsum("rkgd,rksd->rkgs", qf, kf, precision="highest") / np.sqrt(d)  # [R, K, G, S]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    scores = jnp.where((lengths > 0)[:, None, None, None], scores, 0.0)  # an idle row: finite, zeroed below
    probs = jnp.where(seen[:, None, None], jax.nn.softmax(scores, axis=-1), 0.0)  # [R, K, G, S]
    vf = jnp.where(seen[:, None, :, None], vf, 0.0)
    out = jnp.einsum("rkgs,rksd->rkgd", probs, vf, precision="highest")  # [R, K, G, D]
    return out.reshape(r, h * d).astype(q.dtype)
