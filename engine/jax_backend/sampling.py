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

How the top_k and top_p thresholds are found depends on the platform (chosen when the step is
lowered, `lax.platform_dependent`, not by a flag inside the step); both give the same cut-off sets.
- GPU and TPU: a threshold search (`_searched_floor`) over every id of every row, with no sort and
  no conditional. The threshold is the largest key t whose ids at or above it weigh enough (count
  >= k for top_k; weight >= top_p x the kept weight for top_p); the search settles SEARCH_BITS of
  t per pass by testing all 2**SEARCH_BITS - 1 ways to extend the bits found so far, each test a
  compare-and-sum over the row. 32 / SEARCH_BITS = 8 passes, a number fixed by the key width and
  not by the data. Why this and not the radix select by histograms that the CPU uses beyond the
  cap: a histogram is a scatter-add, and a row's logits share their high key bits, so most ids
  land in a few bins; XLA:GPU does a scatter-add with atomic adds, which serialise on those bins
  and add floats in no fixed order. A pass of the search is one reduction that reads the row once
  and does 15 compares per id read. One probe per pass (a bisection) would read the rows 32 times
  instead of 8; 255 probes per pass (4 passes) would do 17 times the arithmetic per id read.
- CPU: a capped candidate set, the CAP best tempered logits per row from `lax.top_k` (XLA:CPU's
  is a partial sort): top_k <= CAP takes the k-th candidate; top_p takes the first candidate
  where the candidates' running weight reaches top_p x the kept weight. The candidates are exactly
  the largest values (an id tied with the last one but left out holds the same value, and the
  threshold keeps it), so the capped threshold is the exact one. The cap cannot answer when top_k
  > CAP, or when the CAP best fall short of the top_p weight (a flat distribution); those rows
  take the threshold from an exact radix select over all V ids (`_exact_floor`: a histogram per
  RADIX_BITS level, one scatter-add pass each, no sort). CAP = 128 holds the usual top_k settings
  (40 in llama.cpp, 50 in transformers, 100) and lax.top_k's CPU cost changes little between 64
  and 256 (docs/benchmarks.md, "Sampling").
min_p needs no search on either: each id is compared with the best one. A top_k threshold is a
count, exact on both. A top_p threshold compares float32 sums taken in another order than a
full-vocabulary sum (and than each other), so a top_p target within rounding of a boundary may
keep one id more or less than exact arithmetic would, or than the other platform; every other
decision is exact.

`top_logprobs` takes `lax.top_k` on the CPU and `two_stage_top_k` on accelerators: the best of
each chunk of TOP_K_CHUNK ids, then the best of those winners, in pieces of at most TOP_K_PIECE
(16 + 4 for MAX_TOP_LOGPROBS = 20), since XLA:GPU's own top-k kernel takes k <= 16 and a larger k
becomes a sort of the operand. The same values and ids as lax.top_k, ties to the lower id.

No host synchronisation on an accelerator. Work that only some batches need (the draw when some
row samples; on the CPU, the candidates when some row cuts, the exact select when some row's cut
falls outside the cap, top_logprobs when some row asks) goes through `_when`, whose strategy is
chosen per platform like the thresholds:
- GPU and TPU: computed every step, then selected (`jnp.where`). The lowered step has no
  conditional, no loop, no sort and no top-k over the vocabulary (tests/test_sampler_lowering.py):
  an XLA:GPU conditional copies its predicate to the host and waits for the stream, which would
  stall a host that runs a step ahead of the device. What that costs: every step computes the
  draw, both threshold searches and top_logprobs whether or not a row needs them. What the host
  can tell before it dispatches a step, it decides there: a decode step whose rows are all greedy
  and want no alternatives runs `greedy` instead (engine.jax_backend.jax_model, `split_sampler`).
- CPU: a `lax.cond`. The predicate already lies in host memory, so the branch costs nothing and
  skips work that would otherwise be a large part of a step (docs/benchmarks.md, "Sampling").
  The exact select runs there one row at a time (`lax.map`), which keeps the step's scratch
  memory near what it was before the candidates (see `_exact_floor`).
