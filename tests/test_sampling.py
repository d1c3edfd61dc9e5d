"""engine.jax_backend.sampling on hand-made logits: greedy, cuts, masks, seeds, raw logprobs.

Most calls share two shapes ([ROWS, 4] and [8, 64]) so the suite compiles `sample` twice; the
tests of the candidate cap use [8, WIDE], wider than the cap, and the accelerators' strategy
(threshold searches and a two-stage top-k, computed and selected) is checked against the CPU's
(capped candidates, exact select and branches) on it. The draws' distributions are
tests/test_sampling_distribution.py's; the accelerators' lowering, tests/test_sampler_lowering.py's."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import MAX_TOP_LOGPROBS
from engine.jax_backend import sampling
from engine.jax_backend.sampling import CAP, SlotSampling, row_key, sample, seed_words, top_logprobs
from support.examples import examples
from support.lowering import host_syncs, stablehlo_ops

ROWS = 2000
PROBS = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
WIDE = 1024  # > CAP, so rows can need more than the candidates
_sample = jax.jit(sample)


def _params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None) -> SlotSampling:
    seeds = range(n) if seeds is None else seeds
    return SlotSampling(
        np.broadcast_to(np.float32(temperature), (n,)).copy(),
        np.broadcast_to(np.int32(top_k), (n,)).copy(),
        np.broadcast_to(np.float32(top_p), (n,)).copy(),
        np.broadcast_to(np.float32(min_p), (n,)).copy(),
        np.array([seed_words(s) for s in seeds], np.uint32),
    )


def _run(logits, params, positions=None, mask=None, masked=None):
    n, v = logits.shape
    positions = np.zeros(n, np.int32) if positions is None else positions
    mask = np.zeros((n, v), bool) if mask is None else mask
    masked = np.zeros(n, bool) if masked is None else masked
    tokens, logprobs = _sample(jnp.asarray(logits, jnp.float32), params, positions, mask, masked)
    return np.asarray(tokens), np.asarray(logprobs)


def _frequencies(**cut) -> np.ndarray:
    """How often each of the 4 ids is drawn from PROBS over ROWS different seeds."""
    tokens, _ = _run(np.tile(np.log(PROBS), (ROWS, 1)), _params(ROWS, **cut))
    return np.bincount(tokens, minlength=4) / ROWS


def _random_logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (8, 64)).astype(np.float32)


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax():
    logits = _random_logits(0)
    tokens, logprobs = _run(logits, _params(8, temperature=0.0))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(logprobs, raw[np.arange(8), tokens], atol=1e-5)


def test_greedy_ties_take_the_first_id_and_a_broken_row_still_gives_an_id_in_range():
    logits = _random_logits(5)
    logits[0, [3, 40]] = 100.0  # a tie: the lower id, as argmax
    logits[1, :] = -np.inf  # every id masked out
    logits[2, 7] = np.nan  # a model that went wrong
    logits[3, :] = np.nan
    tokens, _ = _run(logits, _params(8, temperature=0.0))
    assert tokens[0] == 3 and tokens[1] == 0
    assert ((0 <= tokens) & (tokens < 64)).all()
    np.testing.assert_array_equal(tokens[4:], logits[4:].argmax(-1))


def test_top_k_1_is_greedy_whatever_the_seed_and_temperature():
    logits = _random_logits(1)
    for seed in range(3):
        tokens, _ = _run(logits, _params(8, temperature=1.7, top_k=1, seeds=range(seed * 8, seed * 8 + 8)))
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_a_batch_mixes_greedy_and_sampled_rows():
    logits = _random_logits(2)
    params = _params(8, temperature=1.0)
    params = SlotSampling(np.array([0, 1] * 4, np.float32), params.top_k, params.top_p, params.min_p, params.seed)
    tokens, _ = _run(logits, params)
    np.testing.assert_array_equal(tokens[::2], logits.argmax(-1)[::2])


def test_logprob_ignores_temperature_and_cuts():
    tokens, logprobs = _run(np.tile(np.log(PROBS), (ROWS, 1)), _params(ROWS, temperature=2.5, top_k=1))
    assert (tokens == 0).all()
    np.testing.assert_allclose(logprobs, np.log(0.5), atol=1e-6)


def test_plain_sampling_follows_the_distribution():
    np.testing.assert_allclose(_frequencies(), PROBS, atol=0.04)


def test_top_p_keeps_the_smallest_set_reaching_p():
    np.testing.assert_allclose(_frequencies(top_p=0.7), [0.625, 0.375, 0, 0], atol=0.04)  # 0.5 < 0.7 <= 0.8
    np.testing.assert_array_equal(_frequencies(top_p=0.5), [1, 0, 0, 0])  # 0.5 reaches 0.5 alone
    assert (_frequencies(top_p=0.96) > 0).all()  # 0.95 < 0.96: needs all 4


def test_min_p_keeps_ids_at_least_min_p_times_the_best():
    np.testing.assert_allclose(_frequencies(min_p=0.5), [0.625, 0.375, 0, 0], atol=0.04)  # p >= 0.25
    freq = _frequencies(min_p=0.2)  # p >= 0.1
    assert (freq[:3] > 0).all() and freq[3] == 0


def test_top_k_keeps_the_k_best():
    freq = _frequencies(top_k=3)
    assert (freq[:3] > 0).all() and freq[3] == 0


def test_same_seed_and_position_same_token_whatever_the_other_rows():
    logits = _random_logits(3)
    seeds = [11, 12, 13, 14, 15, 16, 17, 2**40 + 5]
    alone, _ = _run(logits, _params(8, seeds=seeds), positions=np.arange(8, dtype=np.int32))
    others = _random_logits(4)
    others[5] = logits[5]
    mixed = _params(8, seeds=[99, 98, 97, 96, 95, 16, 94, 93])
    again, _ = _run(others, mixed, positions=np.array([0, 0, 0, 0, 0, 5, 0, 0], np.int32))
    assert again[5] == alone[5]
    repeat, _ = _run(logits, _params(8, seeds=seeds), positions=np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(repeat, alone)


def test_key_is_fold_in_of_prngkey_seed_and_position():
    for seed, position in [(0, 0), (7, 3), (2**32 - 1, 100)]:
        ours = row_key(jnp.asarray(seed_words(seed), jnp.uint32), position)
        theirs = jax.random.fold_in(jax.random.PRNGKey(seed), position)
        np.testing.assert_array_equal(jax.random.key_data(ours), theirs)


def test_masked_ids_are_never_chosen_only_when_the_step_says_masked():
    logits = np.tile(np.log(PROBS), (ROWS, 1))
    mask = np.zeros((ROWS, 4), bool)
    mask[:, 0] = True
    on, off = np.ones(ROWS, bool), np.zeros(ROWS, bool)
    sampled, _ = _run(logits, _params(ROWS), mask=mask, masked=on)
    assert (sampled != 0).all() and set(sampled) == {1, 2, 3}
    greedy, _ = _run(logits, _params(ROWS, temperature=0.0), mask=mask, masked=on)
    assert (greedy == 1).all()
    unmasked, _ = _run(logits, _params(ROWS, temperature=0.0), mask=mask, masked=off)
    assert (unmasked == 0).all()


@settings(max_examples=examples(25), deadline=None)
@given(
    seed=st.integers(0, 2**31),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(0, 64),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_drawn_ids_always_survive_every_cut(seed, temperature, top_k, top_p, min_p):
    """Against a sort-based numpy reference (a hair looser at float boundaries): the drawn id is in
    the kept set of every row."""
    logits = _random_logits(seed % 1000)
    mask = np.random.default_rng(seed).random((8, 64)) < 0.2
    tokens, _ = _run(logits, _params(8, temperature, top_k, top_p, min_p, seeds=range(seed, seed + 8)),
                     mask=mask, masked=np.ones(8, bool))
    for row, token in enumerate(tokens):
        z = np.where(mask[row], -np.inf, logits[row] / np.float32(temperature))  # float32, as sampled
        keep = np.isfinite(z)
        if top_k:
            keep &= z >= np.sort(z)[::-1][min(top_k, 64) - 1]
        p = np.where(keep, np.exp(z.astype(np.float64) - z[keep].max()), 0)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass strictly above each id, in rank order
        cutoff = p[order][before < top_p * p.sum() * (1 + 1e-5)].min() if top_p < 1 else 0
        keep &= p >= cutoff * (1 - 1e-5)
        keep &= p >= min_p * p.max() * (1 - 1e-5)
        assert keep[token], (row, token)


def _wide_case() -> tuple[np.ndarray, SlotSampling, np.ndarray]:
    """[8, WIDE] logits and cuts, half of them beyond the cap: top_k > CAP, a flat row whose
    CAP best fall short of top_p, and ties straddling both the cap and a threshold."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (8, WIDE)).astype(np.float32)
    logits[1] = rng.normal(0, 0.3, WIDE)  # flat: the CAP best hold far less than 0.9
    logits[[2, 3]] = 2 + rng.permuted(np.tile(np.arange(WIDE) * 2e-6, (2, 1)), axis=1)  # dense: one bin of the
    # high 16 key bits holds them all, so only the second level of the exact select tells them apart
    logits[4] = np.round(logits[4])  # ties: the 60th to 200th best share a few values
    logits[5] = np.round(logits[5] * 2) / 2
    top_k = np.array([300, 0, 300, 0, 100, 700, 0, 5], np.int32)
    top_p = np.array([1, 0.9, 0.9, 0.95, 1, 1, 0.5, 1], np.float32)
    min_p = np.array([0, 0, 0, 0, 0, 0, 0.2, 0], np.float32)
    temperature = np.array([1, 0.8, 1, 1.3, 1, 1, 0.7, 2], np.float32)
    params = SlotSampling(temperature, top_k, top_p, min_p, np.array([seed_words(s) for s in range(8)], np.uint32))
    mask = np.zeros((8, WIDE), bool)
    mask[:, 5] = True
    return logits, params, mask


