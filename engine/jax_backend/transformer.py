"""The decoder forward pass in pure JAX, over a paged KV cache updated in place.

The pass is cut into pieces that the caller jits separately, so that a group of layers compiles
once and runs for every group of the same shape (see engine.jax_backend.jax_model for why):
- `prefill_layers`: one chunk of a request's prompt (padded to a bucket of C tokens) at positions
  start..start+C-1 through a group of layers; writes the slot's K/V into the pages its block
  table names and attends, blocked and causal (`chunk_attention`), to the slot's keys up to the
  chunk's end: a whole prompt is one chunk at start 0, a long one several (chunked prefill), a
  prompt with a shared prefix starts after the prefix's pages. Cost grows with start + C, not S.
- `decode_layers`: one token for each of the first R slots through a group of layers; writes each
  active slot's K/V at its position's page and reads only the pages of the first R slots' first
  `attend` positions, so a step costs what the live batch and lengths need, not what the pool holds.
- `mixed_layers`: both at once, a decode step's rows and one prompt chunk of another slot, each
  projection taking all their rows together, so that the weights are read once for both (the
  scheduler's chunk rides along with the step that the streams decoding beside it wait for).
- `logits`: final norm and head -> float32 logits over the ids the tokenizer can produce.
`prefill`, `prefill_chunk` and `decode` chain them into one whole-model call (tests; one-call serving).

What a layer does around the attention (norms, q/k/v and RoPE, the residual adds, the MLP, the
final norm) is its model family's `Block` (engine.jax_backend.families: the dense one of
Llama/Mistral/Qwen, Gemma 3's), built from the shared layer library engine.jax_backend.layers;
this file keeps the KV pages and every attention path. The block is picked from the static
config while tracing, so it adds no operation to a step.

Layers are unrolled over separate per-layer weights and per-layer cache buffers. A `lax.scan` over
stacked weights compiles faster but decodes slower, because XLA:CPU copies each layer's slice of a
stacked array before the matmul reads it; decode is memory-bound, so we take the speed (and cut
compile time by compiling a group of layers once and calling it for every group instead). The
figures behind this file's choices are in docs/benchmarks.md, "Design measurements".

The KV cache is a pool of pages per layer (issue 41): K and V each [K, N, P, D] (kv heads, pages,
page size, head dim), page 0 the null page. A sequence's position p lives in page table[p // P]
at offset p % P of its block table (`KVCache.tables`; JaxModel passes each call its slots'
tables, engine.jax_backend.slot_table). Each pool is written with a scatter on the donated input
(`write_pages`), which XLA performs in place: step time does not grow with the pool at equal live
rows and length (see tests/test_jax_model.py). A write meant for nobody (padding, an idle row)
goes to the null page; positions past a sequence's live length, the null page and a page's
unwritten tail hold stale values that are never attended, because every query masks later
positions. Pages shared by several tables (a prefix hit) are only read: a sequence writes only
positions past what it shares.

The pool is kv-head-major, so a page of one kv head is P x D contiguous values, as the paged
kernels read it. At 32 rows the XLA attention is a large part of a step on XLA:CPU: it gathers
each row's pages into a window, then runs each of the R x K [G, D] x [D, A] products as a
separate small matmul. On the CPU the engine therefore uses a C++ kernel for decode attention
(`kernels=True`, engine.jax_backend.cpu_kernels), which reads each row's pages in place through
its table; `decode_attention` below is the same computation in JAX (the reference the kernel is
tested against, and the path where neither kernel applies). On a GPU the decode layers use a
Pallas kernel (engine.jax_backend.ragged_attention) that likewise reads each row's pages in place
instead of a gathered window. The projections of up to cpu_kernels.PANEL_ROWS
rows (decode steps, short prompt chunks) go to a second kernel when the layer carries
panel-packed copies (`weights.with_panels`, `_project`), which streams the weights at about the
memory's speed where XLA:CPU's GEMM of a few rows did not; and a prefill chunk's attention to a
third (`prefill_layers`), GEMM-shaped where XLA:CPU ran `chunk_attention`'s small blocked
products far below its matmul speed.

Under tensor parallelism (engine.jax_backend.mesh) the same functions run on weights and caches
split over a mesh; XLA's partitioner adds the collectives. The fused projections' layouts
(engine.model_store.checkpoint: q/k/v grouped per kv head, gate/up interleaved) keep every
device's heads and features local, so a layer adds only an all-reduce after o and one after down.

Shapes: B slots, R rows in a decode step (the first R slots), T tokens, S context, N pool pages
(the null page included), P page size, W = ceil(S / P) block table width, A attended positions, V embedding rows, V' head columns (ids the tokenizer can produce,
<= V), E hidden, F ffn, H heads, K kv heads, G = H / K query heads per kv head, D head dim, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import channel_quant, cpu_kernels, families, quantize, ragged_attention
from engine.jax_backend.layers import apply_rope, embed, rms_norm, rope_inv_freq, soft_cap  # noqa: F401 (transformer's names)
from engine.jax_backend.layers import dot as _dot, project as _project  # noqa: F401
from engine.jax_backend.weights import LayerWeights, PackedHead, Weights
from engine.model_store.checkpoint import ModelConfig


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """The KV page pool (one buffer per layer for K and one for V, allocated once; steps take them
    donated and return them written) and, for the whole-model calls below (`prefill`, `decode`),
    every slot's block table. JaxModel keeps its tables on the host and passes each call its own."""

    k: tuple[jax.Array, ...]  # L x [K, N, P, D]
    v: tuple[jax.Array, ...]  # L x [K, N, P, D]
    tables: jax.Array  # [B, W] i32: slot b's position p is in page tables[b, p // P] at offset p % P


