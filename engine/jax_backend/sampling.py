"""Choosing the next token on the device, per slot, inside the jitted prefill and decode steps.

Each of the B rows carries its own parameters (`SlotSampling`), so one batch mixes greedy and
sampled requests. What holds for every row:
- Masked ids (the slot's `mask` row, when the step's `masked` flag is set) are never chosen, nor
  are ids whose tempered logit is not finite (NaN, or a logit that overflowed the temperature).
- temperature 0 is argmax (the first id of the maximum). Otherwise logits are divided by the
  temperature, then cut: top_k keeps the k best, top_p the smallest set of best tokens whose
  probability reaches top_p (after top_k), min_p the tokens with probability >= min_p x the best
  one's. Ties at a cut's boundary are kept: every cut is a threshold on the logits' bit patterns
  (`_sortable`), and an id at the threshold stays.
- The draw is one uniform per row from key = fold_in(PRNGKey(seed), position), position being the
  sampled token's own position: the draw never depends on the rest of the batch, so the same seed
  and the same logits give the same token in any company (the logits themselves are batch-invariant
  on XLA:CPU in float32 only; tests/support/backend.py). It picks a token by inverse CDF over the kept weights in id order, in two levels
  (block sums, then one block), which costs a pass over V instead of V random numbers.
- The logprob returned is the chosen id's under the raw distribution (log_softmax of the logits as
  the model produced them, before mask, temperature and cuts).
- `top_logprobs` gives the MAX_TOP_LOGPROBS most likely ids of that same distribution per row, a
  static count so it adds no shape; most likely first, ties to the lower id.

How the top_k and top_p thresholds are found. The common case reads them off a capped candidate
set, the CAP best tempered logits per row from `lax.top_k`: top_k <= CAP takes the k-th
candidate; top_p takes the first candidate where the candidates' running weight reaches top_p x
the kept weight. The candidates are exactly the largest values (an id tied with the last one but
left out holds the same value, and the threshold keeps it), so the capped threshold is the exact
one. The cap cannot answer when top_k > CAP, or when the CAP best fall short of the top_p weight
(a flat distribution); those rows take the threshold from an exact radix select over all V ids
(`_exact_floor`: a histogram per RADIX_BITS level, one scatter-add pass over [B, V] each, no
sort). min_p needs no search: each id is compared with the best one. CAP = 128 holds the usual
top_k settings (40 in llama.cpp, 50 in transformers, 100) and lax.top_k's CPU cost changes little
between 64 and 256 (docs/benchmarks.md, "Sampling"). Running weights are float32 sums in another
order than a full-vocabulary sum, so a top_p target within rounding of a boundary may keep one id
more or less than exact arithmetic would; every other decision is exact.

No host synchronisation on an accelerator. Work that only some batches need (the draw when some
row samples, the candidates when some row cuts, the exact select when some row's cut falls
outside the cap, top_logprobs when some row asks) goes through `_when`, whose strategy is chosen
per platform when the step is lowered (`lax.platform_dependent`, not a flag inside the step):
- GPU and TPU: computed every step, then selected (`jnp.where`). The lowered step has no
  conditional and no loop: an XLA:GPU conditional copies its predicate to the host and waits for
  the stream, which would stall a host that runs a step ahead of the device. What that costs:
  every step computes the draw, the candidates, both exact selects and top_logprobs whether or
  not a row needs them, so on GPU the cap saves nothing yet (it will once the exact select can be
  skipped on the device, e.g. in a Pallas kernel). What the host can tell before it dispatches a
  step, it decides there: a decode step whose rows are all greedy and want no alternatives runs
  `greedy` instead (engine.jax_backend.jax_model, `split_sampler`). Scatter-adds of float weights on GPU add in no
  fixed order, so there a top_p target within rounding of a boundary may also differ between runs.
- CPU: a `lax.cond`. The predicate already lies in host memory, so the branch costs nothing and
  skips work that would otherwise be a large part of a step (docs/benchmarks.md, "Sampling").
  The exact select runs there one row at a time (`lax.map`), which keeps the step's scratch
  memory near what it was before the candidates (see `_exact_floor`).
Both strategies compute the same values with the same arithmetic; tests compare them.
BRANCH_ON_CPU = False gives the CPU the GPU strategy too (a step with no conditional anywhere, at
the CPU cost measured in docs/benchmarks.md).

Shapes: B rows (slots), V vocab, C candidates (min(CAP, V)), K = min(MAX_TOP_LOGPROBS, V).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp

from engine.core.request import MAX_TOP_LOGPROBS

BLOCK = 256  # ids per block of the two-level inverse CDF
CAP = 128  # candidates per row from lax.top_k for the top_k and top_p thresholds
RADIX_BITS = (11, 11, 10)  # bits of the key per level of the exact select, high first (32 in all)
BRANCH_ON_CPU = True  # the CPU skips unneeded work with lax.cond; False: every platform computes and selects

T = TypeVar("T")


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
    return jax.lax.platform_dependent(
        logits, params, positions, mask, masked,
        cpu=partial(_sample, skip=BRANCH_ON_CPU), default=partial(_sample, skip=False),
    )


def greedy(logits: jax.Array, mask: jax.Array, masked: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample` for a batch whose rows are all greedy (temperature 0): the first max of each row's
    allowed ids and its raw logprob, and nothing else (no draw, no candidates, no exact select):
    what `sample` gives those rows, on every platform. The host knows every row's parameters when
    it dispatches a step, so it picks this where an accelerator would otherwise compute every
    piece of `sample` (engine.jax_backend.jax_model, `split_sampler`). Shapes as `sample`."""
    logits = logits.astype(jnp.float32)
    tokens = _first_max(jnp.where(mask & masked[:, None], -jnp.inf, logits))  # [B]
    return tokens, _logprob(logits, tokens)


