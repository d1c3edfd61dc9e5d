"""Speculative decoding (issue 45) on the scripted model: the n-gram proposer, the policy, and the
scheduler's verify step, which must leave the stream contract exactly as plain decoding has it.

The scripted model verifies by its script (after t comes t + 1), so what a run accepts is worked
out by hand. `Script` is a test proposer that knows the script (it guesses t + 1, t + 2, ...,
wrong where told), so runs are as long as the test wants; the n-gram proposer gets its hits from
prompts that already hold the ids the output will count through (copy-heavy prompts).
The servers' stream-invariant checks (tests/test_fuzz.py) run with speculation on in
tests/test_speculative_stream.py.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.engine import Engine, EngineConfig
from engine.core.events import Finished, FinishReason, Token
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from engine.core.speculation.ngram import NgramProposer
from engine.core.speculation.policy import SpeculationPolicy
from support.examples import examples
from support.recording_sink import Recorder
from support.waiting import until_sync

VOCAB = 100


class Script:
    """A proposer that knows the scripted model: after t it guesses t + 1, t + 2, ..., except that
    the guess at index `wrong_at` (of each proposal) is off by one."""

    name = "script"

    def __init__(self, wrong_at: int | None = None) -> None:
        self.wrong_at = wrong_at
        self.asked: list[int] = []  # k of each row asked, in order

    def open(self, ids):
        return list(ids)

    def propose(self, rows):
        out = []
        for history, k in rows:
            self.asked.append(k)
            guesses = [(history[-1] + 1 + i + (i == self.wrong_at)) % VOCAB for i in range(k)]
            out.append(tuple(guesses))
        return out

    def close(self, history) -> None:
        pass


class _ListHistory(list):
    def extend(self, ids):  # (list.extend, named as History wants)
        super().extend(ids)


def run(requests, *, proposer=None, speculation="ngram", model=None, **config) -> tuple[list[Recorder], Engine]:
    """Serve `requests` at once on a fresh engine; every stream to its end."""
    model = model or ScriptedModel(vocab_size=VOCAB, max_batch_size=4, max_context_length=64, max_guesses=4, page_size=4)
    engine = Engine(model, EngineConfig(speculation=speculation, **config), proposer=proposer)
    engine.start()
    try:
        sinks = [Recorder() for _ in requests]
        for request, sink in zip(requests, sinks):
            engine.submit(request, sink)
        for sink in sinks:
            assert sink.done.wait(10) and sink.error is None, sink.error
        until_sync(lambda: engine.stats().slots_in_use == 0, "every slot freed")
        assert model.slots_held == 0
        return sinks, engine
    finally:
        engine.stop()


def request(prompt, n=None, logprobs=False, **stopping) -> Request:
    return Request("r", tuple(prompt), SamplingParams(), StoppingCriteria(n, **stopping), return_logprobs=logprobs)


def finish(sink: Recorder) -> Finished:
    return sink.batches[-1][-1]


# -- the n-gram proposer ------------------------------------------------------------------------


def test_copy_heavy_text_gets_long_guesses_and_no_match_gets_none():
    proposer = NgramProposer(shortest=1)
    copied = proposer.open([5, 6, 7, 8, 9, 10, 11, 12, 1, 5, 6])  # "5 6" was followed by 7 8 9 ...
    fresh = proposer.open([5, 6, 7, 8, 9, 10, 11, 12])  # its last id never came before
    assert proposer.propose([(copied, 4), (fresh, 4), (copied, 0)]) == [(7, 8, 9, 10), (), ()]
    copied.extend([7, 8, 9, 10, 11, 12])  # at the end of what it copied: the rest of the sequence follows
    assert copied.guess(8) == (1, 5, 6, 7, 8, 9, 10, 11)


def test_by_default_a_copy_starts_from_three_ids_and_is_followed_id_by_id():
    """A source is looked up from the last 3 or 4 ids (one or two ids match everywhere in prose,
    docs/speculative.md); once followed, a copy goes on one id at a time."""
    history = NgramProposer().open([4, 6, 7, 5, 6, 7])
    assert history.guess(2) == ()  # "6 7" occurred, but no 3 ids did
    history.extend([5, 6])  # ... 5 6 7 5 6: "7 5 6" occurred, followed by 7
    assert history.guess(3) == (7, 5, 6) and history.following()
    history.extend([7, 5])
    assert history.guess(1) == (6,)


def test_the_longest_suffix_wins_then_the_latest_occurrence_then_one_id():
    history = NgramProposer(shortest=1).open([1, 2, 3, 9, 2, 3, 7, 4, 2, 3, 8, 1, 2, 3])
    assert history.guess(2) == (9, 2)  # "1 2 3" (3 ids) beats the later "2 3"s
    history = NgramProposer(shortest=1).open([2, 3, 7, 4, 2, 3, 8, 5, 2, 3])
    assert history.guess(1) == (8,)  # of the "2 3"s, the latest
    history = NgramProposer(shortest=1).open([4, 6, 7, 5, 6])
    assert history.guess(2) == (7, 5)  # no 2-gram: the one id 6, followed by 7
    assert NgramProposer(shortest=2).open([4, 6, 7, 5, 6]).guess(2) == ()


def test_a_copy_is_followed_while_it_holds_even_where_a_later_occurrence_differs():
    # the passage 9 1 2 3 4 5, then 8 1 2 3 4 7; the sequence starts copying the first from its 9
    history = NgramProposer(shortest=1).open([9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 7, 0, 9])
    assert history.guess(2) == (1, 2)  # only the one id 9 occurred before
    history.extend([1, 2, 3, 4])
    assert history.following() and history.guess(2) == (5, 8)  # the passage it follows goes on 5
    assert NgramProposer(shortest=1).open(history.ids).guess(2) == (7, 0)  # where the latest "1 2 3 4" went on
    history.extend([6])  # not the 5 of its source: the copy is dropped, and 6 occurred nowhere
    assert not history.following() and history.guess(1) == ()
    history.extend([8])
    assert history.guess(3) == (1, 2, 3)  # a fresh lookup: the one id 8


def _rescan(ids: list[int], k: int, shortest: int = 1, longest: int = 4) -> tuple[int, ...]:
    """What the index must answer, found by scanning the whole sequence."""
    for n in range(min(longest, len(ids)), shortest - 1, -1):
        suffix = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):  # latest first, not the suffix itself
            if ids[start : start + n] == suffix:
                return tuple(ids[start + n : start + n + k])
    return ()


@settings(max_examples=examples(200), deadline=None)
@given(ids=st.lists(st.integers(0, 4), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=5), k=st.integers(1, 6))
def test_the_incremental_index_answers_as_a_rescan_would(ids, cuts, k):
    history = NgramProposer(shortest=1).open(ids[: min(cuts, default=0)])
    for end in sorted(cuts) + [len(ids)]:
        history.extend(ids[len(history.ids) : max(end, len(history.ids))])
        assert NgramProposer(shortest=1).open(history.ids).guess(k) == _rescan(history.ids, k)
        assert history.lookup() == NgramProposer(shortest=1).open(history.ids).lookup()


@settings(max_examples=examples(200), deadline=None)
@given(ids=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 4))
def test_a_followed_copy_still_guesses_what_came_after_an_earlier_occurrence(ids, k):
    """Guessing at every id: each guess is what followed some earlier occurrence of the last id,
    as long as k allows or the sequence goes, and there is one wherever a fresh lookup finds one."""
    history = NgramProposer(shortest=1).open(ids[:1])
    for token in ids[1:] + [None]:
        guess, known = history.guess(k), history.ids
        assert any(known[s - 1] == known[-1] and tuple(known[s : s + k]) == guess for s in range(1, len(known))) \
            if guess else not _rescan(known, k)
        if token is not None:
            history.extend([token])


# -- the policy ---------------------------------------------------------------------------------


def test_guesses_shrink_as_the_batch_grows_and_stop_above_its_limit():
    policy = SpeculationPolicy(guesses=4, max_batch=4)
    assert [policy.guesses_for(rows) for rows in range(1, 7)] == [4, 2, 1, 1, 0, 0]


def test_a_row_that_gains_nothing_rests_longer_each_time_and_one_that_gains_keeps_going():
    policy = SpeculationPolicy(guesses=4, max_batch=4, rest_steps=2)
    row = policy.row(history=[], seen=0)
    for _ in range(5):
        policy.observe(row, 4, 3)
    assert not policy.rest(row)
    policy.observe(row, 4, 0)
    policy.observe(row, 4, 0)  # twice nothing: it rests 2 steps
    assert [policy.rest(row) for _ in range(3)] == [True, True, False]
    policy.observe(row, 4, 0)
    policy.observe(row, 4, 0)  # its retry failed too: 4 steps
    assert [policy.rest(row) for _ in range(5)] == [True] * 4 + [False]


# -- the scheduler: exact output, the stream contract ------------------------------------------


def test_runs_go_out_as_one_message_each_and_the_cap_is_exact():
    proposer = Script()
    (sink,), engine = run([request([10], 8)], proposer=proposer)
    assert sink.tokens == list(range(11, 19))
    # prefill; a run of 4 guesses + 1; the cap leaves room for 1 guess: a run of 2 and the finish
    assert [[type(e).__name__ for e in b] for b in sink.batches] == [
        ["Token"], ["Token"] * 5, ["Token", "Token", "Finished"]]
    assert proposer.asked == [4, 1]
    end = finish(sink)
    assert (end.reason, end.usage.completion_tokens) == (FinishReason.LENGTH, 8)
    stats = engine.stats().speculation
    assert (stats.proposer, stats.proposed, stats.accepted, stats.steps) == ("script", 5, 5, 2)
    assert engine.model.decode_steps == 0


@pytest.mark.parametrize("last, stopping, tokens, stop_id", [
    (97, {}, [98, 99, 0, 1], 2),  # EOS (2) inside an accepted run: never sent, the rest dropped
    (96, {}, [97, 98, 99, 0, 1], 2),  # EOS as the run's last sample
    (40, {"stop_token_ids": (43,)}, [41, 42], 43),  # a stop id inside the run
    (97, {"ignore_eos": True, "stop_token_ids": (4,)}, [98, 99, 0, 1, 2, 3], 4),
])
def test_control_ids_inside_an_accepted_run_are_never_sent_nor_counted(last, stopping, tokens, stop_id):
    (sink,), _ = run([request([last], 30, **stopping)], proposer=Script())
    assert sink.tokens == tokens
    end = finish(sink)
    assert (end.reason, end.stop_token_id, end.usage.completion_tokens) == (FinishReason.STOP, stop_id, len(tokens))


def test_a_wrong_guess_ends_the_run_with_the_models_own_sample():
    proposer = Script(wrong_at=2)  # guesses t+1, t+2, t+4, ...: two accepted, then the model's t+3
    (sink,), engine = run([request([10], 12, logprobs=True)], proposer=proposer)
    assert sink.tokens == list(range(11, 23))
    assert [len(b) for b in sink.batches][:3] == [1, 3, 3]
    assert all(t.logprob == -(t.id % 10) / 10 for b in sink.batches for t in b if isinstance(t, Token))
    assert proposer.asked == [4, 4, 4, 1]  # the last: one more token to the cap, one guess
    stats = engine.stats().speculation
    assert (stats.proposed, stats.accepted, stats.steps) == (13, 2 + 2 + 2 + 1, 4)


def test_below_min_output_tokens_a_run_never_crosses_the_end_of_the_mask():
    """Below min_output_tokens EOS is masked; one `masked` holds for a whole run, so no run may
    span the mask's end: the output is plain decoding's (EOS skipped below 3 tokens, then sent)."""
    (sink,), _ = run([request([99], 10, min_output_tokens=3)], proposer=Script())
    plain, _ = run([request([99], 10, min_output_tokens=3)], speculation="off")
    assert sink.tokens == plain[0].tokens == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10]


class PastTheVocabulary(Script):
    """Guesses right, but its third guess is an id the model does not have."""

    def propose(self, rows):
        return [guesses[:2] + (VOCAB + 5,) + guesses[3:] for guesses in super().propose(rows)]


def test_a_proposers_id_outside_the_vocabulary_never_reaches_the_model():
    """The guesses before it are checked; the scripted model would raise on the bad id."""
    (sink,), engine = run([request([10], 10)], proposer=PastTheVocabulary())
    assert sink.tokens == list(range(11, 21))
    assert all(k <= 2 for kind, rows in (c[:2] for c in engine.model.calls) if kind == "verify" for _, k in rows)


class GatedVerify(ScriptedModel):
    """The scripted model, with each verify step held until the test opens the gate."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def verify(self, inputs):
        self.entered.set()
        assert self.gate.wait(10)
        return super().verify(inputs)