def init_pool(
    cfg: ModelConfig, pages: int, page_size: int, dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Zeroed K and V pools of `pages` pages (the null page 0 included), kv-head-major (see the
    module docstring); made in place as `sharding` says (engine.jax_backend.mesh: split on the
    kv-head axis) when one is given. -> (L x [K, N, P, D], L x [K, N, P, D])."""
    shape = (cfg.n_kv_heads, pages, page_size, cfg.head_dim)
    return (
        tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.n_layers)),
        tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.n_layers)),
    )


def table_width(context: int, page_size: int) -> int:
    """W: the pages a block table names for a context of `context` positions."""
    return -(-context // page_size)


def init_cache(
    cfg: ModelConfig, batch: int, context: int, dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None,
    page_size: int = 16,
) -> KVCache:
    """A pool with a whole context of pages for each of `batch` slots, each slot's table naming
    its own pages in order (slot b: pages 1 + b * W .. (b + 1) * W; page 0 is the null page): the
    slot cache the whole-model calls and their tests use, as pages."""
    w = table_width(context, page_size)
    k, v = init_pool(cfg, batch * w + 1, page_size, dtype, sharding)
    return KVCache(k, v, jnp.asarray(1 + np.arange(batch * w, dtype=np.int32).reshape(batch, w)))


def gather_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
    """The positions a table names, in order: pages [K, N, P, D], table [..., n] -> [..., K, n * P, D]."""
    k, _, p, d = pages.shape
    got = jnp.asarray(pages)[:, table]  # [K, ..., n, P, D]
    got = jnp.moveaxis(got, 0, -4)  # [..., K, n, P, D]
    return got.reshape(*got.shape[:-3], table.shape[-1] * p, d)


def write_pages(pages: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array) -> jax.Array:
    """pages [K, N, P, D] with new [T, K, D] written at (page[t], offset[t]) for each t; a write
    meant for nobody goes to the null page 0, whose content no query ever sees (reads are masked by
    position). On the donated pool XLA performs the scatter in place."""
    return pages.at[:, page, offset].set(new.swapaxes(0, 1).astype(pages.dtype))  # [K, T, D] at (:, page, offset)


def chunk_writes(table: jax.Array, positions: jax.Array, new_from: jax.Array, new_to: jax.Array, page_size: int):
    """Where a chunk's keys go: positions [C] through its slot's table [W] -> (page [C], offset
    [C]); positions outside [new_from, new_to) (padding past the prompt, or positions a piece
    recomputes that an earlier one wrote, which may sit in pages other slots share) go to the
    null page."""
    keep = (positions >= new_from) & (positions < new_to)  # [C]
    index = jnp.minimum(positions // page_size, table.shape[0] - 1)
    return jnp.where(keep, table[index], 0), positions % page_size


def in_window(k_pos: jax.Array, q_pos: jax.Array, window: int | None) -> jax.Array:
    """Whether a key at k_pos is seen by a query at q_pos (broadcast together): causal, and with a
    sliding window only the last `window` positions, the query's own included. transformers'
    convention for Mistral, Qwen2 and Gemma (masking_utils.sliding_window_overlay: kv_idx >
    q_idx - sliding_window), i.e. q_pos - k_pos < window. With no window (None) this is the plain
    causal mask, no extra operation."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis of scores [..., A] (float32, masked keys -inf); with `sinks`
    (gpt-oss: a logit per row, broadcast against scores[..., :1]) each sink joins its row's
    denominator and has no value, so a row's weights sum to less than 1. None: jax.nn.softmax,
    no operation added."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    top = jnp.maximum(scores.max(axis=-1, keepdims=True), sinks)  # [..., 1]: finite (the sink is)
    e = jnp.exp(scores - top)  # [..., A]
    return e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sinks - top))