def no_top_logprobs(rows: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """What `top_logprobs` returns when no row wants alternatives: zeros [rows, K] ids, logprobs."""
    k = min(MAX_TOP_LOGPROBS, vocab)
    return jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32)


def top_logprobs(logits: jax.Array, wanted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V], wanted [B] i32 (alternatives each row asks for) -> (ids [B, K] i32,
    raw logprobs [B, K] f32), most likely first (ties: the lower id first); zeros when no row
    wants any. Callers keep each row's first `wanted` columns."""
    return jax.lax.platform_dependent(
        logits, wanted, cpu=partial(_top_logprobs, skip=BRANCH_ON_CPU), default=partial(_top_logprobs, skip=False)
    )


def _sample(
    logits: jax.Array,
    params: SlotSampling,
    positions: jax.Array,
    mask: jax.Array,
    masked: jax.Array,
    *,
    skip: bool,
    cap: int = CAP,
) -> tuple[jax.Array, jax.Array]:
    """`sample` with `_when`'s strategy fixed (skip=True branches, skip=False computes and
    selects) and the candidate cap a parameter (benchmarks/sampling.py compares caps)."""
    logits = logits.astype(jnp.float32)
    live = jnp.where(mask & masked[:, None], -jnp.inf, logits)  # [B, V]
    first = _first_max(live)  # [B]
    drawn = _when(jnp.any(params.temperature > 0), lambda: _draw(live, params, positions, skip, cap), first, skip)
    tokens = jnp.where(params.temperature > 0, drawn, first)  # [B]
    return tokens, _logprob(logits, tokens)


def _logprob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """The raw logprob of each row's token: logits [B, V] f32, tokens [B] -> [B]."""
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [B]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def _top_logprobs(logits: jax.Array, wanted: jax.Array, *, skip: bool) -> tuple[jax.Array, jax.Array]:
    b, v = logits.shape
    k = min(MAX_TOP_LOGPROBS, v)

    def compute() -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)  # [B, K]
        return ids.astype(jnp.int32), values

    return _when(jnp.any(wanted > 0), compute, no_top_logprobs(b, v), skip)


