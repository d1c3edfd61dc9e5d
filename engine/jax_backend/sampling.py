"""Choosing the next token on the device, per slot, inside the jitted prefill and decode steps.

Each of the B rows carries its own parameters (`SlotSampling`), so one batch mixes greedy and
sampled requests. What holds for every row:
- Masked ids (the slot's `mask` row, when the step's `masked` flag is set) are never chosen.
- temperature 0 is argmax. Otherwise logits are divided by the temperature, then cut:
  top_k keeps the k best, top_p the smallest set of best tokens whose probability reaches top_p
  (after top_k), min_p the tokens with probability >= min_p x the best one's. Ties at a cut's
  boundary are kept. The cuts are thresholds found by bisection on the logits' bit patterns,
  exact without a sort (a full sort of the vocabulary costs several times more on the CPU; see
  docs/benchmarks.md), and it only runs in a batch where some row asks for that cut.
- The draw is one uniform per row from key = fold_in(PRNGKey(seed), position), position being the
  sampled token's own position: the same seed and prompt give the same tokens whatever else is in
  the batch. It picks a token by inverse CDF over the kept weights in two levels (block sums, then
  one block), which costs a pass over V instead of V random numbers.
- The logprob returned is the chosen id's under the raw distribution (log_softmax of the logits as
  the model produced them, before mask, temperature and cuts).
- `top_logprobs` gives the MAX_TOP_LOGPROBS most likely ids of that same distribution per row, a
  static count so it adds no shape; it is computed only in a batch where some row asks for any
  (a `lax.cond`, both branches in the one compiled step), so steps nobody asks it of skip it.

Shapes: B rows (slots), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from engine.core.request import MAX_TOP_LOGPROBS

BLOCK = 256  # ids per block of the two-level inverse CDF


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotSampling:
    """Per-row sampling parameters as arrays (see engine.core.request.SamplingParams for meanings)."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] i32, 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    min_p: jax.Array  # [B] f32, 0 = off
    seed: jax.Array  # [B, 2] u32, the seed's high and low 32-bit words


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as the (high, low) words that make up its threefry key."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"a seed is a 64-bit unsigned number, got {seed}")
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def row_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """fold_in(PRNGKey(seed), position) from seed words [2]; equals jax.random.PRNGKey for any
    seed < 2**32 (and for all 64-bit seeds where x64 is enabled)."""
    key = jax.random.wrap_key_data(seed, impl="threefry2x32")
    return jax.random.fold_in(key, position)


def sample(
    logits: jax.Array, params: SlotSampling, positions: jax.Array, mask: jax.Array, masked: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] f32, positions [B] (of the tokens being sampled), mask [B, V] bool, masked [B]
    bool -> (token ids [B] i32, raw logprobs [B] f32)."""
    logits = logits.astype(jnp.float32)
    allowed = ~(mask & masked[:, None])  # [B, V]
    live = jnp.where(allowed, logits, -jnp.inf)  # [B, V]
    greedy = _first_max(live)  # [B]
    drawn = jax.lax.cond(
        jnp.any(params.temperature > 0),
        lambda: _draw(live, params, positions),
        lambda: greedy,
    )
    tokens = jnp.where(params.temperature > 0, drawn, greedy)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [B]
    return tokens, chosen - jax.nn.logsumexp(logits, axis=-1)


def top_logprobs(logits: jax.Array, wanted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V], wanted [B] i32 (alternatives each row asks for) -> (ids [B, K] i32,
    raw logprobs [B, K] f32), K = min(MAX_TOP_LOGPROBS, V), most likely first (ties: the lower id
    first); zeros when no row wants any. Callers keep each row's first `wanted` columns."""
    b, v = logits.shape
    k = min(MAX_TOP_LOGPROBS, v)

    def compute() -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)  # [B, K]
        return ids.astype(jnp.int32), values

    def skip() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    return jax.lax.cond(jnp.any(wanted > 0), compute, skip)