def test_a_request_cancelled_during_its_verify_step_gets_nothing_more_and_frees_its_slot():
    model = GatedVerify(vocab_size=VOCAB, max_batch_size=2, max_context_length=64, max_guesses=4, page_size=4)
    engine = Engine(model, EngineConfig(speculation="ngram"), proposer=Script())
    engine.start()
    try:
        sink = Recorder()
        ticket = engine.submit(request([10], 30), sink)
        assert model.entered.wait(5)
        sent = len(sink.batches)
        engine.abort(ticket)
        model.gate.set()
        until_sync(lambda: engine.stats().slots_in_use == 0, "the slot freed")
        assert model.slots_held == 0 and len(sink.batches) == sent and not sink.done.is_set()
    finally:
        model.gate.set()
        engine.stop()


def test_a_row_whose_guesses_all_fail_rests_then_tries_again():
    proposer = Script(wrong_at=0)  # every first guess wrong: nothing is ever accepted
    (sink,), engine = run([request([10], 60)], proposer=proposer)
    assert sink.tokens == list(range(11, 71))
    kinds = "".join(call[0][0] for call in engine.model.calls[1:])  # v: verify, d: plain decode
    assert kinds.startswith("vv" + "d" * 4 + "vv" + "d" * 8 + "vv" + "d" * 16), kinds  # rests of 4, 8, then 16 steps