def _when(pred: jax.Array, compute: Callable[[], T], otherwise: T, skip: bool) -> T:
    """compute() where the scalar pred holds, else `otherwise` (same shapes). skip=True: a
    conditional that runs compute only when needed (the CPU); skip=False: compute always, then
    select, so no predicate ever travels to the host (GPU, TPU)."""
    if skip:
        return jax.lax.cond(pred, compute, lambda: otherwise)
    return jax.tree.map(lambda done, other: jnp.where(pred, done, other), compute(), otherwise)


def _first_max(x: jax.Array) -> jax.Array:
    """argmax over the last axis (the first index of the maximum), as a max and a min: two plain
    reductions that XLA:CPU vectorises, where its index-carrying argmax reduce is slower
    (docs/benchmarks.md). Always in range, even for a row of NaNs: [B, V] -> [B] i32."""
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
    first = jnp.min(jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)  # [B]
    return jnp.minimum(first, v - 1)


def _draw(live: jax.Array, params: SlotSampling, positions: jax.Array, skip: bool, cap: int) -> jax.Array:
    """Temperature, top_k, top_p, min_p, then one inverse-CDF draw per row -> ids [B]."""
    weights = _kept_weights(live, params, skip, cap)  # [B, V]
    u = jax.vmap(lambda s, p: jax.random.uniform(row_key(s, p)))(params.seed, positions)  # [B]
    return _inverse_cdf(weights, u)