def _first_max(x: jax.Array) -> jax.Array:
    """argmax over the last axis (the first index of the maximum), as a max and a min: two plain
    reductions that XLA:CPU vectorises, where its index-carrying argmax reduce is slower
    (docs/benchmarks.md). Always in range, even for a row of NaNs: [B, V] -> [B] i32."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
    first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)  # [B]
    return jnp.minimum(first, v - 1)


def _draw(live: jax.Array, params: SlotSampling, positions: jax.Array) -> jax.Array:
    """Temperature, top_k, top_p, min_p, then one inverse-CDF draw per row -> ids [B]."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)  # [B]; greedy rows unused
    z = live / temperature[:, None]  # [B, V]
    keys = _sortable(z)  # [B, V] u32, ordered as z
    keep = jnp.isfinite(z)  # [B, V]
    v = z.shape[-1]

    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, v), v)  # [B]
    k_floor = jax.lax.cond(
        jnp.any(params.top_k > 0),
        lambda: _largest_threshold(keys, lambda above: jnp.sum(above, axis=-1) >= k),
        lambda: jnp.zeros(k.shape, jnp.uint32),
    )
    keep = keep & (keys >= k_floor[:, None])

    z_max = jnp.max(jnp.where(keep, z, -jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
    weights = jnp.where(keep, jnp.exp(z - z_max), 0.0)  # [B, V] unnormalised probabilities
    target = params.top_p * jnp.sum(weights, axis=-1)  # [B]

    def reaches_top_p(above: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(above, weights, 0.0), axis=-1) >= target

    p_floor = jax.lax.cond(
        jnp.any(params.top_p < 1),
        lambda: _largest_threshold(keys, reaches_top_p),
        lambda: jnp.zeros(k.shape, jnp.uint32),
    )
    p_floor = jnp.where(params.top_p < 1, p_floor, 0)
    keep = keep & (keys >= p_floor[:, None])

    min_log = jnp.log(jnp.maximum(params.min_p, 1e-30))[:, None]  # [B, 1]; p >= min_p * p_max
    keep = keep & ((params.min_p[:, None] <= 0) | (z - z_max >= min_log))
    weights = jnp.where(keep, weights, 0.0)

    u = jax.vmap(lambda s, p: jax.random.uniform(row_key(s, p)))(params.seed, positions)  # [B]
    return _inverse_cdf(weights, u)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest), so thresholds can be bisected exactly."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    bits = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_threshold(keys: jax.Array, holds) -> jax.Array:
    """The largest t per row with holds(keys >= t) true, for `holds` monotone (true at t = 0).

    Bisection over the 2**32 key values: 32 passes over [B, V], no sort.
    """
    lo = jnp.zeros(keys.shape[:-1], jnp.uint32)  # [B], holds
    hi = jnp.full(keys.shape[:-1], 0xFFFFFFFF, jnp.uint32)  # [B]

    def step(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # upper middle, never overflows
        ok = holds(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """The id whose cumulative weight first exceeds u x total, for weights [B, V] >= 0, u [B] in
    [0, 1). Always an id of positive weight when the row has one (rounding is clamped to the last)."""
    b, v = weights.shape
    n_blocks = -(-v // BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, n_blocks * BLOCK - v))).reshape(b, n_blocks, BLOCK)
    block_sums = jnp.sum(blocks, axis=-1)  # [B, NB]
    cum = jnp.cumsum(block_sums, axis=-1)  # [B, NB]
    target = u * cum[:, -1]  # [B]
    j = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), _last_positive(block_sums))  # [B]
    before = jnp.where(j > 0, jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    block = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    inner = jnp.cumsum(block, axis=-1)  # [B, BLOCK]
    i = jnp.minimum(jnp.sum(inner <= (target - before)[:, None], axis=-1), _last_positive(block))  # [B]
    return (j * BLOCK + i).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last positive entry along the last axis (0 when none): [B, N] -> [B]."""
    n = x.shape[-1]
    return (n - 1 - jnp.argmax(jnp.flip(x > 0, axis=-1), axis=-1)).astype(jnp.int32)