UNDERFLOW = 1e-37  # float32's smallest normal is 1.18e-38


def _kept_by_sort(logits, params, mask, slack: float = 0.0) -> np.ndarray:
    """The kept set [B, V] of every cut, from a full sort in numpy (float64 running sums), with
    the top_p and min_p targets moved by the relative `slack` (> 0 keeps more; < 0 also drops the
    ids whose weight float32 cannot hold)."""
    kept = np.zeros(logits.shape, bool)
    for row in range(len(logits)):
        z = np.where(mask[row], -np.inf, logits[row] / params.temperature[row])  # float32, as sampled
        keep = np.isfinite(z)
        desc = np.sort(z[keep])[::-1]
        if params.top_k[row]:
            keep &= z >= desc[min(params.top_k[row], len(desc)) - 1]
        w = np.where(keep, np.exp(z.astype(np.float64) - z[keep].max()), 0)
        if params.top_p[row] < 1:
            order = np.argsort(-z, kind="stable")
            first = np.argmax(np.cumsum(w[order]) >= min(params.top_p[row] * w.sum() * (1 + slack), w.sum()))
            keep &= z >= z[order[first]]
        if params.min_p[row] > 0:
            keep &= w >= params.min_p[row] * (1 - slack)
        if slack < 0:  # float32 weights below its normal range are 0 (flushed) and never kept: an
            keep &= w > UNDERFLOW  # id ~100 nats under the best has no chance in float32 either
        kept[row] = keep
    return kept