def _kept_weights(live: jax.Array, params: SlotSampling, skip: bool, cap: int = CAP) -> jax.Array:
    """The unnormalised probabilities [B, V] of the ids that survive temperature and every cut
    (0 elsewhere), scaled so that the best kept id weighs 1."""
    b, v = live.shape
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)  # [B]; greedy rows unused
    z = live / temperature[:, None]  # [B, V]
    z = jnp.where(jnp.isfinite(z), z, -jnp.inf)  # NaN and overflow: never kept, lowest in every cut
    keys = _sortable(z)  # [B, V] u32, ordered as z
    c = min(cap, v)
    no_candidates = (jnp.full((b, c), -jnp.inf, jnp.float32), jnp.zeros((b, c), jnp.int32))
    cuts = jnp.any((params.top_k > 0) | (params.top_p < 1))
    cand_z, cand_ids = _when(cuts, lambda: tuple(jax.lax.top_k(z, c)), no_candidates, skip)  # [B, C] best first
    cand_keys = _sortable(cand_z)  # [B, C]

    keep = (z > -jnp.inf) & (keys >= _top_k_floor(keys, cand_keys, params.top_k, skip)[:, None])  # [B, V]
    z_max = jnp.max(jnp.where(keep, z, -jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
    weights = jnp.where(keep, jnp.exp(z - z_max), 0.0)  # [B, V]
    keep = keep & (keys >= _top_p_floor(keys, weights, cand_keys, cand_ids, params.top_p, skip)[:, None])

    min_log = jnp.log(jnp.maximum(params.min_p, 1e-30))[:, None]  # [B, 1]; p >= min_p * p_max
    keep = keep & ((params.min_p[:, None] <= 0) | (z - z_max >= min_log))
    return jnp.where(keep, weights, 0.0)


def _top_k_floor(keys: jax.Array, cand_keys: jax.Array, top_k: jax.Array, skip: bool) -> jax.Array:
    """The k-th best key per row (0 = no cut): read off the candidates [B, C] when k <= C, else
    the exact select over keys [B, V] -> [B] u32."""
    v, c = keys.shape[-1], cand_keys.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
    floor = jnp.where(k < v, jnp.take_along_axis(cand_keys, jnp.minimum(k, c)[:, None] - 1, axis=-1)[:, 0], 0)
    beyond = (k > c) & (k < v)  # [B]; rows whose k-th best the candidates do not hold
    exact = lambda: jnp.where(beyond, _exact_floor(keys, None, k.astype(jnp.float32), skip), floor)  # noqa: E731
    return _when(jnp.any(beyond), exact, floor, skip)


def _top_p_floor(
    keys: jax.Array, weights: jax.Array, cand_keys: jax.Array, cand_ids: jax.Array, top_p: jax.Array, skip: bool
) -> jax.Array:
    """The largest key per row whose ids at or above it weigh >= top_p x the kept weight (0 = no
    cut), for weights [B, V] after top_k: the first candidate where the candidates' running weight
    reaches it, else (the candidates fall short) the exact select -> [B] u32."""
    target = top_p * jnp.sum(weights, axis=-1)  # [B]
    mass = jnp.cumsum(jnp.take_along_axis(weights, cand_ids, axis=-1), axis=-1)  # [B, C], best first
    reached = mass >= target[:, None]  # [B, C]
    floor = jnp.take_along_axis(cand_keys, jnp.argmax(reached, axis=-1)[:, None], axis=-1)[:, 0]  # [B]
    beyond = (top_p < 1) & ~jnp.any(reached, axis=-1)  # [B]
    exact = lambda: jnp.where(beyond, _exact_floor(keys, weights, target, skip), floor)  # noqa: E731
    return jnp.where(top_p < 1, _when(jnp.any(beyond), exact, floor, skip), 0)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest), so a threshold is exact and keeps its
    ties."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    bits = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(0x80000000)


def _exact_floor(keys: jax.Array, values: jax.Array | None, target: jax.Array, skip: bool) -> jax.Array:
    """The largest key t per row with sum(values[keys >= t]) >= target (0 when even t = 0 falls
    short by rounding), for keys [B, V] u32, values [B, V] >= 0 (None: 1 for every id, a count),
    target [B].

    A radix select, high bits first: a histogram of the next RADIX_BITS of the keys that share the
    bits chosen so far, and the last bin whose mass from the top still reaches the target. One
    scatter-add pass over [B, V] per level, no sort; small bins keep the histograms small. With
    skip (the CPU) it runs one row at a time (`lax.map`, a loop over B on the host thread): the
    same arithmetic in the same order, with [V] instead of [B, V] scratch arrays, because XLA:CPU
    allocates an executable's scratch per call and past glibc's 32 MiB mmap threshold every page
    of it faults anew (docs/benchmarks.md, "Sampling")."""
    if skip:
        one_row = lambda row: _exact_floor(*(a if a is None else a[None] for a in row), skip=False)[0]  # noqa: E731
        return jax.lax.map(one_row, (keys, values, target))
    b, v = keys.shape
    values = jnp.ones((b, v), jnp.float32) if values is None else values
    offsets = jnp.arange(b, dtype=jnp.int32)[:, None]  # [B, 1]
    floor = jnp.zeros((b,), jnp.uint32)  # [B], the bits chosen so far, in place
    base = jnp.zeros((b,), jnp.float32)  # [B], the mass of the keys above the chosen prefix
    shift = 32
    for bits in RADIX_BITS:
        high, shift, bins = shift, shift - bits, 1 << bits
        same = values if high == 32 else jnp.where((keys >> high) == (floor >> high)[:, None], values, 0.0)
        digit = ((keys >> shift) & (bins - 1)).astype(jnp.int32)  # [B, V]
        hist = jnp.zeros((b * bins,), jnp.float32).at[(offsets * bins + digit).reshape(-1)].add(same.reshape(-1))
        from_top = base[:, None] + jnp.cumsum(hist.reshape(b, bins)[:, ::-1], axis=-1)[:, ::-1]  # [B, bins]
        j = jnp.maximum(jnp.sum(from_top >= target[:, None], axis=-1) - 1, 0)  # [B], the last bin reaching it
        after = jnp.concatenate([from_top[:, 1:], base[:, None]], axis=-1)  # [B, bins], mass of bins above each
        base = jnp.take_along_axis(after, j[:, None], axis=-1)[:, 0]
        floor = floor | (j.astype(jnp.uint32) << shift)
    return floor


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