class AheadScript(Script):
    """`Script` as a proposer that guesses ahead (`Proposer.guesses_ahead`): asked for k + 1 from a
    history one id short, its first guess stands for the id in flight. `shift` moves every guess
    on by that much (1: the stand-in is wrong, and so is all that follows it)."""

    guesses_ahead = True

    def __init__(self, wrong_at: int | None = None, shift: int = 0) -> None:
        super().__init__(wrong_at)
        self.shift = shift

    def propose(self, rows):
        return [tuple((g + self.shift) % VOCAB for g in guesses) for guesses in super().propose(rows)]


class StepsInFlight(ScriptedModel):
    """The scripted model, recording at each verify how many dispatched steps were not yet collected."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.in_flight = 0
        self.at_verify: list[int] = []

    def dispatch(self, *args, **kw) -> None:
        super().dispatch(*args, **kw)
        self.in_flight += 1

    def collect(self):
        self.in_flight -= 1
        return super().collect()

    def verify(self, inputs):
        self.at_verify.append(self.in_flight)
        return super().verify(inputs)


def in_flight_model() -> StepsInFlight:
    return StepsInFlight(vocab_size=VOCAB, max_batch_size=2, max_context_length=64, max_guesses=4, page_size=4)


def test_an_ahead_guess_is_verified_behind_the_step_in_flight_and_the_output_is_plain_decodings():
    """Every first guess wrong: the verifies after a read fail and the row rests; its retry comes
    with a step in flight, and ahead the wrong first guess is the dropped stand-in, so the ids
    fed after the one in flight are right and accepted, with nothing read before that verify."""
    model = in_flight_model()
    (sink,), engine = run([request([10], 40)], proposer=AheadScript(wrong_at=0), model=model)
    assert sink.tokens == list(range(11, 51))
    assert model.at_verify[:2] == [0, 0] and 1 in model.at_verify, model.at_verify
    # after a read every guess is wrong: what was accepted, in runs of several tokens, was ahead
    assert max(sum(isinstance(e, Token) for e in b) for b in sink.batches) > 1
    assert engine.stats().speculation.accepted > 0


def test_a_wrong_stand_in_costs_its_guesses_and_nothing_else():
    """A proposer one id off: ahead, its stand-in for the id in flight is wrong and so are the ids
    fed after it; the model rejects them, and the output is plain decoding's."""
    model = in_flight_model()
    (sink,), engine = run([request([10], 40, stop_token_ids=(45,))], proposer=AheadScript(shift=1), model=model)
    plain, _ = run([request([10], 40, stop_token_ids=(45,))], speculation="off")
    assert [e for b in sink.batches for e in b] == [e for b in plain[0].batches for e in b]
    assert 1 in model.at_verify and engine.stats().speculation.accepted == 0