def head_sinks(sinks: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A layer's sinks [H] (query head k * G + i at [k, i]) -> [K, G] float32, as the paths group heads."""
    return sinks.astype(jnp.float32).reshape(cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, cfg: ModelConfig, window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of queries at `q_pos` over keys at positions 0..A-1.

    q [B, T, H, D], k/v [B, A, K, D], q_pos [B, T] -> [B, T, H * D]. A key is seen iff its
    position <= the query's (and within `window` of it: `in_window`), which also hides stale
    positions past a sequence's live length. Every attention path here soft-caps the scaled
    scores before the mask when the config says so (cfg.attn_softcap, Gemma 2: `soft_cap`), and
    takes a layer's attention sinks [H] when it has them (gpt-oss: `sink_softmax`).
    """
    b, t, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, g, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)  # [B, K, G, T, A]
    scores = soft_cap(scores * (1.0 / np.sqrt(d)), cfg.attn_softcap)
    seen = in_window(jnp.arange(k.shape[1])[None, None, :], q_pos[:, :, None], window)  # [B, T, A]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    sink = None if sinks is None else head_sinks(sinks, cfg)[None, :, :, None, None]  # [1, K, G, 1, 1]
    probs = sink_softmax(scores, sink).astype(v.dtype)  # [B, K, G, T, A]
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)  # [B, T, K, G, D]
    return out.reshape(b, t, cfg.n_heads * d)


def chunk_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array, start: jax.Array, cfg: ModelConfig,
    block: int = 256, window: int | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of one slot's chunk of C queries at positions start..start+C-1 over
    the slot's keys, read through its block table (the chunk's own already written): q [C, H, D],
    k/v pools [K, N, P, D], table [W], start [] -> [C, H * D].

    Blocked, with an online softmax (flash-attention style): a `fori_loop` walks key blocks of
    `block` (static, whole pages) positions up to the chunk's end only, so the cost grows with
    start + C, never with the context, and no [T, S] score or mask array is ever built. Each block
    gathers its pages through the table and is one batched product per kv head of the [G * C, D]
    queries with [D, block] keys. A query sees a key iff its position <= the query's (stale
    positions, the null page's and padding are never seen) and, with a `window`, within it
    (`in_window`): then the walk starts at the block of the chunk's first query's first key, so a
    long sequence reads only about window + C keys. With `sinks` [H] each query's running
    maximum starts at its head's sink and its denominator at 1 (the sink's own term)."""
    c, h, d = q.shape
    kv, _, p, _ = k_pages.shape
    g = h // kv
    w = table.shape[0]
    pages = max(1, min(block // p, w))  # pages per key block
    block = pages * p
    qk = (q.astype(jnp.float32) * (1.0 / np.sqrt(d))).astype(q.dtype)
    qk = qk.reshape(c, kv, g, d).transpose(1, 2, 0, 3).reshape(kv, g * c, d)  # [K, G*C, D], rows g-major
    q_pos = start + jnp.tile(jnp.arange(c), g)  # [G*C]
    n_blocks = (start + c + block - 1) // block
    first_block = 0 if window is None else jnp.maximum(start - window + 1, 0) // block

    def body(j, carry):
        m, l, acc = carry  # [K, G*C], [K, G*C], [K, G*C, D] (float32)
        lo = j * block
        first = jnp.minimum(j * pages, w - pages)  # the last block may overlap the one before: mask those keys
        ids = jax.lax.dynamic_slice(table, (first,), (pages,))  # [pages]
        kb, vb = gather_pages(k_pages, ids), gather_pages(v_pages, ids)  # [K, Bk, D]
        scores = soft_cap(jnp.einsum("kqd,kbd->kqb", qk, kb, preferred_element_type=jnp.float32), cfg.attn_softcap)  # [K, G*C, Bk]
        k_pos = first * p + jnp.arange(block)  # [Bk]
        seen = (k_pos[None, :] >= lo) & in_window(k_pos[None, :], q_pos[:, None], window)  # [G*C, Bk]
        scores = jnp.where(seen[None], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))  # no window: finite, key 0 (block 0) is seen by every query
        m_exp = m_new
        if window is not None:  # a query may see no key in the first blocks walked: e and corr 0 there, not NaN
            m_exp = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        e = jnp.exp(scores - m_exp[..., None])  # [K, G*C, Bk]
        corr = jnp.exp(m - m_exp)
        l = l * corr + e.sum(axis=-1)
        pv = jnp.einsum("kqb,kbd->kqd", e.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    init = (
        jnp.full((kv, g * c), -jnp.inf, jnp.float32),
        jnp.zeros((kv, g * c), jnp.float32),
        jnp.zeros((kv, g * c, d), jnp.float32),
    )
    if sinks is not None:  # the sink as a key seen first: max = sink, its term exp(0) = 1, no value
        init = (jnp.repeat(head_sinks(sinks, cfg), c, axis=1), jnp.ones((kv, g * c), jnp.float32), init[2])  # [K, G*C]
    _, l, acc = jax.lax.fori_loop(first_block, n_blocks, body, init)
    out = (acc / l[..., None]).astype(q.dtype)  # [K, G*C, D]
    return out.reshape(kv, g, c, d).transpose(2, 0, 1, 3).reshape(c, h * d)


def decode_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, q_pos: jax.Array, cfg: ModelConfig,
    window: int | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """One query per row over its keys at positions 0..A-1, gathered through its table: q
    [R, H, D], k/v pools [K, N, P, D], tables [R, A / P] (the pages the attended bucket spans),
    q_pos [R] -> [R, H * D]. A key is seen iff its position <= the query's and, with a `window`,
    within it (`in_window`; the gather still spans the bucket: the kernels skip what is outside).
    `sinks` [H]: as in `attention`."""
    r, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    k, v = gather_pages(k_pages, tables), gather_pages(v_pages, tables)  # [R, K, A, D]
    q = q.reshape(r, cfg.n_kv_heads, g, d)  # [R, K, G, D]
    scores = jnp.einsum("rkgd,rkad->rkga", q, k, preferred_element_type=jnp.float32)  # [R, K, G, A]
    scores = soft_cap(scores * (1.0 / np.sqrt(d)), cfg.attn_softcap)
    seen = in_window(jnp.arange(k.shape[2])[None, :], q_pos[:, None], window)  # [R, A]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    sink = None if sinks is None else head_sinks(sinks, cfg)[None, :, :, None]  # [1, K, G, 1]
    probs = sink_softmax(scores, sink).astype(v.dtype)  # [R, K, G, A]
    out = jnp.einsum("rkga,rkad->rkgd", probs, v)  # [R, K, G, D]
    return out.reshape(r, cfg.n_heads * d)


def logits(x: jax.Array, final_norm: jax.Array, lm_head: jax.Array | PackedHead, cfg: ModelConfig) -> jax.Array:
    """x [..., E] -> float32 logits [..., V'] (only ids the tokenizer can produce). A head with its
    panel-packed copy (weights.packed_head) is read as `_project` reads a projection. Gemma 2's
    final soft-cap (cfg.final_softcap) applies to them; None adds nothing."""
    x = families.block(cfg).final_norm(x, final_norm, cfg)
    if isinstance(lm_head, quantize.Int8Matrix):
        out = quantize.matmul(x, lm_head)
    elif isinstance(lm_head, channel_quant.ChannelMatrix):
        out = channel_quant.product(x, lm_head)
    elif isinstance(lm_head, PackedHead):
        out = _project(x, lm_head.w, lm_head.panels).astype(jnp.float32)
    else:
        out = jnp.dot(x, lm_head, preferred_element_type=jnp.float32)
    return soft_cap(out, cfg.final_softcap)


def layer_windows(cfg: ModelConfig, count: int, windows: tuple[int | None, ...] | None) -> tuple[int | None, ...]:
    """The sliding window of each of a group's `count` layers (None: full attention): `windows` as
    a caller gives them (static: JaxModel's one-layer calls pass their layer's), or, for None,
    the config's: `cfg.layer_windows` when the layers differ (Gemma 3's local and global layers;
    then the group must be the whole model) or `cfg.sliding_window` in every layer (Mistral's
    one window for all)."""
    if windows is None and cfg.layer_windows is None:
        return (cfg.sliding_window,) * count
    windows = cfg.layer_windows if windows is None else windows
    if len(windows) != count:
        raise ValueError(f"windows names {len(windows)} layers for a group of {count}")
    return tuple(windows)


def prefill_layers(
    layers: tuple[LayerWeights, ...],
    k_pages: tuple[jax.Array, ...],
    v_pages: tuple[jax.Array, ...],
    x: jax.Array,
    table: jax.Array,
    start: jax.Array,
    new_from: jax.Array,
    new_to: jax.Array,
    cfg: ModelConfig,
    kernels: bool = False,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One chunk of a prompt through a group of layers: x [1, C, E] (the tokens at positions
    start..start+C-1, real ones first, padding after), its slot's block table [W], start [] ->
    x [1, C, E] and the group's pools, with the K/V of positions [new_from, new_to) written into
    the slot's pages (the rest, padding or positions an earlier piece wrote, to the null page:
    `chunk_writes`). The chunk attends to the slot's keys at positions [0, start + C): those
    written by earlier chunks (or a shared prefix's pages) and its own (`chunk_attention`).
    start + C <= W * P. `kernels` (static): the attention by the CPU kernel
    (engine.jax_backend.cpu_kernels.chunk_attention: GEMM-shaped, on the kernels' thread pool;
    ~1.5x the plain-JAX blocks' speed for a 16-token chunk over ~1,800 keys on a loaded machine,
    docs/benchmarks.md) where it applies (float32 and a head dim that is a multiple of 8);
    otherwise, and off, `chunk_attention`, the reference it is tested against. `windows`
    (static): each layer's sliding window (`layer_windows`)."""
    c = x.shape[1]
    use_kernel = _chunk_kernel(kernels, cfg, x.dtype, k_pages[0].dtype)
    positions = start + jnp.arange(c)  # [C]
    page, offset = chunk_writes(table, positions, new_from, new_to, k_pages[0].shape[2])
    ks, vs, block = [], [], families.block(cfg)
    for w, window, k_pool, v_pool in zip(layers, layer_windows(cfg, len(layers), windows), k_pages, v_pages, strict=True):
        q, k, v = block.qkv(block.attention_input(x, w, cfg), w, positions[None], cfg, window)  # [1, C, H|K, D]
        k_pool, v_pool = write_pages(k_pool, page, offset, k[0]), write_pages(v_pool, page, offset, v[0])
        ks.append(k_pool)
        vs.append(v_pool)
        seen = _chunk_seen(q[0], k_pool, v_pool, table, start, cfg, use_kernel, window, w.sinks)  # [C, H*D]
        x = block.attention_residual(x, _project(seen, w.w_o, getattr(w.panels, "o", None))[None], w, cfg)
        x = block.mlp_residual(x, w, cfg)
    return x, tuple(ks), tuple(vs)


def packed_prefill_layers(
    layers: tuple[LayerWeights, ...],
    k_pages: tuple[jax.Array, ...],
    v_pages: tuple[jax.Array, ...],
    x: jax.Array,
    pages: jax.Array,
    positions: jax.Array,
    prompts: jax.Array,
    cfg: ModelConfig,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Several whole prompts packed end to end through a group of layers, in one pass over the
    weights: x [1, T, E], and per token pages, positions, prompts [T] (the page its position
    lives in, through its slot's table: the null page for padding; its position in its prompt;
    its prompt's index) -> x [1, T, E] and the group's pools, each token's K/V written at (its
    page, its position's offset). A token attends to the tokens of its own prompt at positions <=
    its own (and within its layer's window: `windows`, static, as in `prefill_layers`); every
    prompt starts at position 0 here, so nothing is read from the pool."""
    pos = positions[None]  # [1, T]
    offset = positions % k_pages[0].shape[2]  # [T]
    same = prompts[:, None] == prompts[None, :]  # [Tq, Tk]
    masks = {
        window: same & in_window(positions[None, :], positions[:, None], window)  # [Tq, Tk]
        for window in set(layer_windows(cfg, len(layers), windows))
    }
    ks, vs, block = [], [], families.block(cfg)
    for w, window, k_pool, v_pool in zip(layers, layer_windows(cfg, len(layers), windows), k_pages, v_pages, strict=True):
        q, k, v = block.qkv(block.attention_input(x, w, cfg), w, pos, cfg, window)  # [1, T, H|K, D]
        k_pool, v_pool = write_pages(k_pool, pages, offset, k[0]), write_pages(v_pool, pages, offset, v[0])
        ks.append(k_pool)
        vs.append(v_pool)
        out = _masked_attention(q[0], k[0], v[0], masks[window], cfg, w.sinks)  # [T, H*D]
        x = block.attention_residual(x, _project(out, w.w_o, getattr(w.panels, "o", None))[None], w, cfg)
        x = block.mlp_residual(x, w, cfg)
    return x, tuple(ks), tuple(vs)


def _masked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array, cfg: ModelConfig, sinks: jax.Array | None = None
) -> jax.Array:
    """GQA attention of q [T, H, D] over k/v [T, K, D] where seen [T, T] (query, key) -> [T, H * D].
    Every query sees at least itself. `sinks` [H]: as in `attention`."""
    t, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(t, cfg.n_kv_heads, g, d)  # [T, K, G, D]
    scores = jnp.einsum("tkgd,skd->kgts", q, k, preferred_element_type=jnp.float32) * (1.0 / np.sqrt(d))
    scores = jnp.where(seen[None, None], soft_cap(scores, cfg.attn_softcap), -jnp.inf)  # [K, G, T, T]
    sink = None if sinks is None else head_sinks(sinks, cfg)[:, :, None, None]  # [K, G, 1, 1]
    probs = sink_softmax(scores, sink).astype(v.dtype)
    return jnp.einsum("kgts,skd->tkgd", probs, v).reshape(t, cfg.n_heads * d)


def _decode_writer(tables: jax.Array, positions: jax.Array, active: jax.Array, page_size: int):
    """Writes of one K or V row per decode row at its position, through its table [R, W]; an
    inactive row writes to the null page (whatever its position says), so a slot between prefill
    and its first decode, or one filling, keeps what it holds."""
    r, w = tables.shape
    index = jnp.minimum(positions // page_size, w - 1)  # [R]
    page = jnp.where(active, tables[jnp.arange(r), index], 0)  # [R]
    offset = positions % page_size  # [R]

    def write(pool: jax.Array, new: jax.Array) -> jax.Array:  # new [R, K, D] -> [K, N, P, D]
        return write_pages(pool, page, offset, new)

    return write


def _decode_seen(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array, positions: jax.Array, active: jax.Array,
    cfg: ModelConfig, attend: int, kernels: bool, ragged: bool, window: int | None, sinks: jax.Array | None = None,
) -> jax.Array:
    """The decode rows' attention, q [R, H, D] -> [R, H * D], by the kernel `decode_layers` names,
    over the last `window` positions (None: all); the kernels read each row's pages in place (and
    only those its window reaches), the XLA path gathers the pages of `attend`; each takes the
    layer's attention sinks [H] where it has them (gpt-oss)."""
    if kernels:
        return cpu_kernels.decode_attention(q, k_pool, v_pool, tables, positions, window, cfg.attn_softcap, sinks)
    if ragged:  # an inactive row reads no key (length 0)
        lengths = jnp.where(active, positions + 1, 0)  # [R]
        return ragged_attention.decode_attention(
            q, k_pool, v_pool, tables, lengths, window=window, softcap=cfg.attn_softcap, sinks=sinks
        )
    pages = table_width(attend, k_pool.shape[2])
    return decode_attention(q, k_pool, v_pool, tables[:, :pages], positions, cfg, window, sinks)


def _chunk_kernel(kernels: bool, cfg: ModelConfig, dtype: jnp.dtype, cache_dtype: jnp.dtype) -> bool:
    """Whether a chunk's attention goes to the CPU kernel (see `prefill_layers`)."""
    return kernels and cpu_kernels.chunk_attention_applies(cfg.head_dim) and dtype == jnp.float32 and cache_dtype == jnp.float32


def _chunk_seen(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, start: jax.Array, cfg: ModelConfig,
    use_kernel: bool, window: int | None, sinks: jax.Array | None = None,
) -> jax.Array:
    """A chunk's attention over its slot's pages within `window` (None: all), q [C, H, D] -> [C, H * D];
    `sinks` [H]: the layer's attention sinks, if any."""
    if use_kernel:
        return cpu_kernels.chunk_attention(q, k_pool, v_pool, table, start, window, cfg.attn_softcap, sinks)
    return chunk_attention(q, k_pool, v_pool, table, start, cfg, window=window, sinks=sinks)


def _ragged(ragged: bool | None, cfg: ModelConfig, page_size: int) -> bool:
    """`ragged` as given, or (None) whether the Pallas kernel applies to this head dim and page size."""
    return ragged_attention.applies(cfg.head_dim, page_size) if ragged is None else ragged


def decode_layers(
    layers: tuple[LayerWeights, ...],
    k_pages: tuple[jax.Array, ...],
    v_pages: tuple[jax.Array, ...],
    x: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    cfg: ModelConfig,
    attend: int,
    kernels: bool = False,
    ragged: bool | None = None,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """x [R, 1, E], tables [R, W], positions/active [R] for slots 0..R-1 -> x [R, 1, E] and the
    group's pools. `attend` (static) > every active position. `kernels` (static): attention by
    the CPU kernel (engine.jax_backend.cpu_kernels), which reads each row's pages in place and
    ignores `attend`. `ragged` (static): otherwise, attention by the Pallas kernel
    (engine.jax_backend.ragged_attention), which also reads each row's pages in place and ignores
    `attend`; None: where it `applies()` (a GPU backend and shapes it takes). Off, the XLA
    attention over the pages of `attend` positions. Inactive rows compute garbage and write it to
    the null page (`_decode_writer`). `windows` (static): as in `prefill_layers`."""
    ragged = _ragged(ragged, cfg, k_pages[0].shape[2])
    write = _decode_writer(tables, positions, active, k_pages[0].shape[2])
    pos = positions[:, None]  # [R, 1]
    ks, vs, block = [], [], families.block(cfg)
    for w, window, k_pool, v_pool in zip(layers, layer_windows(cfg, len(layers), windows), k_pages, v_pages, strict=True):
        q, k, v = block.qkv(block.attention_input(x, w, cfg), w, pos, cfg, window)  # [R, 1, H|K, D]
        k_pool, v_pool = write(k_pool, k[:, 0]), write(v_pool, v[:, 0])
        ks.append(k_pool)
        vs.append(v_pool)
        seen = _decode_seen(q[:, 0], k_pool, v_pool, tables, positions, active, cfg, attend, kernels, ragged, window, w.sinks)  # [R, H*D]
        x = block.attention_residual(x, _project(seen, w.w_o, getattr(w.panels, "o", None))[:, None], w, cfg)
        x = block.mlp_residual(x, w, cfg)
    return x, tuple(ks), tuple(vs)


def mixed_layers(
    layers: tuple[LayerWeights, ...],
    k_pages: tuple[jax.Array, ...],
    v_pages: tuple[jax.Array, ...],
    x: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    chunk: jax.Array,
    table: jax.Array,
    start: jax.Array,
    end: jax.Array,
    cfg: ModelConfig,
    attend: int,
    kernels: bool = False,
    ragged: bool | None = None,
    windows: tuple[int | None, ...] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A decode step and a prompt chunk in one pass over the weights: `decode_layers` for x
    [R, 1, E] (tables [R, W], positions, active [R]) and `prefill_layers` for chunk [C, E] at
    positions start..start+C-1 of another slot (table [W]; its real tokens end at `end`) -> x
    [R, 1, E] and the pools (the chunk's own hidden states are not returned: a chunk that rides
    along never samples).

    Every projection takes the R + C rows together, so the weights are read once for both
    (on the CPU, by the panel kernel, each row's result the same bits as alone); the writes and
    the attention are each part's own (an inactive row writes to the null page, which no
    query sees, so the order of the two writes does not matter). `windows` (static): as in
    `prefill_layers`."""
    r, c = x.shape[0], chunk.shape[0]
    p = k_pages[0].shape[2]
    ragged = _ragged(ragged, cfg, p)
    write = _decode_writer(tables, positions, active, p)
    use_kernel = _chunk_kernel(kernels, cfg, chunk.dtype, k_pages[0].dtype)
    chunk_pos = start + jnp.arange(c)  # [C]
    page, offset = chunk_writes(table, chunk_pos, start, end, p)
    h = jnp.concatenate([x[:, 0], chunk])[None]  # [1, R + C, E]: the decode rows, then the chunk's
    pos = jnp.concatenate([positions, chunk_pos])[None]  # [1, R + C]
    ks, vs, block = [], [], families.block(cfg)
    for w, window, k_pool, v_pool in zip(layers, layer_windows(cfg, len(layers), windows), k_pages, v_pages, strict=True):
        q, k, v = block.qkv(block.attention_input(h, w, cfg), w, pos, cfg, window)  # [1, R + C, H|K, D]
        k_pool, v_pool = write(k_pool, k[0, :r]), write(v_pool, v[0, :r])
        k_pool, v_pool = write_pages(k_pool, page, offset, k[0, r:]), write_pages(v_pool, page, offset, v[0, r:])
        ks.append(k_pool)
        vs.append(v_pool)
        seen = jnp.concatenate([
            _decode_seen(q[0, :r], k_pool, v_pool, tables, positions, active, cfg, attend, kernels, ragged, window, w.sinks),  # [R, H*D]
            _chunk_seen(q[0, r:], k_pool, v_pool, table, start, cfg, use_kernel, window, w.sinks),  # [C, H*D]
        ])[None]
        h = block.attention_residual(h, _project(seen, w.w_o, getattr(w.panels, "o", None)), w, cfg)
        h = block.mlp_residual(h, w, cfg)
    return h[0, :r, None], tuple(ks), tuple(vs)


def prefill(
    weights: Weights, cache: KVCache, tokens: jax.Array, length: jax.Array, slot: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """The whole model in one call: tokens [T] (real ones first, padding after), length [] in
    [1, T], slot [] -> logits [V'] after the last real token, cache."""
    return prefill_chunk(weights, cache, tokens, length, slot, jnp.int32(0), cfg)


def prefill_chunk(
    weights: Weights, cache: KVCache, tokens: jax.Array, length: jax.Array, slot: jax.Array, start: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, KVCache]:
    """The whole model over one chunk: tokens [C] at positions start..start+C-1 (real ones first,
    padding after), length [] in [1, C] real ones, slot [], start [] (positions [0, start) of the
    slot already written by earlier chunks) -> logits [V'] after the last real token, cache."""
    x = embed(weights.embed, tokens)[None]  # [1, C, E]
    table = cache.tables[slot]  # [W]
    x, ks, vs = prefill_layers(weights.layers, cache.k, cache.v, x, table, start, start, start + length, cfg)
    last = jax.lax.dynamic_index_in_dim(x[0], length - 1, keepdims=False)  # [E]
    return logits(last, weights.final_norm, weights.lm_head, cfg), KVCache(ks, vs, cache.tables)


def decode(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    cfg: ModelConfig,
    attend: int,
    kernels: bool = False,
    ragged: bool | None = None,
) -> tuple[jax.Array, KVCache]:
    """The whole model in one call: tokens/positions/active [R] for slots 0..R-1 (R <= B) ->
    logits [R, V'], cache. `attend` (static) > every active position; `kernels` and `ragged` as
    in `decode_layers`."""
    x = embed(weights.embed, tokens)[:, None]  # [R, 1, E]
    tables = cache.tables[: tokens.shape[0]]  # [R, W]
    x, ks, vs = decode_layers(weights.layers, cache.k, cache.v, x, tables, positions, active, cfg, attend, kernels, ragged)
    return logits(x[:, 0], weights.final_norm, weights.lm_head, cfg), KVCache(ks, vs, cache.tables)
