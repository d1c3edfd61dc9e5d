"""The decoder forward pass in pure JAX, over a slot-based KV cache updated in place.

The pass is cut into pieces that the caller jits separately, so that a group of layers compiles
once and runs for every group of the same shape (see engine.jax_backend.jax_model for why):
- `prefill_layers`: one chunk of a request's prompt (padded to a bucket of C tokens) at positions
  start..start+C-1 through a group of layers; writes the slot's K/V there and attends, blocked
  and causal (`chunk_attention`), to the slot's keys up to the chunk's end: a whole prompt is one
  chunk at start 0, a long one several (chunked prefill). Cost grows with start + C, not with S.
- `decode_layers`: one token for each of the first R slots through a group of layers; writes each
  active slot's K/V at its position and reads only the first R slots and the first `attend`
  positions, so a step costs what the live batch and lengths need, not what the cache could hold.
- `mixed_layers`: both at once, a decode step's rows and one prompt chunk of another slot, each
  projection taking all their rows together, so that the weights are read once for both (the
  scheduler's chunk rides along with the step that the streams decoding beside it wait for).
- `logits`: final norm and head -> float32 logits over the ids the tokenizer can produce.
`prefill`, `prefill_chunk` and `decode` chain them into one whole-model call (tests; one-call serving).

Layers are unrolled over separate per-layer weights and per-layer cache buffers. A `lax.scan` over
stacked weights compiles faster but decodes slower, because XLA:CPU copies each layer's slice of a
stacked array before the matmul reads it; decode is memory-bound, so we take the speed (and cut
compile time by compiling a group of layers once and calling it for every group instead). The
figures behind this file's choices are in docs/benchmarks.md, "Design measurements". Each cache buffer is written with
a scatter/dynamic-update-slice on the donated input, which XLA performs in place: step time does
not grow with the context or the slot count at equal live rows and length (see
tests/test_jax_model.py). Positions past a slot's live length hold stale values; they are never
attended because every query masks later positions.

The cache is kv-head-major, [B, K, S, D], so a decode step's read of its rows and attended
positions feeds the batched attention products without a transpose (with [B, S, K, D] XLA
transposed that slice in every layer). Even so, at 32 rows the XLA attention is a large part of a
step on XLA:CPU: it copies the sliced window, then runs each of the R x K [G, D] x [D, A] products
as a separate small matmul. On the CPU the engine therefore uses
a C++ kernel for decode attention (`kernels=True`, engine.jax_backend.cpu_kernels), which reads each row's
live keys in place; `decode_attention` below is the same computation in JAX (the reference the
kernel is tested against, and the path where neither kernel applies). On a GPU the decode
layers use a Pallas kernel (engine.jax_backend.ragged_attention) that likewise reads each row's
live keys in place instead of a bucketed window. The projections of up to cpu_kernels.PANEL_ROWS
rows (decode steps, short prompt chunks) go to a second kernel when the layer carries
panel-packed copies (`weights.with_panels`, `_project`), which streams the weights at about the
memory's speed where XLA:CPU's GEMM of a few rows did not; and a prefill chunk's attention to a
third (`prefill_layers`), GEMM-shaped where XLA:CPU ran `chunk_attention`'s small blocked
products far below its matmul speed.

Under tensor parallelism (engine.jax_backend.mesh) the same functions run on weights and caches
split over a mesh; XLA's partitioner adds the collectives. The fused projections' layouts
(engine.model_store.checkpoint: q/k/v grouped per kv head, gate/up interleaved) keep every
device's heads and features local, so a layer adds only an all-reduce after o and one after down.

Shapes: B slots, R rows in a decode step (the first R slots), T tokens, S cache positions (max
context), A attended positions, V embedding rows, V' head columns (ids the tokenizer can produce,
<= V), E hidden, F ffn, H heads, K kv heads, G = H / K query heads per kv head, D head dim, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import cpu_kernels, quantize, ragged_attention
from engine.jax_backend.weights import LayerWeights, PackedHead, Weights
from engine.model_store.checkpoint import ModelConfig, RopeScaling


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Every slot's keys and values, one buffer per layer, allocated once; steps take it donated
    and return it updated."""

    k: tuple[jax.Array, ...]  # L x [B, K, S, D]
    v: tuple[jax.Array, ...]  # L x [B, K, S, D]