class GuessesAfter(AheadScript):
    """Guesses ahead only once its history ends in `trigger` (the step in flight then samples
    trigger + 1); nothing before, so the steps up to there are plain and pipelined."""

    def __init__(self, trigger: int) -> None:
        super().__init__()
        self.trigger = trigger

    def propose(self, rows):
        return [g if history[-1] == self.trigger else () for g, (history, _) in zip(super().propose(rows), rows)]


@pytest.mark.parametrize("prompt, stopping, tokens", [
    ([10], {"stop_token_ids": (29,)}, list(range(11, 29))),  # the step in flight samples the stop id 29
    ([90], {}, list(range(91, 100)) + [0, 1]),  # ... EOS (2)
])
def test_a_row_the_step_in_flight_finishes_drops_the_run_verified_behind_it(prompt, stopping, tokens):
    """The verify enqueued behind a step in flight that finishes the row ran for nothing: its
    run (right guesses, accepted) is dropped, nothing follows the finish, and the slot is freed."""
    model = in_flight_model()
    (sink,), engine = run([request(prompt, 40, **stopping)], proposer=GuessesAfter(tokens[-1]), model=model)
    assert model.at_verify == [1]  # the one verify, behind the step that finished the row
    assert sink.tokens == tokens
    end = finish(sink)
    assert (end.reason, end.usage.completion_tokens) == (FinishReason.STOP, len(tokens))
    assert sink.batches[-1] == [end]  # the finish alone: the dropped run sent nothing
    assert engine.stats().speculation.steps == 1


