"""The engine's verify step (speculative decoding, issue 45): `SpeculativeSteps`, a mixin of
engine.core.engine.Engine, kept apart so that the scheduler's file stays one sitting's read.

Data flow, in an iteration where `_decode_step` runs and speculation is on:
  1. Which rows may speculate: a step of at most the policy's `max_batch` rows, none of them
     constrained (a constrained row's banned ids depend on every token before it, so a guess
     would need the matcher run ahead and undone: those batches simply decode), that takes no
     prompt chunk along (`Model.fused_chunk_tokens`: the chunk and the step share a pass), and
     of those rows the ones not resting (engine.core.speculation.policy). None: a plain
     pipelined step.
  2. A guess continues the row's last sample, which the host does not know yet while the step
     that samples it is in flight. Two ways:
     * Ahead (a proposer with `guesses_ahead`: the n-gram one). The proposer guesses one id more
       from the history it has; the first guess stands for the id in flight and is dropped, and
       the rest are fed after that id, which the model still holds: `verify` is enqueued behind
       the step in flight, and that step is read when the verify returns (a row it finished
       drops its run). A guess made one id early is as exact as any: the model checks every
       guessed id against its own sample after the real ids before it, so a wrong stand-in only
       costs its guesses. What it saves: asked before a read, a proposer cannot tell whether
       it will have a guess once it has the id in flight, and a wrong "yes" was a read of the
       step in flight for nothing, which breaks the pipelined loop (on the CPU the step after
       it waits for the host's own part of the next call: benchmarks/verify_ahead.py); ahead,
       no guess means a plain pipelined step with nothing read. A verify step itself breaks
       the loop either way (the next step waits for its samples).
     * After a read (a draft model, which decodes its guesses from the real last id): rows
       whose proposer expects a guess from the ids known so far (`Proposer.expects`) have the
       step in flight read first; then `verify` runs with nothing in flight.
  3. Each speculating row's proposer history takes the ids it emitted since, and the proposer
     guesses for all rows at once, k each (the policy's share for this batch, and never past
     what the row may still emit: its length cap, or the end of its `min_output_tokens` mask,
     since one `masked` holds for the whole run). No row with a guess: a plain step.
  4. Pages: every row's next position, as a plain step needs (failing that, the plain step
     makes room, preempting as ever); then each guessing row's positions up to position + k,
     from the pages spare beyond the admission reserve (`KvPages.spare_pages`): where that is
     short the row guesses fewer ids, rather than anyone being preempted for a guess.
  5. `model.verify`: rows without guesses ride along with `()` (a plain step for them).
  6. Each row's run goes through `stopping.decide` one sample at a time (`Engine._advance_run`):
     EOS and stop ids are never emitted nor counted, the length cap is exact, what follows a
     finish is dropped, and the emitted tokens go to the request's sink as one list, so one
     message. A row cancelled during the step is freed with no events.
The request's count of steps grows by its run's length (each sample is one fed position), so
its positions, pages and preemption's recompute stay as after that many plain steps; the KV the
rejected guesses wrote lies past the slot's count and is overwritten by its next steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from engine.core.model import VerifyInput
from engine.core.speculation.policy import SpeculationPolicy, SpeculationStats
from engine.core.speculation.proposer import Proposer, proposer_named

if TYPE_CHECKING:
    from engine.core.engine import EngineConfig, _Live
    from engine.core.model import Sample

    Run = tuple[_Live, tuple[int, ...], tuple[Sample, ...]]  # a verified row, its guesses, its run of samples

log = logging.getLogger(__name__)


class SpeculativeSteps:
    """Engine's verify steps (see the module docstring)."""

    def _init_speculation(self, config: EngineConfig, proposer: Proposer | None) -> None:
        """The proposer (`proposer`, else the one `config.speculation` names) and the policy,
        or neither when speculation is off or the model does not verify."""
        self._proposer = proposer if proposer is not None else proposer_named(config.speculation)
        self._policy: SpeculationPolicy | None = None
        self._speculation_stats = SpeculationStats()
        self._unfollowed: list[_Live] = []  # cancelled while waiting with a history (under _cond): to close
        if self._proposer is None:
            return
        # (a proposer without `expects` is asked at every step)
        self._expects = getattr(self._proposer, "expects", lambda history: True)
        # whether it guesses past an id its history lacks yet (`Proposer.guesses_ahead`)
        self._ahead = getattr(self._proposer, "guesses_ahead", False)
        guesses = min(config.speculative_tokens, getattr(self.model, "max_guesses", 0))
        if guesses < 1:
            log.warning("speculation %s is off: the model takes no guesses (max_guesses 0)", self._proposer.name)
            self._proposer = None
            return
        self._policy = SpeculationPolicy(guesses, config.speculation_max_batch)
        self._speculation_stats = SpeculationStats(self._proposer.name)
        log.info("speculation: %s, up to %d guesses a row, at most %d rows", self._proposer.name, guesses,
                 config.speculation_max_batch)

    def _verify_step(self) -> tuple[bool, float | None]:
        """Run this iteration's step as a verify step when it should (the module docstring).
        -> (whether it did, the time of the step it read: that of the step in flight, read
        first, or the verify step's own, which ahead includes what was left of the step in
        flight behind which it ran)."""
        with self._cond:
            unfollowed, self._unfollowed = self._unfollowed, []
        for live in unfollowed:  # (a draft's slot, held by the history until then)
            self._close_speculation(live)
        lives = self._decoding()
        if self._chunk is not None or not self._policy.guesses_for(len(lives)):
            return False, None  # (a prompt chunk rides along with a plain step: one pass for both)
        if any(live.matcher is not None for live in lives):
            return False, None
        asking = [live for live in lives if live.speculation is None or not self._policy.rest(live.speculation)]
        if not asking:
            return False, None
        ahead = bool(self._in_flight) and self._ahead  # guesses past the step in flight, which stays in flight
        seconds, unseen = None, set()
        if ahead:
            unseen = {live.ticket for live in self._in_flight}
        else:  # the step in flight is read first, for the rows whose proposer expects a guess
            asking = [live for live in asking if self._expects(self._history(live))]
            if not asking:
                return False, None
            if self._in_flight:
                seconds = self._read(*self._take_in_flight())
                lives, asked = self._decoding(), {live.ticket for live in asking}
                asking = [live for live in lives if live.ticket in asked]
        guesses = self._guesses(asking, self._policy.guesses_for(len(lives)), unseen)
        if not any(guesses.values()) or not self._grow(lives):
            return False, seconds  # nothing to check, or no page for a row: a plain step (ahead: nothing read)
        runs, took = self._run_verify(lives, guesses)
        if ahead:  # the step in flight ran before the verify; read now, it may finish rows
            self._read(*self._take_in_flight())
        self._accept(runs)
        return True, took

    def _run_verify(self, lives: list[_Live], guesses: dict[int, tuple[int, ...]]) -> tuple[list[Run], float]:
        """`model.verify` for `lives` (module docstring, steps 4-5): -> ([(live, its guesses, its
        run)], the call's seconds)."""
        rows = [(live, self._pages_for_guesses(live, guesses.get(live.ticket, ()))) for live in lives]
        started = time.perf_counter()
        runs = self.model.verify([
            VerifyInput(live.slot, len(live.prompt) + live.steps, row_guesses,
                        live.rule.masks_control_tokens(live.next_index))
            for live, row_guesses in rows
        ])
        self._read_at = time.perf_counter()
        return [(live, row_guesses, run) for (live, row_guesses), run in zip(rows, runs, strict=True)], self._read_at - started

    def _accept(self, runs: list[Run]) -> None:
        """Each row's run, decided one sample at a time (module docstring, step 6); a row finished
        or cancelled meanwhile (by the step in flight, read after an ahead verify) drops its run."""
        with self._cond:  # requests aborted during the step are freed now, with no more events
            aborted = {live.ticket for live, _, _ in runs} & self._aborts
            self._aborts -= aborted
        proposed = accepted = 0
        for live, row_guesses, run in runs:
            if self._active.get(live.slot) is not live:
                continue  # finished by the step in flight, or cancelled: the run is discarded
            live.steps += len(run)
            if row_guesses:
                proposed, accepted = proposed + len(row_guesses), accepted + len(run) - 1
                self._policy.observe(live.speculation, len(row_guesses), len(run) - 1)
            if live.ticket in aborted:
                self._release(live)
            else:
                self._advance_run(live, run)
        s = self._speculation_stats
        self._speculation_stats = SpeculationStats(s.proposer, s.proposed + proposed, s.accepted + accepted, s.steps + 1)

    def _guesses(self, lives: list[_Live], k: int, unseen: Collection[int]) -> dict[int, tuple[int, ...]]:
        """Each row's guesses (by ticket), at most k, at most what its recent runs earn it
        (`SpeculationPolicy.guesses_of`) and at most what it may still emit; its
        history first takes the ids it emitted since its last step. A row in `unseen` (tickets)
        has a step in flight whose id its history lacks: the proposer guesses one more, and the
        first, which stands for that id, is dropped. A row that asked with nothing in flight and
        got no guess is counted as a miss at once (the read it cost is lost; its policy rests it
        when that goes on); an ahead row's empty guess cost nothing."""
        asks: list[tuple[_Live, int, int]] = []
        for live in lives:
            self._history(live)
            at = live.next_index  # the output index of the step's first sample
            limit = live.rule.max_output_tokens - at - 1  # a run has room for its k + 1 samples
            if live.rule.masks_control_tokens(at):  # one `masked` for the whole run
                limit = min(limit, live.rule.min_output_tokens - at - 1)
            n = min(self._policy.guesses_of(live.speculation, k), limit)
            if n > 0:
                asks.append((live, n, int(live.ticket in unseen)))
        proposals = self._proposer.propose([(live.speculation.history, n + ahead) for live, n, ahead in asks])
        vocab = self.model.info.vocab_size
        guesses = {}
        for (live, n, ahead), proposal in zip(asks, proposals, strict=True):
            proposal = tuple(proposal[ahead : ahead + n])
            bad = next((i for i, token in enumerate(proposal) if not 0 <= token < vocab), None)
            guesses[live.ticket] = proposal if bad is None else proposal[:bad]  # (a proposer's bug costs its guesses)
            if not guesses[live.ticket] and not ahead:
                self._policy.observe(live.speculation, n, 0)
        return guesses

    def _history(self, live: _Live):
        """`live`'s proposer history, opened at its first speculative step and brought up to date
        with its output (it lives until the request ends: a preemption keeps it)."""
        prompt = live.request.prompt_token_ids
        spec = live.speculation
        if spec is None:
            history = self._proposer.open(prompt + tuple(live.output))
            spec = live.speculation = self._policy.row(history, len(prompt) + len(live.output))
        elif spec.seen < len(prompt) + len(live.output):
            spec.history.extend(live.output[spec.seen - len(prompt) :])
            spec.seen = len(prompt) + len(live.output)
        return spec.history

    def _pages_for_guesses(self, live: _Live, guesses: tuple[int, ...]) -> tuple[int, ...]:
        """Pages for `live`'s positions up to position + len(guesses), from those spare beyond the
        admission reserve; fewer guesses where they are short. (Its next position has its page:
        `_grow`.) -> the guesses it keeps."""
        if not guesses:
            return guesses
        pages, size = self._pages, self._pages.page_size
        position = len(live.prompt) + live.steps
        held = len(pages.pages(live.ticket))
        affordable = (held + pages.spare_pages()) * size - position - 1  # guesses whose positions fit
        guesses = guesses[: max(0, affordable)]
        if pages.pages_for(position + len(guesses) + 1) > held:
            pages.grow(live.ticket, position + len(guesses) + 1)
            self.model.set_pages(live.slot, pages.pages(live.ticket))
        return guesses

    def _close_speculation(self, live: _Live) -> None:
        """`live` ended: its proposer forgets it."""
        if live.speculation is not None:
            self._proposer.close(live.speculation.history)
            live.speculation = None

