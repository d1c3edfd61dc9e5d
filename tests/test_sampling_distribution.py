"""Each sampler draws from its reference distribution (issue 42): temperature, top_k, top_p, min_p
and all of them at once, on fixed logits over V ids, for both strategies of
engine.jax_backend.sampling (the CPU's capped candidates and branches; the accelerators' threshold
searches, computed and selected), both run here on the CPU.

What must hold, per case: the kept set is exactly a float64 sort-based reference's, ties at the
top_k and top_p boundaries kept; no id outside it is ever drawn; DRAWS draws (one per seed, one
batched call per strategy) pass a chi-square test against the reference's renormalised
probabilities; both strategies draw the same ids; the same seed and position draw the same id
again, and the draws are those of the sampler before the accelerators' thresholds (pinned).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from engine.jax_backend import sampling
from engine.jax_backend.sampling import SlotSampling, seed_words

V = 200
PINNED = [141, 23, 23, 86, 23, 86, 97, 122, 185, 37, 133, 122, 141, 42, 122, 23, 82, 97, 109, 37]  # see the last test
DRAWS = 4096  # per case: every kept id of every case is expected >= 5 times or pooled
CASES = {  # name: (temperature, top_k, top_p, min_p)
    "temperature 0.7": (0.7, 0, 1.0, 0.0),
    "top_k 10, tie at the 10th": (1.0, 10, 1.0, 0.0),
    "top_p 0.8, tie at the boundary": (1.2, 0, 0.8, 0.0),
    "min_p 0.1": (0.9, 0, 1.0, 0.1),
    "all four": (1.5, 40, 0.9, 0.05),
}


def _logits() -> np.ndarray:
    """[V] logits with a tie at the 10th best (top_k 10 keeps 11) and one at the top_p 0.8 boundary."""
    z = np.sort(np.random.default_rng(42).normal(0, 1.5, V).astype(np.float32))[::-1].copy()
    z[10] = z[9]  # the 10th and 11th best tie
    boundary = int(np.argmax(np.cumsum(_probs(z, 1.2)) >= 0.8))  # top_p 0.8's last kept rank
    z[boundary + 1] = z[boundary]  # the next id ties with it: kept too
    return np.random.default_rng(0).permutation(z)  # ids in no particular order


def _probs(z: np.ndarray, temperature: float) -> np.ndarray:
    w = np.exp((z / np.float32(temperature)).astype(np.float64) - (z / np.float32(temperature)).max())
    return w / w.sum()


def _reference(z: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The probabilities [V] after every cut, renormalised, from a full sort in float64 (the
    tempered logits in float32, as sampled). Refuses a top_p within rounding of a boundary, where
    float32 sums may decide either way."""
    t = z / np.float32(temperature)
    keep = np.ones(V, bool)
    if top_k:
        keep &= t >= np.sort(t)[::-1][top_k - 1]
    w = np.where(keep, np.exp(t.astype(np.float64) - t.max()), 0.0)
    if top_p < 1:
        order = np.argsort(-t, kind="stable")
        mass = np.cumsum(w[order]) / w.sum()
        last = int(np.argmax(mass >= top_p))
        assert abs(mass[last] - top_p) > 1e-4 and abs(mass[last - 1] - top_p) > 1e-4, "top_p on a boundary"
        keep &= t >= t[order[last]]
    if min_p:
        assert np.abs(w / w.max() - min_p).min() > 1e-4, "min_p on a boundary"
        keep &= w >= min_p * w.max()
    p = np.where(keep, w, 0.0)
    return p / p.sum()


def _batch() -> tuple[np.ndarray, SlotSampling, np.ndarray]:
    """DRAWS rows per case, case after case: logits [N, V], params, positions [N]."""
    n = DRAWS * len(CASES)
    columns = np.repeat(np.array(list(CASES.values()), np.float64), DRAWS, axis=0)  # [N, 4]
    params = SlotSampling(
        columns[:, 0].astype(np.float32), columns[:, 1].astype(np.int32), columns[:, 2].astype(np.float32),
        columns[:, 3].astype(np.float32), np.array([seed_words(s) for s in range(n)], np.uint32),
    )
    return np.tile(_logits(), (n, 1)), params, np.arange(n, dtype=np.int32) % 97


def _strategy(skip: bool):
    def draw(logits, params, positions):
        n = logits.shape[0]
        no_mask = (jnp.zeros(logits.shape, bool), jnp.zeros(n, bool))
        tokens, _ = sampling._sample(logits, params, positions, *no_mask, skip=skip)
        kept = sampling._kept_weights(logits, params, skip) > 0  # [N, V]
        return tokens, kept[::DRAWS]  # one kept set per case

    return jax.jit(draw)


@pytest.fixture(scope="module")
def drawn() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per strategy: the ids [N] drawn and the kept sets [cases, V]."""
    batch = _batch()
    return {name: tuple(np.asarray(a) for a in _strategy(skip)(*batch)) for name, skip in
            [("branch (CPU)", True), ("compute and select (accelerators)", False)]}


@pytest.mark.parametrize("strategy", ["branch (CPU)", "compute and select (accelerators)"])
def test_each_case_keeps_the_reference_set_and_draws_its_distribution(drawn, strategy):
    tokens, kept = drawn[strategy]
    z = _logits()
    for i, (name, case) in enumerate(CASES.items()):
        p = _reference(z, *case)
        np.testing.assert_array_equal(kept[i], p > 0, err_msg=name)
        counts = np.bincount(tokens[i * DRAWS:(i + 1) * DRAWS], minlength=V)
        assert not counts[p == 0].any(), name  # nothing outside the kept set, ever
        expected = DRAWS * p[p > 0]
        observed = counts[p > 0]
        rare = expected < 5  # pooled into one bin, as chi-square wants
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
        if expected[-1] == 0:
            expected, observed = expected[:-1], observed[:-1]
        assert stats.chisquare(observed, expected).pvalue > 1e-3, name


def test_the_ties_at_the_boundaries_are_kept_and_drawn(drawn):
    z = _logits()
    tokens, kept = drawn["branch (CPU)"]
    assert kept[1].sum() == 11  # top_k 10 with the 10th and 11th tied
    tied = np.flatnonzero(z == np.sort(z)[::-1][9])
    assert len(tied) == 2 and np.isin(tied, tokens[DRAWS:2 * DRAWS]).all()
    t = z / np.float32(1.2)
    last = t[kept[2]].min()  # top_p's boundary value: two ids hold it
    assert (t == last).sum() == 2 and np.isin(np.flatnonzero(t == last), tokens[2 * DRAWS:3 * DRAWS]).all()


def test_both_strategies_draw_the_same_ids(drawn):
    np.testing.assert_array_equal(drawn["branch (CPU)"][0], drawn["compute and select (accelerators)"][0])


def test_a_seed_draws_again_what_it_drew_and_what_the_sampler_drew_before_issue_42(drawn):
    """The same seed and position, the same id, in a batch of another size; and the first draws
    of each case pinned as the sampler before the accelerators' threshold search drew them
    (commit 01d02ab, whose CPU and accelerator strategies agreed): the draw itself is unchanged."""
    logits, params, positions = _batch()
    rows = np.arange(0, len(positions), DRAWS // 4)  # 4 rows per case
    few = SlotSampling(*(np.asarray(a)[rows] for a in jax.tree.leaves(params)))
    again = _strategy(False)(logits[rows], few, positions[rows])[0]
    np.testing.assert_array_equal(np.asarray(again), drawn["branch (CPU)"][0][rows])
    np.testing.assert_array_equal(drawn["branch (CPU)"][0][rows], PINNED)