Both strategies draw the same ids from the same seeds (but for a top_p target within rounding of a
boundary, above); tests run both on the CPU and compare them.
BRANCH_ON_CPU = False gives the CPU the accelerators' strategy too (a step with no conditional
anywhere, at the CPU cost measured in docs/benchmarks.md).

Shapes: B rows (slots), V vocab, C candidates (min(CAP, V)), K = min(MAX_TOP_LOGPROBS, V), S probes
per pass of the threshold search, N chunks of the two-stage top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from engine.core.request import MAX_TOP_LOGPROBS

BLOCK = 256  # ids per block of the two-level inverse CDF
CAP = 128  # candidates per row from lax.top_k for the top_k and top_p thresholds
RADIX_BITS = (11, 11, 10)  # bits of the key per level of the exact select, high first (32 in all)
SEARCH_BITS = 4  # bits of the key the accelerators' threshold search settles per pass (8 passes)
TOP_K_CHUNK = 1024  # ids per chunk of the two-stage top-k (accelerators' top_logprobs)
TOP_K_PIECE = 16  # the largest k of one top-k call there: XLA:GPU's own top-k kernel takes k <= 16
TAKEN = -1  # float32 bits 0xFFFFFFFF: the NaN that lax.top_k ranks below every other value (taken ids)
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
        top_k = jax.lax.top_k if skip else two_stage_top_k
        values, ids = top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)  # [B, K]
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
    (0 elsewhere), scaled so that the best kept id weighs 1. skip: the CPU's thresholds (capped
    candidates, branches); else the accelerators' (threshold searches)."""
    b, v = live.shape
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)  # [B]; greedy rows unused
    z = live / temperature[:, None]  # [B, V]
    z = jnp.where(jnp.isfinite(z), z, -jnp.inf)  # NaN and overflow: never kept, lowest in every cut
    keys = _sortable(z)  # [B, V] u32, ordered as z
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, v), v)  # [B]; v = no cut
    if skip:
        c = min(cap, v)
        no_candidates = (jnp.full((b, c), -jnp.inf, jnp.float32), jnp.zeros((b, c), jnp.int32))
        cuts = jnp.any((params.top_k > 0) | (params.top_p < 1))
        cand_z, cand_ids = _when(cuts, lambda: tuple(jax.lax.top_k(z, c)), no_candidates, skip)  # [B, C] best first
        cand_keys = _sortable(cand_z)  # [B, C]
        k_floor = _top_k_floor(keys, cand_keys, k)
    else:
        k_floor = jnp.where(k < v, _searched_floor(keys, None, k), 0)  # [B]

    keep = (z > -jnp.inf) & (keys >= k_floor[:, None])  # [B, V]
    z_max = jnp.max(jnp.where(keep, z, -jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    z_max = jnp.where(jnp.isfinite(z_max), z_max, 0.0)
    weights = jnp.where(keep, jnp.exp(z - z_max), 0.0)  # [B, V]
    target = params.top_p * jnp.sum(weights, axis=-1)  # [B]
    if skip:
        p_floor = _top_p_floor(keys, weights, cand_keys, cand_ids, target, params.top_p < 1)
    else:
        p_floor = jnp.where(params.top_p < 1, _searched_floor(keys, weights, target), 0)  # [B]
    keep = keep & (keys >= p_floor[:, None])

    min_log = jnp.log(jnp.maximum(params.min_p, 1e-30))[:, None]  # [B, 1]; p >= min_p * p_max
    keep = keep & ((params.min_p[:, None] <= 0) | (z - z_max >= min_log))
    return jnp.where(keep, weights, 0.0)


def _top_k_floor(keys: jax.Array, cand_keys: jax.Array, k: jax.Array) -> jax.Array:
    """The CPU's k-th best key per row (k = V: no cut, 0): read off the candidates [B, C] when
    k <= C, else the exact select over keys [B, V] -> [B] u32."""
    v, c = keys.shape[-1], cand_keys.shape[-1]
    floor = jnp.where(k < v, jnp.take_along_axis(cand_keys, jnp.minimum(k, c)[:, None] - 1, axis=-1)[:, 0], 0)
    beyond = (k > c) & (k < v)  # [B]; rows whose k-th best the candidates do not hold
    exact = lambda: jnp.where(beyond, _exact_floor(keys, None, k.astype(jnp.float32), True), floor)  # noqa: E731
    return _when(jnp.any(beyond), exact, floor, True)


def _top_p_floor(
    keys: jax.Array, weights: jax.Array, cand_keys: jax.Array, cand_ids: jax.Array, target: jax.Array, cut: jax.Array
) -> jax.Array:
    """The CPU's largest key per row whose ids at or above it weigh >= target (0 where not `cut`),
    for weights [B, V] after top_k: the first candidate where the candidates' running weight
    reaches it, else (the candidates fall short) the exact select -> [B] u32."""
    mass = jnp.cumsum(jnp.take_along_axis(weights, cand_ids, axis=-1), axis=-1)  # [B, C], best first
    reached = mass >= target[:, None]  # [B, C]
    floor = jnp.take_along_axis(cand_keys, jnp.argmax(reached, axis=-1)[:, None], axis=-1)[:, 0]  # [B]
    beyond = cut & ~jnp.any(reached, axis=-1)  # [B]
    exact = lambda: jnp.where(beyond, _exact_floor(keys, weights, target, True), floor)  # noqa: E731
    return jnp.where(cut, _when(jnp.any(beyond), exact, floor, True), 0)


def _searched_floor(keys: jax.Array, values: jax.Array | None, target: jax.Array) -> jax.Array:
    """The largest key t per row with sum(values[keys >= t]) >= target (0 when even t = 0 falls
    short by rounding), for keys [B, V] u32, values [B, V] >= 0 (None: 1 for every id, a count in
    int32, exact), target [B]: what `_exact_floor` finds, by the accelerators' threshold search.

    Each pass extends the bits found so far by every SEARCH_BITS-bit digit d >= 1 at once (the
    probes), sums the values at or above each probe in one reduction over the row, and keeps the
    number of probes whose sum still reaches the target: the sums fall as the probe rises, so that
    count is the largest digit that reaches it (0: the bits so far followed by zeros)."""
    digits = jnp.arange(1, 1 << SEARCH_BITS, dtype=jnp.uint32)  # [S]
    floor = jnp.zeros(keys.shape[:1], jnp.uint32)  # [B], the bits settled so far, in place
    for shift in range(32 - SEARCH_BITS, -1, -SEARCH_BITS):
        probes = floor[:, None] | (digits << shift)[None, :]  # [B, S]
        above = keys[:, None, :] >= probes[:, :, None]  # [B, S, V]; XLA:GPU fuses it into the sum
        if values is None:
            mass = jnp.sum(above, axis=-1, dtype=jnp.int32)  # [B, S]
        else:
            mass = jnp.sum(jnp.where(above, values[:, None, :], 0.0), axis=-1)  # [B, S]
        digit = jnp.sum(mass >= target[:, None], axis=-1)  # [B]
        floor = floor | (digit.astype(jnp.uint32) << shift)
    return floor


def two_stage_top_k(x: jax.Array, k: int, chunk: int = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """lax.top_k of x [B, V] over the last axis without a top-k over the whole row: pieces of at
    most TOP_K_PIECE, each the best of every chunk of `chunk` ids, then the best of those winners,
    with the ids earlier pieces took set to TAKEN. The same values and ids as lax.top_k, ties to
    the lower id (the best of a row are among the best of their chunks, and the winners stay in id
    order), for any row holding k values other than the TAKEN NaN itself. -> ([B, k], [B, k] i32)."""
    b, v = x.shape
    keys = _sortable(x)  # [B, V], lax.top_k's order (NaNs by their bits)
    at = jnp.arange(v, dtype=jnp.int32)
    taken = jax.lax.bitcast_convert_type(jnp.int32(TAKEN), jnp.float32)
    rest, ids = x, []
    for start in range(0, k, TOP_K_PIECE):
        got = _best_of_chunks(rest, min(TOP_K_PIECE, k - start), chunk, taken)  # [B, piece]
        ids.append(got)
        last_key = jnp.take_along_axis(keys, got[:, -1:], axis=-1)  # [B, 1]
        before = (keys > last_key) | ((keys == last_key) & (at <= got[:, -1:]))  # [B, V]; every id taken so far
        rest = jnp.where(before, taken, x)
    ids = jnp.concatenate(ids, axis=-1)  # [B, k]
    return jnp.take_along_axis(x, ids, axis=-1), ids


def _best_of_chunks(x: jax.Array, k: int, chunk: int, pad: jax.Array) -> jax.Array:
    """The ids [B, k] i32 of lax.top_k(x, k), x [B, V], from the top k of each chunk of `chunk`
    ids (the last one padded with `pad`), then the top k of those N * k winners."""
    b, v = x.shape
    n = -(-v // chunk)
    chunks = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=pad).reshape(b, n, chunk)  # [B, N, chunk]
    values, ids = jax.lax.top_k(chunks, min(k, chunk))  # [B, N, k]
    ids = ids + (jnp.arange(n, dtype=ids.dtype) * chunk)[None, :, None]
    _, best = jax.lax.top_k(values.reshape(b, -1), k)  # [B, k]
    return jnp.take_along_axis(ids.reshape(b, -1), best, axis=-1).astype(jnp.int32)


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
    scatter-add pass over [B, V] per level, no sort; small bins keep the histograms small. The
    levels are one loop body (`fori_loop`), which XLA compiles once instead of once per level
    (the sampler's compile is most of a small model's warm-up on the CPU): every level's histogram
    has the widest level's bins, 2**max(RADIX_BITS); a narrower level's digit then takes in bits of
    the prefix, the same for every key it counts, so its mass lands in the bins of that prefix
    alone and the floors are those of the levels unrolled, bit for bit. With skip (the CPU) it
    runs one row at a time (`lax.map`, a loop over B on the host thread): the same arithmetic in
    the same order, with [V] instead of [B, V] scratch arrays, because XLA:CPU allocates an
    executable's scratch per call and past glibc's 32 MiB mmap threshold every page of it faults
    anew (docs/benchmarks.md, "Sampling")."""
    if skip:
        one_row = lambda row: _exact_floor(*(a if a is None else a[None] for a in row), skip=False)[0]  # noqa: E731
        return jax.lax.map(one_row, (keys, values, target))
    b, v = keys.shape
    values = jnp.ones((b, v), jnp.float32) if values is None else values
    offsets = jnp.arange(b, dtype=jnp.int32)[:, None]  # [B, 1]
    bins = 1 << max(RADIX_BITS)
    shifts = np.cumsum((0,) + RADIX_BITS[::-1])[::-1]  # each level's high and low bit: 32, 21, 10, 0
    high = jnp.asarray(shifts[:-1], jnp.uint32)  # [levels]
    low = jnp.asarray(shifts[1:], jnp.uint32)

    def level(i: jax.Array, chosen: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """One level: the bits from high[i] down to low[i] chosen. floor [B] (the bits chosen so
        far, in place), base [B] (the mass of the keys above the chosen prefix)."""
        floor, base = chosen
        # (a shift by 32 gives 0 in XLA, so the first level keeps every id)
        same = jnp.where((keys >> high[i]) == (floor >> high[i])[:, None], values, 0.0)  # [B, V]
        digit = ((keys >> low[i]) & (bins - 1)).astype(jnp.int32)  # [B, V]
        hist = jnp.zeros((b * bins,), jnp.float32).at[(offsets * bins + digit).reshape(-1)].add(same.reshape(-1))
        from_top = base[:, None] + jnp.cumsum(hist.reshape(b, bins)[:, ::-1], axis=-1)[:, ::-1]  # [B, bins]
        j = jnp.maximum(jnp.sum(from_top >= target[:, None], axis=-1) - 1, 0)  # [B], the last bin reaching it
        after = jnp.concatenate([from_top[:, 1:], base[:, None]], axis=-1)  # [B, bins], mass of bins above each
        return floor | (j.astype(jnp.uint32) << low[i]), jnp.take_along_axis(after, j[:, None], axis=-1)[:, 0]

    start = (jnp.zeros((b,), jnp.uint32), jnp.zeros((b,), jnp.float32))
    return jax.lax.fori_loop(0, len(RADIX_BITS), level, start)[0]


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