def init_cache(
    cfg: ModelConfig, batch: int, context: int, dtype: jnp.dtype, sharding: jax.sharding.Sharding | None = None
) -> KVCache:
    """Zeroed buffers, kv-head-major (see the module docstring); made in place as `sharding`
    says (engine.jax_backend.mesh: split on the kv-head axis) when one is given."""
    shape = (batch, cfg.n_kv_heads, context, cfg.head_dim)
    return KVCache(
        tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.n_layers)),
        tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(cfg.n_layers)),
    )


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies [D/2], with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    s = cfg.rope_scaling
    if s is None:
        return inv.astype(np.float32)
    if s.kind == "linear":
        return (inv / s.factor).astype(np.float32)
    return _llama3_inv_freq(inv, s).astype(np.float32)


def _llama3_inv_freq(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, the band between blended."""
    wavelen = 2 * np.pi / inv  # [D/2]
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back (as transformers does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate halves (the transformers layout): x [B, T, heads, D], positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, heads, D/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Causal GQA attention of queries at `q_pos` over keys at positions 0..A-1.

    q [B, T, H, D], k/v [B, A, K, D], q_pos [B, T] -> [B, T, H * D]. A key is seen iff its
    position <= the query's, which also hides stale cache rows past a slot's live length.
    """
    b, t, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, g, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)  # [B, K, G, T, A]
    scores = scores * (1.0 / np.sqrt(d))
    seen = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # [B, T, A]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, A]
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)  # [B, T, K, G, D]
    return out.reshape(b, t, cfg.n_heads * d)


