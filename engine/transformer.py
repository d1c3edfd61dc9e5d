"""The decoder forward pass in pure JAX, over a slot-based KV cache updated in place.

Two entry points, both pure and jitted by the caller with the cache donated:
- `prefill`: one request's prompt (padded to a bucket of T tokens) into one slot; writes the
  slot's K/V for positions [0, T) and returns the logits after the last real prompt token.
- `decode`: one token for each of the B slots at a fixed batch shape; writes each active slot's
  K/V at its position and attends over the first `attend` cache positions only, so a step costs
  what the live lengths need, not what the cache could hold.

The layers are unrolled over separate per-layer weights and per-layer cache buffers. Measured
here on a SmolLM2-shaped model (30 layers): a `lax.scan` over stacked weights compiled ~4x faster
but decoded ~25% slower, because XLA:CPU copies each layer's slice of a stacked array before the
matmul reads it; decode is memory-bound, so we take the speed. Each cache buffer is written with a
scatter/dynamic-update-slice on the donated input, which XLA performs in place: step time does not
grow with max_context at equal live length (see tests/test_jax_model.py). Rows past a slot's live
length hold stale values; they are never attended because every query masks later positions.

Shapes: B slots, T tokens, S cache positions (max context), V vocab, E hidden, F ffn, H heads,
K kv heads, G = H / K query heads per kv head, D head dim, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.checkpoint import LayerWeights, ModelConfig, RopeScaling, Weights


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Every slot's keys and values, one buffer per layer, allocated once; steps take it donated
    and return it updated."""

    k: tuple[jax.Array, ...]  # L x [B, S, K, D]
    v: tuple[jax.Array, ...]  # L x [B, S, K, D]


def init_cache(cfg: ModelConfig, batch: int, context: int, dtype: jnp.dtype) -> KVCache:
    shape = (batch, context, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(
        tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
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
    """Causal GQA attention of queries at `q_pos` over keys at positions 0..S'-1.

    q [B, T, H, D], k/v [B, S', K, D], q_pos [B, T] -> [B, T, H * D]. A key is seen iff its
    position <= the query's, which also hides stale cache rows past a slot's live length.
    """
    b, t, _, d = q.shape
    g = cfg.n_heads // cfg.n_kv_heads
    q = q.reshape(b, t, cfg.n_kv_heads, g, d)  # [B, T, K, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)  # [B, K, G, T, S']
    scores = scores * (1.0 / np.sqrt(d))
    seen = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # [B, T, S']
    scores = jnp.where(seen[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S']
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)  # [B, T, K, G, D]
    return out.reshape(b, t, cfg.n_heads * d)


def _qkv(x: jax.Array, w: LayerWeights, positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """Project, optionally bias and q/k-norm, then rotate: x [B, T, E] -> q [B,T,H,D], k/v [B,T,K,D]."""
    b, t, _ = x.shape
    h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = x @ w.w_qkv  # [B, T, (H + 2K) * D]
    if cfg.qkv_bias:
        qkv = qkv + w.b_qkv
    q = qkv[..., : h * d].reshape(b, t, h, d)  # [B, T, H, D]
    k = qkv[..., h * d : (h + kv) * d].reshape(b, t, kv, d)  # [B, T, K, D]
    v = qkv[..., (h + kv) * d :].reshape(b, t, kv, d)  # [B, T, K, D]
    if cfg.qk_norm:
        q = rms_norm(q, w.q_norm, cfg.rms_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_eps)
    inv_freq = rope_inv_freq(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _mlp(x: jax.Array, w: LayerWeights) -> jax.Array:
    gate, up = jnp.split(x @ w.w_gate_up, 2, axis=-1)  # [B, T, F] each
    return (jax.nn.silu(gate) * up) @ w.w_down  # [B, T, E]


def _logits(x: jax.Array, weights: Weights, cfg: ModelConfig) -> jax.Array:
    """x [..., E] -> float32 logits [..., V], through the tied embedding when there is no lm head."""
    x = rms_norm(x, weights.final_norm, cfg.rms_eps)
    head = weights.embed.T if weights.lm_head is None else weights.lm_head  # [E, V]
    return jnp.dot(x, head, preferred_element_type=jnp.float32)


def prefill(
    weights: Weights, cache: KVCache, tokens: jax.Array, length: jax.Array, slot: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """tokens [T] (real ones first, padding after), length [] in [1, T], slot [] -> logits [V], cache.

    Writes the slot's K/V for positions [0, T); those past `length` are padding, overwritten by
    decode before any query can see them. The prompt attends to its own fresh K/V only.
    """
    positions = jnp.arange(tokens.shape[0])[None, :]  # [1, T]
    x = weights.embed[tokens][None]  # [1, T, E]
    ks, vs = [], []
    for w, k_cache, v_cache in zip(weights.layers, cache.k, cache.v):
        q, k, v = _qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), w, positions, cfg)  # [1, T, H|K, D]
        ks.append(jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (slot, 0, 0, 0)))
        vs.append(jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (slot, 0, 0, 0)))
        x = x + attention(q, k, v, positions, cfg) @ w.w_o
        x = x + _mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w)
    last = jax.lax.dynamic_index_in_dim(x[0], length - 1, keepdims=False)  # [E]
    return _logits(last, weights, cfg), KVCache(tuple(ks), tuple(vs))


def decode(
    weights: Weights,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    active: jax.Array,
    cfg: ModelConfig,
    attend: int,
) -> tuple[jax.Array, KVCache]:
    """tokens/positions/active [B] -> logits [B, V], cache. `attend` (static) > every active position.

    Inactive slots compute garbage and write nothing (their write index is past the cache and the
    scatter drops it), so a slot between prefill and its first decode keeps its prompt intact.
    """
    s = cache.k[0].shape[1]
    write_at = jnp.where(active, positions, s)  # [B]; s = out of range = dropped
    rows = jnp.arange(tokens.shape[0])  # [B]
    x = weights.embed[tokens][:, None]  # [B, 1, E]
    pos = positions[:, None]  # [B, 1]
    ks, vs = [], []
    for w, k_cache, v_cache in zip(weights.layers, cache.k, cache.v):
        q, k, v = _qkv(rms_norm(x, w.attn_norm, cfg.rms_eps), w, pos, cfg)  # [B, 1, H|K, D]
        k_cache = k_cache.at[rows, write_at].set(k[:, 0].astype(k_cache.dtype), mode="drop")  # [B, S, K, D]
        v_cache = v_cache.at[rows, write_at].set(v[:, 0].astype(v_cache.dtype), mode="drop")
        ks.append(k_cache)
        vs.append(v_cache)
        x = x + attention(q, k_cache[:, :attend], v_cache[:, :attend], pos, cfg) @ w.w_o
        x = x + _mlp(rms_norm(x, w.mlp_norm, cfg.rms_eps), w)
    return _logits(x[:, 0], weights, cfg), KVCache(tuple(ks), tuple(vs))