@jax.jit
def _wide_kept(logits, params, mask):
    live = jnp.where(mask, -jnp.inf, logits)
    return tuple(sampling._kept_weights(live, params, skip) > 0 for skip in (True, False))


def test_thresholds_beyond_the_cap_are_exact_with_ties_kept():
    logits, params, mask = _wide_case()
    expected = _kept_by_sort(logits, params, mask)
    assert (expected.sum(-1)[[0, 1, 2, 3, 5]] > CAP).all()  # these rows need more than the candidates
    assert expected[4].sum() > 100 and expected[5].sum() > 700  # ties at the top_k boundary are kept
    branched, selected = (np.asarray(k) for k in _wide_kept(logits, params, mask))
    np.testing.assert_array_equal(branched, expected)
    np.testing.assert_array_equal(selected, expected)


@settings(max_examples=examples(15), deadline=None)
@given(
    seed=st.integers(0, 2**31),
    spread=st.sampled_from([0.1, 1.0, 4.0]),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(0, WIDE),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
)
def test_kept_sets_match_a_full_sort_beyond_the_cap(seed, spread, temperature, top_k, top_p, min_p):
    """Both strategies against the sort, within float rounding of the top_p and min_p targets."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, spread, (8, WIDE)).astype(np.float32)
    mask = rng.random((8, WIDE)) < 0.1
    params = _params(8, temperature, top_k, top_p, min_p)
    strict, loose = _kept_by_sort(logits, params, mask, -1e-5), _kept_by_sort(logits, params, mask, 1e-5)
    for kept in _wide_kept(logits, params, mask):
        kept = np.asarray(kept)
        assert (strict <= kept).all() and (kept <= loose).all()


def _both_strategies(skip: bool):
    def step(logits, params, positions, mask, masked, wanted):
        return (*sampling._sample(logits, params, positions, mask, masked, skip=skip),
                *sampling._top_logprobs(logits, wanted, skip=skip))
    return jax.jit(step)


_branch, _select = _both_strategies(True), _both_strategies(False)


def test_computing_and_selecting_gives_what_branching_gives():
    """The GPU strategy (every piece computed, then selected) against the CPU one (a branch skips
    what no row needs), run here on the CPU: the same ids, logprobs and alternatives, also for a
    greedy-only batch and one that asks no alternatives."""
    logits, params, mask = _wide_case()
    positions = np.arange(8, dtype=np.int32) * 7
    greedy = SlotSampling(np.zeros(8, np.float32), params.top_k, params.top_p, params.min_p, params.seed)
    for p, wanted in [(params, np.full(8, 3, np.int32)), (greedy, np.zeros(8, np.int32))]:
        args = (logits, p, positions, mask, np.ones(8, bool), wanted)
        for ours, theirs in zip(_branch(*args), _select(*args)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    ids, logprobs = (np.asarray(x) for x in _select(*args)[2:])
    assert ids.shape == (8, MAX_TOP_LOGPROBS) and not ids.any() and not logprobs.any()  # nobody asked


def _loops(hlo: str) -> tuple[int, int]:
    return len(re.findall(r"\bconditional\(", hlo)), len(re.findall(r"\bwhile\(", hlo))


def test_the_compute_and_select_step_has_no_conditional_and_no_loop_of_its_own():
    """Compiled here, the GPU strategy of sample + top_logprobs has no conditional; its only
    loops are the two that XLA:CPU's threefry lowering rolls (fold_in and the uniform; the GPU
    lowering unrolls them), as a step that draws nothing but the uniforms has."""
    logits, params, mask = _wide_case()
    args = (logits, params, np.zeros(8, np.int32), mask, np.ones(8, bool), np.zeros(8, np.int32))
    compiled = _select.lower(*args).compile().as_text()
    uniforms = jax.jit(jax.vmap(lambda s, p: jax.random.uniform(row_key(s, p))))
    assert _loops(compiled) == (0, _loops(uniforms.lower(params.seed, args[2]).compile().as_text())[1])
    assert _loops(_branch.lower(*args).compile().as_text())[0] > 0  # the check can fail


def test_the_public_functions_lowered_for_gpu_have_no_conditional_and_no_loop():
    """`sample` and `top_logprobs` lowered for CUDA (no GPU needed): no while and no if; the only
    cases are lax.platform_dependent's pick of the strategy, which has a constant index or a single
    branch and which XLA folds away."""
    logits, params, mask = _wide_case()

    def step(logits, params, positions, mask, masked, wanted):
        return sample(logits, params, positions, mask, masked), top_logprobs(logits, wanted)

    args = (logits, params, np.zeros(8, np.int32), mask, np.ones(8, bool), np.zeros(8, np.int32))
    module = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    assert host_syncs(module) == []
    assert any(op.name == "stablehlo.case" for op in stablehlo_ops(module))  # the strategy's pick is there


def test_the_two_stage_top_k_gives_lax_top_k_values_and_ids():
    """The accelerators' top_logprobs (and gpu_check's sampler table) take two_stage_top_k for
    lax.top_k: the same values and ids, ties to the lower id, across pieces of 16 (k 17 and 37;
    MAX_TOP_LOGPROBS through top_logprobs in test_computing_and_selecting_gives_what_branching_gives),
    a ragged last chunk, and NaNs and infinities ranked as lax.top_k ranks them."""
    rng = np.random.default_rng(0)
    x = rng.integers(-40, 40, size=(4, 5000)).astype(np.float32) / 4  # many ties, a ragged last chunk
    x[1, 4990:] = 100.0  # the best ids in the padded chunk
    x[2, :4980] = -np.inf  # fewer than 20 finite ids: -inf ties to the lower id
    x[2, [100, 200]] = [np.nan, -np.nan]
    x[3, ::7] = np.nan
    for k in (1, 17, 37):  # one piece, 16 + 1, 16 + 16 + 5
        want_v, want_i = jax.lax.top_k(jnp.asarray(x), k)
        got_v, got_i = jax.jit(sampling.two_stage_top_k, static_argnums=(1, 2))(jnp.asarray(x), k, 512)
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i), err_msg=f"k={k}")
        np.testing.assert_array_equal(np.asarray(got_v).view(np.uint32), np.asarray(want_v).view(np.uint32))


def test_the_threshold_search_finds_what_the_exact_select_finds():
    """`_searched_floor` (accelerators) against `_exact_floor` (the CPU beyond its cap): the
    same threshold for counts and for weights whose sums are exact (small integers), at targets
    on and between the boundaries, on rows with ties and on a row of one repeated value."""
    rng = np.random.default_rng(3)
    z = np.round(rng.normal(0, 2, (6, 700)), 1).astype(np.float32)  # many ties
    z[5] = 1.5
    keys = sampling._sortable(jnp.asarray(z))
    weights = rng.integers(0, 5, (6, 700)).astype(np.float32)
    counts = np.array([1, 2, 50, 333, 699, 700], np.int32)
    masses = np.array([0.5, 1, 17, 400, weights[4].sum(), 9], np.float32)
    search = jax.jit(sampling._searched_floor)
    np.testing.assert_array_equal(np.asarray(search(keys, None, counts)),
                                  np.asarray(sampling._exact_floor(keys, None, counts.astype(np.float32), False)))
    np.testing.assert_array_equal(np.asarray(search(keys, jnp.asarray(weights), masses)),
                                  np.asarray(sampling._exact_floor(keys, jnp.asarray(weights), masses, False)))
    kth = np.sort(np.asarray(keys), axis=-1)[:, ::-1][np.arange(6), counts - 1]  # the k-th best key
    np.testing.assert_array_equal(np.asarray(search(keys, None, counts)), kth)
