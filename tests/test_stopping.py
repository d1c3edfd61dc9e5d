"""The one decision, without any model: a table of cases and a property over random streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from engine.core.events import FinishReason
from engine.core.request import StoppingCriteria
from engine.core.stopping import Decision, StopRule, decide, resolve

EOS = frozenset({2})
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH

TABLE = [
    # token, emitted so far, control ids, cap -> decision
    (5, 0, {2}, 3, Decision(emit=True)),
    (5, 2, {2}, 3, Decision(emit=True, finish=LENGTH)),  # reaches the cap: real output
    (2, 0, {2}, 3, Decision(emit=False, finish=STOP, stop_token_id=2)),  # control at prefill
    (2, 2, {2}, 3, Decision(emit=False, finish=STOP, stop_token_id=2)),  # control at the cap: STOP wins
    (5, 0, {2}, 1, Decision(emit=True, finish=LENGTH)),  # N = 1 finishes on the prefill token
    (2, 0, {2}, 1, Decision(emit=False, finish=STOP, stop_token_id=2)),
    (7, 1, {2, 7}, 9, Decision(emit=False, finish=STOP, stop_token_id=7)),  # a stop id
    (2, 1, set(), 9, Decision(emit=True)),  # ignore_eos: EOS is ordinary
]


@pytest.mark.parametrize("token,emitted,control,cap,expected", TABLE)
def test_decision_table(token, emitted, control, cap, expected):
    assert decide(token, emitted, StopRule(frozenset(control), cap)) == expected


def test_resolve_unions_eos_and_stop_ids_and_fills_the_cap():
    rule = resolve(StoppingCriteria(stop_token_ids=frozenset({9})), EOS, prompt_len=10, max_context_length=64)
    assert rule.control_token_ids == {2, 9} and rule.max_output_tokens == 54
    rule = resolve(StoppingCriteria(9, frozenset({9}), ignore_eos=True), EOS, 10, 64)
    assert rule.control_token_ids == {9} and rule.max_output_tokens == 9


def test_resolve_refuses_a_full_context():
    with pytest.raises(ValueError):
        resolve(StoppingCriteria(), EOS, prompt_len=64, max_context_length=64)


def test_min_output_tokens_masks_only_below_the_minimum():
    rule = resolve(StoppingCriteria(10, min_output_tokens=2), EOS, 5, 64)
    assert [rule.masks_control_tokens(n) for n in range(4)] == [True, True, False, False]
    assert not resolve(StoppingCriteria(10, ignore_eos=True, min_output_tokens=2), EOS, 5, 64).masks_control_tokens(0)


def run_stream(tokens: list[int], rule: StopRule):
    """What the engine does with a stream of sampled ids: decide each until finished."""
    emitted: list[int] = []
    for token in tokens:
        d = decide(token, len(emitted), rule)
        if d.emit:
            emitted.append(token)
        if d.finish is not None:
            return emitted, d
    return emitted, None


@settings(max_examples=examples(500), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 20), min_size=1, max_size=40),
    eos=st.frozensets(st.integers(0, 20), max_size=3),
    stop_ids=st.frozensets(st.integers(0, 20), max_size=3),
    ignore_eos=st.booleans(),
    cap=st.one_of(st.none(), st.integers(1, 30)),
    prompt_len=st.integers(1, 20),
)
def test_invariants_over_random_streams(tokens, eos, stop_ids, ignore_eos, cap, prompt_len):
    context = 48
    rule = resolve(StoppingCriteria(cap, stop_ids, ignore_eos), eos, prompt_len, context)
    control = stop_ids | (frozenset() if ignore_eos else eos)
    emitted, final = run_stream(tokens, rule)
    n = rule.max_output_tokens
    assert n == min(cap if cap is not None else context - prompt_len, context - prompt_len)
    # no control token is ever emitted, and nothing past the cap
    assert not set(emitted) & control
    assert len(emitted) <= n
    first_control = next((i for i, t in enumerate(tokens) if t in control), None)
    if first_control is not None and first_control < n:
        # a control token within the first n samples: STOP, everything before it emitted
        assert final.finish == STOP and final.stop_token_id == tokens[first_control]
        assert emitted == tokens[:first_control]
    elif len(tokens) >= n:
        # no control token in time: exactly n tokens, LENGTH
        assert final.finish == LENGTH and final.stop_token_id is None
        assert emitted == tokens[:n]
    else:
        assert final is None and emitted == tokens
    # ignore_eos: EOS ids that are not stop ids are ordinary output
    if ignore_eos:
        assert not (eos - stop_ids) & rule.control_token_ids
