"""benchmarks/speculative_replay.py's bounds (`--oracle`), on which docs/benchmarks.md's table of
what any proposer could give rests: the oracle that knows the answer never has a guess rejected
and guesses at every step; the lookup oracle guesses an id only where it continues an earlier
run of `lookup` ids, so an answer of new ids gets no guess, and a copied one all but its start."""

from __future__ import annotations

from benchmarks.speculative_replay import EOS, _Oracle, replay
from engine.core.speculation.ngram import NgramProposer
from engine.core.speculation.policy import SpeculationPolicy

COST = {1: 1.2, 2: 1.4, 4: 2.0}
PROMPT = list(range(100, 160))
CAP = 64


def _run(output: list[int], proposer) -> tuple[float, dict]:
    return replay(PROMPT, output, CAP, SpeculationPolicy(4, 1), COST, 0.5, proposer)


def test_the_oracle_guesses_at_every_step_and_is_never_wrong():
    output = [7, 8, 9] + PROMPT[:40] + [11, 12]  # new ids, a copy, new ids, then EOS
    time, counts = _run(output, _Oracle(PROMPT, output + [EOS]))
    assert counts["accepted"] == counts["proposed"] > 0 and counts["plain"] == 0
    # every verify step takes its 4 guesses and a sample: the 45 samples after prefill's, EOS the last
    assert counts["verify"] == len(output) // 5 and time == counts["verify"] * (COST[4] + 0.5)
    assert replay(PROMPT, output, CAP, None, COST, 0.5)[0] == len(output)  # plain decoding: a step a sample


def test_the_lookup_oracle_guesses_only_what_an_earlier_run_continues():
    new = list(range(300, 340))  # never in the prompt, never repeated
    _, counts = _run(new, _Oracle(PROMPT, new + [EOS], 3))
    assert counts["verify"] == counts["proposed"] == 0 and counts["plain"] == len(new)
    copy = PROMPT[10:50]  # a copy of the prompt from its 11th id on
    _, counts = _run(copy, _Oracle(PROMPT, copy + [EOS], 3))
    assert counts["accepted"] == counts["proposed"] >= len(copy) - 3 - 2 * counts["verify"]
    ngram = _run(copy, NgramProposer())[1]  # the real proposer finds the same copy, less exactly
    assert 0 < ngram["accepted"] <= counts["accepted"]