def chunk_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slot: jax.Array, start: jax.Array, cfg: ModelConfig,
    block: int = 256,
) -> jax.Array:
    """Causal GQA attention of one slot's chunk of C queries at positions start..start+C-1 over
    the slot's cached keys (the chunk's own already written): q [C, H, D], k/v caches
    [B, K, S, D], slot [], start [] -> [C, H * D].

    Blocked, with an online softmax (flash-attention style): a `fori_loop` walks key blocks of
    `block` (static) positions up to the chunk's end only, so the cost grows with start + C,
    never with the context S, and no [T, S] score or mask array is ever built. Each block is
    one batched product per kv head of the [G * C, D] queries with [D, block] keys, read in place
    from the cache. A query sees a key iff its position <= the query's (stale or padding cache
    rows past the chunk are never seen)."""
    c, h, d = q.shape
    kv = cfg.n_kv_heads
    g = h // kv
    s = k_cache.shape[2]
    block = min(block, s)
    qk = (q.astype(jnp.float32) * (1.0 / np.sqrt(d))).astype(q.dtype)
    qk = qk.reshape(c, kv, g, d).transpose(1, 2, 0, 3).reshape(kv, g * c, d)  # [K, G*C, D], rows g-major
    q_pos = start + jnp.tile(jnp.arange(c), g)  # [G*C]
    n_blocks = (start + c + block - 1) // block

    def body(j, carry):
        m, l, acc = carry  # [K, G*C], [K, G*C], [K, G*C, D] (float32)
        lo = j * block
        at = jnp.minimum(lo, s - block)  # the last block may overlap the one before: mask those keys
        kb = jax.lax.dynamic_slice(k_cache, (slot, 0, at, 0), (1, kv, block, d))[0]  # [K, Bk, D]
        vb = jax.lax.dynamic_slice(v_cache, (slot, 0, at, 0), (1, kv, block, d))[0]
        scores = jnp.einsum("kqd,kbd->kqb", qk, kb, preferred_element_type=jnp.float32)  # [K, G*C, Bk]
        k_pos = at + jnp.arange(block)  # [Bk]
        seen = (k_pos[None, :] >= lo) & (k_pos[None, :] <= q_pos[:, None])  # [G*C, Bk]
        scores = jnp.where(seen[None], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))  # finite: key 0 (block 0) is seen by every query
        p = jnp.exp(scores - m_new[..., None])  # [K, G*C, Bk]
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        pv = jnp.einsum("kqb,kbd->kqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    init = (
        jnp.full((kv, g * c), -jnp.inf, jnp.float32),
        jnp.zeros((kv, g * c), jnp.float32),
        jnp.zeros((kv, g * c, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = (acc / l[..., None]).astype(q.dtype)  # [K, G*C, D]
    return out.reshape(kv, g, c, d).transpose(2, 0, 1, 3).reshape(c, h * d)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """One query per row over cached keys at positions 0..A-1: q [R, H, D], k/v [R, K, A, D],
    q_pos [R] -> [R, H * D]. A key is seen iff its position <= the query's."""
    r, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(r, cfg.n_kv_heads, g, d)  # [R, K, G, D]
    scores = jnp.einsum("rkgd,rkad->rkga", q, k, preferred_element_type=jnp.float32)  # [R, K, G, A]
    scores = scores * (1.0 / np.sqrt(d))
    seen = jnp.arange(k.shape[2])[None, :] <= q_pos[:, None]  # [R, A]
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [R, K, G, A]
    out = jnp.einsum("rkga,rkad->rkgd", probs, v)  # [R, K, G, D]
    return out.reshape(r, cfg.n_heads * d)


def _project(x: jax.Array, w: jax.Array, panels: jax.Array | None) -> jax.Array:
    """x [..., in] @ w [in, out]; by the CPU kernel on the panel-packed copy when there is one and
    x has at most cpu_kernels.PANEL_ROWS rows (decode steps, short prompt chunks; longer chunks
    use w and XLA's GEMM). The row count is static: the choice is made while tracing."""
    if panels is not None and x.size // x.shape[-1] <= cpu_kernels.PANEL_ROWS:
        return cpu_kernels.panel_matmul(x, panels, w.shape[1]).astype(x.dtype)
    return _dot(x, w)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w, its sums kept in float32 until the end: one device rounds once, as a plain bf16
    product does; under tensor parallelism (o, down: a sum split over devices) the partial sums
    are added in float32 before the one rounding, so bf16 results stay close to one device's.
    An int8 weight (engine.jax_backend.quantize, `--weights int8`) goes to its own product."""
    if isinstance(w, quantize.Int8Matrix):
        return quantize.matmul(x, w).astype(x.dtype)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """Project, optionally bias and q/k-norm, then rotate: x [B, T, E] -> q [B,T,H,D], k/v [B,T,K,D]."""
    b, t, _ = x.shape
    h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = h // kv
    qkv = _project(x, w.w_qkv, getattr(w.panels, "qkv", None))  # [B, T, K * (G + 2) * D]
    if cfg.qkv_bias:
        qkv = qkv + w.b_qkv
    qkv = qkv.reshape(b, t, kv, g + 2, d)  # per kv head: its G query heads, its key, its value
    q = qkv[:, :, :, :g].reshape(b, t, h, d)  # [B, T, H, D]; head k * G + i uses kv head k
    k = qkv[:, :, :, g]  # [B, T, K, D]
    v = qkv[:, :, :, g + 1]  # [B, T, K, D]
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    gate_up = _project(x, w.w_gate_up, getattr(w.panels, "gate_up", None))  # [B, T, 2F], interleaved
    gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)  # [B, T, F, 2]
    gate, up = gate_up[..., 0], gate_up[..., 1]  # [B, T, F] each
    return _project(jax.nn.silu(gate) * up, w.w_down, getattr(w.panels, "down", None))  # [B, T, E]


def logits(x: jax.Array, final_norm: jax.Array, lm_head: jax.Array | PackedHead, cfg: ModelConfig) -> jax.Array:
    """x [..., E] -> float32 logits [..., V'] (only ids the tokenizer can produce). A head with its
    panel-packed copy (weights.packed_head) is read as `_project` reads a projection."""
    x = rms_norm(x, final_norm, cfg.rms_eps)
    if isinstance(lm_head, quantize.Int8Matrix):
        return quantize.matmul(x, lm_head)
    if isinstance(lm_head, PackedHead):
        return _project(x, lm_head.w, lm_head.panels).astype(jnp.float32)
    return jnp.dot(x, lm_head, preferred_element_type=jnp.float32)


def embed(table: jax.Array | quantize.Int8Matrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` [...] of the embedding [V, E] -> [..., E] (float32 rows of an int8 one)."""
    if isinstance(table, quantize.Int8Matrix):
        return quantize.embed(table, tokens)
    return table[tokens]


def prefill_layers(
    layers: tuple[LayerWeights, ...],
    k_caches: tuple[jax.Array, ...],
    v_caches: tuple[jax.Array, ...],
    x: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    cfg: ModelConfig,
    kernels: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One chunk of a prompt through a group of layers: x [1, C, E] (the tokens at positions
    start..start+C-1, real ones first, padding after), slot [], start [] -> x [1, C, E] and the
    group's caches, with the slot's K/V written for positions [start, start + C). The chunk
    attends to the slot's keys at positions [0, start + C): those written by earlier chunks and
    its own (`chunk_attention`). start + C <= S. Positions written past the prompt are padding,
    overwritten by the next chunk or by decode before any query can see them. `kernels` (static):
    the attention by the CPU kernel (engine.jax_backend.cpu_kernels.chunk_attention: GEMM-shaped,
    on the kernels' thread pool; ~1.5x the plain-JAX blocks' speed for a 16-token chunk over ~1,800
    keys on a loaded machine, docs/benchmarks.md) where it applies (float32 and a head dim that is
    a multiple of 8); otherwise, and off, `chunk_attention`, the reference it is tested against."""
    c = x.shape[1]
    use_kernel = _chunk_kernel(kernels, cfg, x.dtype, k_caches[0].dtype)
    positions = (start + jnp.arange(c))[None, :]  # [1, C]
    at = (slot, 0, start, 0)
    ks, vs = [], []
    for w, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
        q, k, v = _qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), w, positions, cfg)  # [1, C, H|K, D]
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.swapaxes(1, 2).astype(k_cache.dtype), at)  # [1, K, C, D]
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.swapaxes(1, 2).astype(v_cache.dtype), at)
        ks.append(k_cache)
        vs.append(v_cache)
        seen = _chunk_seen(q[0], k_cache, v_cache, slot, start, cfg, use_kernel)  # [C, H*D]
        x = x + _project(seen, w.w_o, getattr(w.panels, "o", None))[None]
        x = x + _mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w)
    return x, tuple(ks), tuple(vs)


def packed_prefill_layers(
    layers: tuple[LayerWeights, ...],
    k_caches: tuple[jax.Array, ...],
    v_caches: tuple[jax.Array, ...],
    x: jax.Array,
    slots: jax.Array,
    positions: jax.Array,
    prompts: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Several whole prompts packed end to end through a group of layers, in one pass over the
    weights: x [1, T, E], and per token slots, positions, prompts [T] (its slot, its position in
    its prompt, its prompt's index) -> x [1, T, E] and the group's caches, each token's K/V
    written at (its slot, its position). A token attends to the tokens of its own prompt at
    positions <= its own; every prompt starts at position 0 here, so nothing is read from the
    cache. Padding after the last prompt continues that prompt's positions in its slot: places
    past a prompt, which decode overwrites before any query can see them (as `prefill_layers`)."""
    pos = positions[None]  # [1, T]
    seen = (prompts[:, None] == prompts[None, :]) & (positions[None, :] <= positions[:, None])  # [Tq, Tk]
    ks, vs = [], []
    for w, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
        q, k, v = _qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), w, pos, cfg)  # [1, T, H|K, D]
        k_cache = k_cache.at[slots, :, positions].set(k[0].astype(k_cache.dtype))  # [T, K, D] at (slot, :, position)
        v_cache = v_cache.at[slots, :, positions].set(v[0].astype(v_cache.dtype))
        ks.append(k_cache)
        vs.append(v_cache)
        out = _masked_attention(q[0], k[0], v[0], seen, cfg)  # [T, H*D]
        x = x + _project(out, w.w_o, getattr(w.panels, "o", None))[None]
        x = x + _mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w)
    return x, tuple(ks), tuple(vs)


def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array, cfg: ModelConfig) -> jax.Array:
    """GQA attention of q [T, H, D] over k/v [T, K, D] where seen [T, T] (query, key) -> [T, H * D].
    Every query sees at least itself."""
    t, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(t, cfg.n_kv_heads, g, d)  # [T, K, G, D]
    scores = jnp.einsum("tkgd,skd->kgts", q, k, preferred_element_type=jnp.float32) * (1.0 / np.sqrt(d))
    scores = jnp.where(seen[None, None], scores, -jnp.inf)  # [K, G, T, T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("kgts,skd->tkgd", probs, v).reshape(t, cfg.n_heads * d)


def _decode_writer(positions: jax.Array, active: jax.Array, context: int):
    """Writes of one K or V row per decode row into its slot's cache at its position; an inactive
    row writes nothing (see `decode_layers`). Its index is past the cache, and the scatter drops
    it: reading back what the slot holds, to write it again, put 2 x L small gathers at the start
    of every step (on XLA:CPU ~0.15-0.2 ms of a batch-1 step, docs/benchmarks.md)."""
    r = positions.shape[0]
    at = jnp.where(active, jnp.minimum(positions, context - 1), context)  # [R]; context: dropped
    rows = jnp.arange(r)  # [R]

    def write(cache: jax.Array, new: jax.Array) -> jax.Array:  # new [R, K, D] -> [B, K, S, D]
        return cache.at[rows, :, at].set(new.astype(cache.dtype), mode="drop")

    return write


def _decode_seen(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, active: jax.Array, cfg: ModelConfig,
    attend: int, kernels: bool, ragged: bool,
) -> jax.Array:
    """The decode rows' attention, q [R, H, D] -> [R, H * D], by the kernel `decode_layers` names."""
    r = q.shape[0]
    if kernels:
        return cpu_kernels.decode_attention(q, k_cache, v_cache, positions)
    if ragged:  # an inactive row reads no key (length 0)
        return ragged_attention.decode_attention(q, k_cache, v_cache, jnp.where(active, positions + 1, 0))
    return decode_attention(q, k_cache[:r, :, :attend], v_cache[:r, :, :attend], positions, cfg)


def _chunk_kernel(kernels: bool, cfg: ModelConfig, dtype: jnp.dtype, cache_dtype: jnp.dtype) -> bool:
    """Whether a chunk's attention goes to the CPU kernel (see `prefill_layers`)."""
    return kernels and cpu_kernels.chunk_attention_applies(cfg.head_dim) and dtype == jnp.float32 and cache_dtype == jnp.float32


def _chunk_seen(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slot: jax.Array, start: jax.Array, cfg: ModelConfig,
    use_kernel: bool,
) -> jax.Array:
    """A chunk's attention over its slot's cache, q [C, H, D] -> [C, H * D]."""
    if use_kernel:
        return cpu_kernels.chunk_attention(q, k_cache, v_cache, slot, start)
    return chunk_attention(q, k_cache, v_cache, slot, start, cfg)


def decode_layers(
    layers: tuple[LayerWeights, ...],
    k_caches: tuple[jax.Array, ...],
    v_caches: tuple[jax.Array, ...],
    x: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    cfg: ModelConfig,
    attend: int,
    kernels: bool = False,
    ragged: bool | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """x [R, 1, E], positions/active [R] for slots 0..R-1 -> x [R, 1, E] and the group's caches.
    `attend` (static) > every active position. `kernels` (static): attention by the CPU kernel
    (engine.jax_backend.cpu_kernels), which reads each row's live keys in place and ignores `attend`.
    `ragged` (static): otherwise, attention by the Pallas kernel (engine.jax_backend.ragged_attention),
    which also reads each row's live keys in place and ignores `attend`; None: where it
    `applies()` (a GPU backend and shapes it takes). Off, the XLA attention over `attend` positions.

    Inactive rows compute garbage and write back what their slot already holds, so a slot between
    prefill and its first decode keeps its prompt intact. (Dropping an out-of-range write instead,
    as with the [B, S, K, D] layout, corrupted position 2 of inactive rows on XLA:CPU with this
    layout's scatter.) The caches keep all B slots; only the first R are read or written.
    """
    if ragged is None:
        ragged = ragged_attention.applies(cfg.head_dim, k_caches[0].shape[2])
    write = _decode_writer(positions, active, k_caches[0].shape[2])
    pos = positions[:, None]  # [R, 1]
    ks, vs = [], []
    for w, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
        q, k, v = _qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), w, pos, cfg)  # [R, 1, H|K, D]
        k_cache, v_cache = write(k_cache, k[:, 0]), write(v_cache, v[:, 0])
        ks.append(k_cache)
        vs.append(v_cache)
        seen = _decode_seen(q[:, 0], k_cache, v_cache, positions, active, cfg, attend, kernels, ragged)  # [R, H*D]
        x = x + _project(seen, w.w_o, getattr(w.panels, "o", None))[:, None]
        x = x + _mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w)
    return x, tuple(ks), tuple(vs)


