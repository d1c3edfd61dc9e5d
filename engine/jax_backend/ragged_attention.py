"""Paged decode attention for the GPU (issue 41): a Pallas kernel where each row reads only its
own live keys, in place from the paged KV pool, through its block table.

The layout (issue 41's, the same on every backend): per layer, K and V each in one pool
[K, N, P, D] (kv heads, pages, page size, head dim; page 0 the null page). Row r's position p
lives in page `tables[r, p // P]` at offset `p % P`. Program (row r, kv head k, split j) walks
split j's table entries of row r in blocks of whole pages, gathers those pages of kv head k, and
stops at the row's live length, so a step reads sum(lengths) keys (rounded up to blocks) and
copies nothing.

Why our own kernel and not `jax.experimental.pallas.ops.gpu.paged_attention` (JAX 0.10.2),
which takes this very layout and from which the page gather here is learnt:
- It keeps each split's unnormalised partial output in q's dtype, so in bfloat16 every split's
  sums are rounded to 8 bits before they are combined, and the combine itself runs in bfloat16;
  here the partials and the combine are float32 and only the output is rounded.
- It applies no 1/sqrt(D) scale (the caller would scale q, rounding it once more in bfloat16).
- Its split count is fixed (16 by default) and must divide the table width; here the splits are
  fitted to the batch (few rows still fill the GPU, many rows are not cut into needless
  spans) and the table is padded with null pages to a whole number of spans, so any width works.
- Its float32 products use Triton's default dot (TF32 on Ampere and later); here float32 is
  exact, so the engine's float32 path matches its CPU reference.
- It masks scores past a row's length but multiplies their values by a zero weight, so a NaN or
  inf left in a reused page's tail or in the null page would reach the output (0 x NaN); here
  those values are zeroed first.
Kept from the contiguous kernel this one replaces: GQA by one program per kv head, the online
softmax in float32, split-K with a plain-JAX combine, and the block and split defaults.

What holds:
- GQA: one program serves the G = H / K query heads of a kv head, so each key block is read once
  for all of them. G is padded with zero queries to `Gp` (a power of two, at least 16: Triton's
  dot wants 16 rows); the padding's outputs are dropped.
- A key block is `pages_per_block` whole pages (at least 64 keys by default, one page when a
  page is larger): positions inside it past the live length are masked, and their values zeroed.
- Page ids outside [0, N) are clamped to the pool: a Triton load has no bounds check, and a bad
  table must read a wrong page (masked or wrong numbers), never outside the pool's memory.
- An idle row (length 0) reads nothing and gets zeros: finite, and ignored by the caller.
- With a sliding `window` (static), a row sees only its last `window` positions (transformers'
  convention: engine.jax_backend.transformer.in_window); each split's walk starts at the key
  block holding the first of them, so the blocks before are not read, and keys before the window
  inside that block are masked like those past the length.
- With a `softcap` (static, Gemma 2), each scaled score is soft-capped (cap * tanh(s / cap))
  before the mask; without one nothing is added.
- With `sinks` (gpt-oss: a logit per query head that joins the softmax's denominator, with no
  value) the kernel is unchanged: the plain-JAX combine of the splits takes each head's sink as
  one more split with maximum = the sink, denominator 1 and output 0.

Where it runs: `applies()` says whether the decode layers use it (a GPU backend, the Pallas
Triton lowering importable, a head dim and page size it takes). On the CPU the engine keeps its
own paths; there this module runs only in Pallas interpret mode, for tests (`interpret=None`
picks it off a GPU). The GPU lowering was written against JAX 0.10's Triton lowering; nothing
GPU-only is imported until a kernel is lowered for a GPU. The tests lower it for CUDA from the
CPU; Triton's own compile and a run on a GPU have not happened yet (no GPU was lent while it was
written): benchmarks/paged_attention.py is the check to run first where one is.

Shapes: R rows, H query heads, K kv heads, G = H / K, Gp G padded, D head dim, N pages in the
pool, P page size, W table entries per row, S splits, Bp pages per key block, Bk = Bp x P keys.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from engine.jax_backend.backend_profile import profile
from engine.jax_backend.layers import soft_cap

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16
DEFAULT_BLOCK_K = 64  # keys per loop iteration (whole pages: more when a page is larger)
MAX_PAGE = 128  # a key block is at least a page; blocks past 128 keys at D = 128 would likely spill registers (untried)
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


def supported(head_dim: int, page_size: int) -> bool:
    """Whether the kernel takes these shapes: Triton tensors have power-of-two sizes, so D must be
    a power of two >= 16, and a key block of whole pages needs a power-of-two page size (at most
    MAX_PAGE)."""
    return _power_of_two(head_dim) and head_dim >= MIN_BLOCK and _power_of_two(page_size) and page_size <= MAX_PAGE


def applies(head_dim: int, page_size: int) -> bool:
    """The one predicate for "decode attention is the paged Pallas kernel here": `available()`
    and `supported()`. Not under tensor parallelism: a Pallas call is opaque to XLA's
    partitioner (the caller must not use it then)."""
    return available() and supported(head_dim, page_size)


def _pages_per_block(page_size: int, block_k: int | None) -> int:
    """Pages per key block: `block_k` keys (default DEFAULT_BLOCK_K) in whole pages, one page
    when a page holds more."""
    want = DEFAULT_BLOCK_K if block_k is None else block_k
    if not _power_of_two(want) or want < MIN_BLOCK:
        raise ValueError(f"block_k must be a power of two >= {MIN_BLOCK}, got {want}")
    return max(1, want // page_size)


def _splits(rows: int, kv_heads: int, blocks: int, splits: int | None) -> int:
    """Spans the table is cut into: as given, or the fewest powers of two that bring the programs
    to TARGET_PROGRAMS (MAX_SPLITS at most, and no more than the row's key blocks)."""
    if splits is not None:
        if splits < 1:
            raise ValueError(f"splits must be >= 1, got {splits}")
        return splits
    s = 1
    while rows * kv_heads * s < TARGET_PROGRAMS and s < MAX_SPLITS and 2 * s <= blocks:
        s *= 2
    return s


def _kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, pages_per_block: int,
            scale: float, precision, window: int | None, softcap: float | None):
    """One (row, kv head, split): lengths_ref [] (the row's live keys), tables_ref [W' / S] (this
    split's page ids of the row), q_ref [Gp, D], k_ref/v_ref [N, P, D] (kv head k's pool, read
    through the table) -> o_ref [Gp, D] unnormalised float32 sums, m_ref [Gp] the running max,
    l_ref [Gp] the softmax denominator. A split with no live keys runs no iteration: o = 0, l = 0,
    m = float32 min. With a `window`, only the row's last `window` keys count, and the blocks
    wholly before them are skipped. With a `softcap`, the scaled scores are soft-capped before
    the mask."""
    _, page, d = k_ref.shape
    bk = pages_per_block * page
    span = tables_ref.shape[0] * page  # positions in this split
    live = jnp.clip(lengths_ref[()] - pl.program_id(2) * span, 0, span)  # live keys in this split
    q = q_ref[...]  # [Gp, D]
    gp = q.shape[0]
    # The split's first key in the window (0 without one): live and lo are split-relative.
    lo = 0 if window is None else jnp.clip(lengths_ref[()] - window - pl.program_id(2) * span, 0, span)

    def body(i, carry):
        o, m, l = carry  # [Gp, D], [Gp], [Gp] float32
        ids = tables_ref[pl.ds(pl.multiple_of(i * pages_per_block, pages_per_block), pages_per_block)]  # [Bp]
        at = i * bk + jnp.arange(bk)  # [Bk]
        seen = at < live if window is None else (at < live) & (at >= lo)  # [Bk]
        k = k_ref[ids].reshape(bk, d)  # [Bk, D]: the block's pages, gathered
        s = soft_cap(_dot(q, k, 1, precision) * scale, softcap)  # [Gp, Bk] float32
        s = jnp.where(seen[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))  # finite: every block walked holds a live key in the window
        corr = jnp.exp(m - m_new)  # [Gp]
        p = jnp.exp(s - m_new[:, None])  # [Gp, Bk]
        v = jnp.where(seen[:, None], v_ref[ids].reshape(bk, d), 0)  # [Bk, D]; stale values never count
        pv = _dot(p.astype(v.dtype), v, 0, precision)  # [Gp, D] float32
        return o * corr[:, None] + pv, m_new, l * corr + p.sum(axis=1)

    init = (
        jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), jnp.finfo(jnp.float32).min, jnp.float32),  # not -inf: the combine subtracts maxima
        jnp.zeros((gp,), jnp.float32),
    )
    first = 0 if window is None else lo // bk  # no window: the loop as it was, nothing added
    o, m, l = jax.lax.fori_loop(first, pl.cdiv(live, bk), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _dot(a: jax.Array, b: jax.Array, b_contracting: int, precision) -> jax.Array:
    """a [M, N] times b ([N, P] when b_contracting is 0, [P, N] when 1) -> [M, P], summed in float32."""
    dims = (((1,), (b_contracting,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _check(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array) -> None:
    """Shapes the kernel takes, or a ValueError that says which one is wrong."""
    r, h, d = q.shape
    kv, _, page, dk = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if dk != d:
        raise ValueError(f"q's head dim {d} is not the pages' {dk}")
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if tables.ndim != 2 or tables.shape[0] != r or lengths.shape != (r,):
        raise ValueError(f"tables {tables.shape} and lengths {lengths.shape} must be [{r}, W] and [{r}] for {r} rows")
    if not supported(d, page):
        raise ValueError(f"paged attention needs a power-of-two head dim >= {MIN_BLOCK} and a power-of-two page size "
                         f"<= {MAX_PAGE}, got head dim {d} and page size {page}")


def decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    tables: jax.Array,
    lengths: jax.Array,
    *,
    block_k: int | None = None,
    splits: int | None = None,
    interpret: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """One query per row over the first lengths[r] positions of row r's block table: q [R, H, D],
    k/v pages [K, N, P, D], tables [R, W] int32 page ids, lengths [R] in [0, W x P] -> [R, H * D]
    in q's dtype.

    `block_k` keys per iteration (rounded to whole pages) and `splits` spans of the table
    (static; defaults fitted to the shapes); `interpret`: run the kernel in Pallas interpret mode
    (None: unless lowered for a GPU, decided per platform at lowering, so that a step lowered for
    CUDA on a CPU host, as the tests do, holds the compiled kernel).
    A length of 0 gives a zero row. Float32 products are exact float32 (no TF32). `window`
    (static, >= 1): row r sees only positions lengths[r] - window .. lengths[r] - 1 (None: all).
    `softcap` (static, > 0; Gemma 2): each scaled score s becomes softcap * tanh(s / softcap)
    before the mask (None: no operation). `sinks` [H] (gpt-oss): each head's sink logit in its
    softmax's denominator, taken by the combine (None: no operation)."""
    _check(q, k_pages, v_pages, tables, lengths)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be >= 1 position, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"a soft-cap must be > 0, got {softcap}")
    if interpret is None:
        run = functools.partial(decode_attention, block_k=block_k, splits=splits, window=window, softcap=softcap, sinks=sinks)
        return jax.lax.platform_dependent(
            q, k_pages, v_pages, tables, lengths,
            cuda=functools.partial(run, interpret=False), rocm=functools.partial(run, interpret=False),
            default=functools.partial(run, interpret=True),
        )
    r, h, d = q.shape
    kv, n, page, _ = k_pages.shape
    w = tables.shape[1]
    g = h // kv
    gp = max(MIN_GROUP, pl.next_power_of_2(g))
    bp = _pages_per_block(page, block_k)
    s = _splits(r, kv, pl.cdiv(w, bp), splits)
    span_pages = pl.cdiv(pl.cdiv(w, bp), s) * bp  # table entries per split: whole key blocks
    tables = jnp.clip(tables.astype(jnp.int32), 0, n - 1)  # [R, W]; see the module docstring
    tables = jnp.pad(tables, ((0, 0), (0, s * span_pages - w)))  # [R, S x span]: null pages, never live
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, w * page)  # [R]
    qg = jnp.pad(q.reshape(r, kv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [R, K, Gp, D]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, pages_per_block=bp, scale=1.0 / math.sqrt(d), precision=precision, window=window, softcap=softcap
    )
    o, m, l = _split_partials(kernel, lengths, tables, qg, k_pages, v_pages, s, span_pages, interpret)
    if sinks is not None:  # one more split per head: max = its sink, denominator exp(0) = 1, no value
        sink = jnp.pad(sinks.astype(jnp.float32).reshape(kv, g), ((0, 0), (0, gp - g)))  # [K, Gp]
        sink = jnp.broadcast_to(sink, (1, r, kv, gp))  # [1, R, K, Gp]
        o = jnp.concatenate([o, jnp.zeros((1, r, kv, gp, d), jnp.float32)])
        m, l = jnp.concatenate([m, sink]), jnp.concatenate([l, jnp.ones_like(sink)])
    return _combine(o, m, l)[:, :, :g].reshape(r, h * d).astype(q.dtype)


def _split_partials(
    kernel, lengths: jax.Array, tables: jax.Array, qg: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
    s: int, span_pages: int, interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel over the grid (row, kv head, split): lengths [R], tables [R, S x span], qg
    [R, K, Gp, D], k/v pages [K, N, P, D] -> each split's partials o [S, R, K, Gp, D], running
    max m and denominator l [S, R, K, Gp], float32 (`_combine` merges them)."""
    r, kv, gp, d = qg.shape
    n, page = k_pages.shape[1:3]
    return pl.pallas_call(
        kernel,
        grid=(r, kv, s),
        in_specs=[
            pl.BlockSpec((None,), lambda i, k, j: (i,)),  # lengths
            pl.BlockSpec((None, span_pages), lambda i, k, j: (i, j)),  # this split's table entries
            pl.BlockSpec((None, None, gp, d), lambda i, k, j: (i, k, 0, 0)),  # q
            pl.BlockSpec((None, n, page, d), lambda i, k, j: (k, 0, 0, 0)),  # k pool of kv head k, in place
            pl.BlockSpec((None, n, page, d), lambda i, k, j: (k, 0, 0, 0)),  # v pool
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, k, j: (j, i, k, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((s, r, kv, gp, d), jnp.float32),  # o
            jax.ShapeDtypeStruct((s, r, kv, gp), jnp.float32),  # m
            jax.ShapeDtypeStruct((s, r, kv, gp), jnp.float32),  # l
        ],
        compiler_params=None if interpret else _gpu_params(),
        interpret=interpret,
        name="tokenwire_paged_decode_attention",
    )(lengths, tables, qg, k_pages, v_pages)


def _combine(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """The splits' partials o [S, R, K, Gp, D], m and l [S, R, K, Gp] -> the normalised output
    [R, K, Gp, D] float32: rescale each split to the common max, then divide once. An empty
    split (o = l = 0) adds nothing; a row with no key at all gets zeros (with sinks, an idle row
    has only its sinks' split: zeros too)."""
    top = jax.lax.optimization_barrier(m.max(axis=0))  # [R, K, Gp]; the barrier as in JAX's own decode op
    w = jnp.exp(m - top[None])  # [S, R, K, Gp]
    denom = (l * w).sum(axis=0)  # [R, K, Gp]
    return (o * w[..., None]).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]


def _gpu_params():
    """Triton launch parameters (a GPU-only import, made only when lowering for a GPU)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """A pool [K, N, P, D] read through tables [R, W] -> each row's positions contiguous,
    [R, K, W x P, D] (the reference's input, and the contiguous cache a benchmark compares to)."""
    kv, _, page, d = pages.shape
    r, w = tables.shape
    rows = pages[:, tables]  # [K, R, W, P, D]
    return rows.reshape(kv, r, w * page, d).swapaxes(0, 1)


def reference(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array,
    window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The same attention in plain JAX, in float32, for tests: the pages gathered through the
    tables, then softmax attention over each row's first lengths[r] positions (the last `window`
    of them with a window; the scores soft-capped with a `softcap`; each head's sink [H] in its
    denominator with `sinks`). q [R, H, D], pages [K, N, P, D], tables [R, W], lengths [R] ->
    [R, H * D] in q's dtype; zero rows where the length is 0."""
    r, h, d = q.shape
    kv = k_pages.shape[0]
    g = h // kv
    kf = gather_pages(k_pages, tables).astype(jnp.float32)  # [R, K, S, D], S = W x P
    vf = gather_pages(v_pages, tables).astype(jnp.float32)
    s = kf.shape[2]
    qf = q.astype(jnp.float32).reshape(r, kv, g, d)  # [R, K, G, D]
    seen = jnp.arange(s)[None, :] < lengths[:, None]  # [R, S]
    if window is not None:
        seen = seen & (jnp.arange(s)[None, :] >= lengths[:, None] - window)
    scores = soft_cap(jnp.einsum("rkgd,rksd->rkgs", qf, kf, precision="highest") / np.sqrt(d), softcap)  # [R, K, G, S]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    scores = jnp.where((lengths > 0)[:, None, None, None], scores, 0.0)  # an idle row: finite, zeroed below
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)  # [R, K, G, S]
    else:  # the sink as one more score, dropped after the softmax
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, g, 1), (r, kv, g, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(seen[:, None, None], probs, 0.0)  # [R, K, G, S]
    vf = jnp.where(seen[:, None, :, None], vf, 0.0)
    out = jnp.einsum("rkgs,rksd->rkgd", probs, vf, precision="highest")  # [R, K, G, D]
    return out.reshape(r, h * d).astype(q.dtype)