def test_an_ahead_verify_masks_control_ids_from_the_output_index_after_the_step_in_flight():
    """min_output_tokens 11: EOS (2) is masked for the first 11 tokens and allowed at index 11. The
    verify behind the step in flight (which samples index 10, id 1) samples index 11 first, so it
    must not mask: EOS ends the output there, as in plain decoding (a mask counted from the ids
    the host has read would skip it to 3)."""
    model = in_flight_model()
    req = request([90], 30, min_output_tokens=11)
    (sink,), _ = run([req], proposer=GuessesAfter(0), model=model)
    plain, _ = run([req], speculation="off")
    assert model.at_verify == [1]
    assert sink.tokens == plain[0].tokens == list(range(91, 100)) + [0, 1]
    assert finish(sink) == finish(plain[0]) and finish(sink).reason == FinishReason.STOP


def test_a_batch_shares_its_guesses_and_above_the_limit_does_not_speculate():
    model = ScriptedModel(vocab_size=VOCAB, max_batch_size=4, max_context_length=64, max_guesses=4, page_size=4)
    caps = [6, 12, 24, 40]  # four rows, then three, two, one as they end
    sinks, _ = run([request([10 * i + 10], cap) for i, cap in enumerate(caps)], proposer=Script(), model=model,
                   speculation_max_batch=3)
    assert [s.tokens for s in sinks] == [list(range(10 * i + 11, 10 * i + 11 + cap)) for i, cap in enumerate(caps)]
    verifies = [rows for kind, rows in (c[:2] for c in model.calls) if kind == "verify"]
    assert all(len(rows) <= 3 and max(k for _, k in rows) <= 4 // len(rows) for rows in verifies), verifies
    assert {(len(rows), max(k for _, k in rows)) for rows in verifies} >= {(3, 1), (2, 2), (1, 4)}, verifies
    assert any(len(slots) == 4 for kind, slots in (c[:2] for c in model.calls) if kind == "decode")


def test_guesses_short_of_pages_are_fewer_and_preempt_nobody():
    """A pool with one page to spare beyond the reserve: guesses past it are cut (the scripted
    model raises if a guess is written past its table), and nobody is preempted for them."""
    def model():
        return ScriptedModel(vocab_size=VOCAB, max_batch_size=2, max_context_length=64, max_guesses=4, page_size=4,
                             kv_cache_tokens=40)
    requests = [request(list(range(11, 30)) + [10], 18), request(list(range(51, 58)) + [50], 10)]
    sinks, engine = run(requests, model=model())
    plain, plain_engine = run(requests, model=model(), speculation="off")
    assert [s.tokens for s in sinks] == [s.tokens for s in plain]
    assert engine.stats().preemptions == plain_engine.stats().preemptions
    assert engine.stats().speculation.accepted > 0


copy_heavy = st.builds(
    lambda start, length, lead, tail: list(range(start, start + length)) + tail + [lead if lead is not None else start - 1],
    st.integers(1, VOCAB - 1), st.integers(0, 12), st.none() | st.integers(0, VOCAB - 1),
    st.lists(st.integers(0, VOCAB - 1), max_size=3),
)


@settings(max_examples=examples(40), deadline=None)
@given(
    prompts=st.lists(copy_heavy, min_size=1, max_size=3),
    caps=st.lists(st.none() | st.integers(1, 24), min_size=3, max_size=3),
    stop_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    ignore_eos=st.booleans(),
    min_output=st.integers(0, 4),
    pool=st.sampled_from([0, 48, 64]),
    chunks=st.sampled_from([None, 0, 4]),
)
def test_the_output_with_speculation_is_plain_decodings(prompts, caps, stop_ids, ignore_eos, min_output, pool, chunks):
    """Copy-heavy prompts (an ascending run the output counts through), several at once, caps,
    stop ids, EOS, min_output_tokens, small pools (preemption) and prompts read in chunks beside
    running streams (`chunks`: a step budget of 4, the chunks alone or along with plain steps):
    ids, finish, usage and logprobs are the same with the n-gram proposer as without."""
    requests = [
        request([id % VOCAB for id in prompt], cap, logprobs=True, stop_token_ids=tuple(stop_ids),
                ignore_eos=ignore_eos, min_output_tokens=min_output)
        for prompt, cap in zip(prompts, caps)
    ]

    def model():
        return ScriptedModel(vocab_size=VOCAB, max_batch_size=2, max_context_length=48, max_guesses=4, page_size=4,
                             kv_cache_tokens=pool, fused_chunk_tokens=chunks or 0)

    budget = None if chunks is None else 4
    got, _ = run(requests, model=model(), max_step_tokens=budget)
    want, _ = run(requests, model=model(), speculation="off", max_step_tokens=budget)
    assert [s.batches[-1][-1] for s in got] == [s.batches[-1][-1] for s in want]
    assert [[e for b in s.batches for e in b] for s in got] == [[e for b in s.batches for e in b] for s in want]


# -- the flags ----------------------------------------------------------------------------------


def test_the_flags_reach_the_engine_and_the_models_verify_shape():
    from services.config import DecodeServerConfig
    from services.flags import build_parser

    def config(*argv):
        return DecodeServerConfig.from_args(build_parser().parse_args(["decode-server", "--model", "m", *argv]))

    on = config("--speculation", "ngram", "--speculative-tokens", "6", "--speculation-max-batch", "2")
    assert (on.engine.speculation, on.engine.speculative_tokens, on.engine.speculation_max_batch) == ("ngram", 6, 2)
    assert (on.model_options.max_guesses, on.model_options.max_verify_rows) == (6, 2)
    served = config("--speculation", "ngram")  # verify steps of one row: the engine speculates at one only
    assert (served.model_options.max_guesses, served.model_options.max_verify_rows) == (4, 1)
    off = config("--speculative-tokens", "6")
    assert (off.engine.speculation, off.model_options.max_guesses) == ("off", 0)  # no verify shapes compiled


def test_the_verify_row_buckets_stop_at_the_one_that_holds_max_verify_rows():
    from engine.jax_backend.verify import verify_rows

    shapes = (1, 2, 4, 8, 16)  # the decode step's row buckets
    assert verify_rows(shapes, 4, kernels=True) == (1, 2, 4, 8)  # 16 x 5 tokens: past one product of 64 rows
    assert verify_rows(shapes, 4, kernels=False) == (1, 2, 4, 8, 16)
    assert [verify_rows(shapes, 4, False, most) for most in (1, 2, 3, 8, 9, 64)] == [
        (1,), (1, 2), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16)]
    assert verify_rows(shapes, 0, False, 2) == ()  # no guesses: no verify step