def mixed_layers(
    layers: tuple[LayerWeights, ...],
    k_caches: tuple[jax.Array, ...],
    v_caches: tuple[jax.Array, ...],
    x: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    chunk: jax.Array,
    slot: jax.Array,
    start: jax.Array,
    cfg: ModelConfig,
    attend: int,
    kernels: bool = False,
    ragged: bool | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """A decode step and a prompt chunk in one pass over the weights: `decode_layers` for x
    [R, 1, E] (positions, active [R]) and `prefill_layers` for chunk [C, E] at positions
    start..start+C-1 of `slot` (not one of the active rows) -> x [R, 1, E] and the caches (the
    chunk's own hidden states are not returned: a chunk that rides along never samples).

    Every projection takes the R + C rows together, so the weights are read once for both
    (on the CPU, by the panel kernel, each row's result the same bits as alone); the writes and
    the attention are each part's own, the decode rows' writes first (an inactive row writes back
    what its slot holds, which must not undo the chunk's)."""
    r, c = x.shape[0], chunk.shape[0]
    if ragged is None:
        ragged = ragged_attention.applies(cfg.head_dim, k_caches[0].shape[2])
    write = _decode_writer(positions, active, k_caches[0].shape[2])
    use_kernel = _chunk_kernel(kernels, cfg, chunk.dtype, k_caches[0].dtype)
    h = jnp.concatenate([x[:, 0], chunk])[None]  # [1, R + C, E]: the decode rows, then the chunk's
    pos = jnp.concatenate([positions, start + jnp.arange(c)])[None]  # [1, R + C]
    at = (slot, 0, start, 0)
    ks, vs = [], []
    for w, k_cache, v_cache in zip(layers, k_caches, v_caches, strict=True):
        q, k, v = _qkv(rms_norm(h, w.attn_norm, cfg.rms_eps), w, pos, cfg)  # [1, R + C, H|K, D]
        k_cache, v_cache = write(k_cache, k[0, :r]), write(v_cache, v[0, :r])
        k_cache = jax.lax.dynamic_update_slice(k_cache, k[:, r:].swapaxes(1, 2).astype(k_cache.dtype), at)  # [1, K, C, D]
        v_cache = jax.lax.dynamic_update_slice(v_cache, v[:, r:].swapaxes(1, 2).astype(v_cache.dtype), at)
        ks.append(k_cache)
        vs.append(v_cache)
        seen = jnp.concatenate([
            _decode_seen(q[0, :r], k_cache, v_cache, positions, active, cfg, attend, kernels, ragged),  # [R, H*D]
            _chunk_seen(q[0, r:], k_cache, v_cache, slot, start, cfg, use_kernel),  # [C, H*D]
        ])[None]
        h = h + _project(seen, w.w_o, getattr(w.panels, "o", None))
        h = h + _mlp(rms_norm(h, w.mlp_norm, cfg.rms_eps), w)
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
    x, ks, vs = prefill_layers(weights.layers, cache.k, cache.v, x, slot, start, cfg)
    last = jax.lax.dynamic_index_in_dim(x[0], length - 1, keepdims=False)  # [E]
    return logits(last, weights.final_norm, weights.lm_head, cfg), KVCache(ks, vs)


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
    x, ks, vs = decode_layers(weights.layers, cache.k, cache.v, x, positions, active, cfg, attend, kernels, ragged)
    return logits(x[:, 0], weights.final_norm, weights.lm_head, cfg), KVCache(ks, vs)
