"""The engine's verify step (speculative decoding, issue 45): `SpeculativeSteps`, a mixin of
engine.core.engine.Engine, kept apart so that the scheduler's file stays one sitting's read.

Data flow, in an iteration where `_decode_step` runs and speculation is on:
  1. Which rows may speculate: a step of at most the policy's `max_batch` rows, none of them
     constrained (a constrained row's banned ids depend on every token before it, so a guess
     would need the matcher run ahead and undone: those batches simply decode), that takes no
     prompt chunk along (`Model.fused_chunk_tokens`: the chunk and the step share a pass), and
     of those rows the ones not resting (engine.core.speculation.policy) whose proposer expects
     a guess from the ids known so far (`Proposer.expects`). None: a plain pipelined step.
  2. The step in flight is read first: a guess continues the row's last sample, so the host
     must know it, and `verify` runs with nothing in flight. (This is what a guess costs even
     when it is right: the host no longer runs a step ahead of the device, hence step 1's
     `expects`, asked before the read.)
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
from typing import TYPE_CHECKING

from engine.core.model import VerifyInput
from engine.core.speculation.policy import SpeculationPolicy, SpeculationStats
from engine.core.speculation.proposer import Proposer, proposer_named

if TYPE_CHECKING:
    from engine.core.engine import EngineConfig, _Live

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
        first, or the verify step's own)."""
        with self._cond:
            unfollowed, self._unfollowed = self._unfollowed, []
        for live in unfollowed:  # (a draft's slot, held by the history until then)
            self._close_speculation(live)
        lives = self._decoding()
        if self._chunk is not None or not self._policy.guesses_for(len(lives)):
            return False, None  # (a prompt chunk rides along with a plain step: one pass for both)
        if any(live.matcher is not None for live in lives):
            return False, None
        asking = {
            live.ticket for live in lives
            if (live.speculation is None or not self._policy.rest(live.speculation))
            and self._expects(self._history(live))
        }
        if not asking:
            return False, None
        seconds = None
        if self._in_flight:
            seconds = self._read(*self._take_in_flight())
            lives = self._decoding()
        k = self._policy.guesses_for(len(lives))
        guesses = self._guesses([live for live in lives if live.ticket in asking], k)
        if not any(guesses.values()) or not self._grow(lives):
            return False, seconds  # nothing to check, or no page for a row: a plain step
        rows = [(live, self._pages_for_guesses(live, guesses.get(live.ticket, ()))) for live in lives]
        started = time.perf_counter()
        runs = self.model.verify([
            VerifyInput(live.slot, len(live.prompt) + live.steps, row_guesses, live.rule.masks_control_tokens(live.emitted))
            for live, row_guesses in rows
        ])
        self._read_at = time.perf_counter()
        with self._cond:  # requests aborted during the step are freed now, with no more events
            aborted = {live.ticket for live, _ in rows} & self._aborts
            self._aborts -= aborted
        proposed = accepted = 0
        for (live, row_guesses), run in zip(rows, runs, strict=True):
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
        return True, self._read_at - started

    def _guesses(self, lives: list[_Live], k: int) -> dict[int, tuple[int, ...]]:
        """Each row's guesses (by ticket), at most k, at most what its recent runs earn it
        (`SpeculationPolicy.guesses_of`) and at most what it may still emit; its
        history first takes the ids it emitted since its last step. A row offered guesses that
        got none is counted as a miss at once (its policy rests it when that goes on)."""
        asks: list[tuple[_Live, int]] = []
        for live in lives:
            self._history(live)
            limit = live.rule.max_output_tokens - live.emitted - 1  # a run has room for its k + 1 samples
            if live.rule.masks_control_tokens(live.emitted):  # one `masked` for the whole run
                limit = min(limit, live.rule.min_output_tokens - live.emitted - 1)
            n = min(self._policy.guesses_of(live.speculation, k), limit)
            if n > 0:
                asks.append((live, n))
        histories = [live.speculation.history for live, _ in asks]
        proposals = self._proposer.propose([(history, n) for history, (_, n) in zip(histories, asks)])
        vocab = self.model.info.vocab_size
        guesses = {}
        for (live, n), proposal in zip(asks, proposals, strict=True):
            proposal = tuple(proposal[:n])
            bad = next((i for i, token in enumerate(proposal) if not 0 <= token < vocab), None)
            guesses[live.ticket] = proposal if bad is None else proposal[:bad]  # (a proposer's bug costs its guesses)
            if not guesses[live.ticket]:
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