@pytest.mark.parametrize("argv, reason", [
    (["--speculation", "eagle"], "argument --speculation: invalid choice: 'eagle'"),
    (["--speculative-tokens", "0"], "argument --speculative-tokens: must be a whole number in 1..63, got 0"),
    (["--speculation", "ngram", "--speculative-tokens", "64"],
     "argument --speculative-tokens: must be a whole number in 1..63, got 64"),  # before the model is read
    (["--speculation", "ngram", "--speculative-tokens", "32", "--max-context-length", "32"],
     "--speculative-tokens 32 must be below --max-context-length (32)"),
    (["--speculation", "ngram", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"],
     "--speculation runs in one process: it cannot be combined with --coordinator"),
])
def test_a_speculation_that_cannot_work_exits_2_with_its_reason_last(argv, reason, capsys):
    from test_cli import in_process

    code, _, err = in_process(capsys, "decode-server", "--model", "m", *argv)
    assert code == 2 and reason in err.strip().splitlines()[-1], err


def test_an_engine_process_speculates_and_reports_its_counts_to_the_parent():
    """decode-server's engine runs in a child process: the config carries speculation there and
    the counts come back with each delivery, for the parent's metrics."""
    import functools

    from engine.core.engine_process import EngineProcess

    factory = functools.partial(ScriptedModel, vocab_size=VOCAB, max_batch_size=2, max_context_length=64, max_guesses=4)
    process = EngineProcess(factory, EngineConfig(speculation="ngram"))
    process.start()
    try:
        sink = Recorder()
        process.submit(request(list(range(11, 30)) + [10], 12), sink)
        assert sink.done.wait(10) and sink.error is None
        assert sink.tokens == list(range(11, 23))
        stats = process.stats().speculation
        assert stats.proposer == "ngram" and stats.accepted == stats.proposed > 0
    finally:
        process.stop()


def test_a_constrained_row_never_speculates_and_its_steps_are_plain():
    """A constrained request's banned ids depend on every token before it, so a step with one is
    a plain step; the copy-heavy request beside it speculates once it is alone."""
    from pathlib import Path

    from engine.constraints import Constraint
    from engine.core.constrained import ConstraintCompiler

    tokenizer_json = Path(__file__).parent / "assets" / "tiny-llama" / "tokenizer.json"
    compiler = ConstraintCompiler(tokenizer_json, 512, frozenset({0, 2}))
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=2, max_context_length=64,
                          max_guesses=4)
    held = Request("held", (10,), stopping=StoppingCriteria(6), constraint=compiler.compile(Constraint("regex", "a{6}")))
    (free, constrained), engine = run([request(list(range(101, 130)) + [100], 24), held], model=model)
    assert free.tokens == list(range(101, 125)) and constrained.tokens == [67] * 6  # ("a" is 67)
    held_slot = next(call[1] for call in model.calls if call[0] == "prefill" and call[2:] == (0, 1))
    assert not any(held_slot in (slot for slot, _ in call[1]) for call in model.calls if call[0] == "verify")
    assert engine.stats().speculation.accepted > 0
