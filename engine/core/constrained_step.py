"""The engine's decode step for a batch with constrained rows (issue 43): `ConstrainedSteps`, a
mixin of engine.core.engine.Engine (its state and its read of a step), kept apart so that the
scheduler's file stays one sitting's read.

A constrained row's next row of banned ids depends on the token just sampled, so a step with one
cannot be dispatched blind, one step ahead, as an unconstrained step is. Two ways:

* Layers first (a step the model `samples_apart`: every step on an accelerator, where the
  sampler is split off; on the CPU, a step of the smallest row bucket, a stream alone): the
  step's layers are dispatched at once (each row fed the sample the device holds), the step in
  flight is read while they run (its tokens advance the matchers; a request it finishes has its
  sample of this step discarded, as after any step), then the constrained rows still running
  get their rows (`_bans`) and the step's sampling is dispatched with them. The host's grammar
  work, and the launch of the layers, hide behind the device's layers.
* Read first (elsewhere): the step in flight is read before the step is dispatched, the rows
  computed and sent, then the step dispatched; the device waits for the host meanwhile, which
  a long step (a large batch) hardly notices.

A constrained row is masked in every step (a stale row is never sampled from: its request is
gone). One whose row allows nothing, or whose matcher failed, fails its request alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.core.constrained import banned_rows
from engine.core.model import DecodeInput

if TYPE_CHECKING:
    from engine.core.engine import _Live
    from engine.core.model import ChunkInput


class ConstrainedSteps:
    """Engine's constrained steps (see the module docstring)."""

    def _samples_apart(self, lives: list[_Live]) -> bool:
        """Whether a step of `lives` with a constrained row goes layers first: the model
        samples such a step apart (its slots all below `samples_apart`)."""
        return max(live.slot for live in lives) < self.model.samples_apart

    def _dispatch_constrained(self, lives: list[_Live], chunk: ChunkInput | None) -> float | None:
        """A step with constrained rows, layers first (see the module docstring).
        -> the read step's time, as `_decode_step`."""
        inputs = [
            DecodeInput(live.slot, None, len(live.prompt) + live.steps,
                        live.matcher is not None or live.rule.masks_control_tokens(live.next_index))
            for live in lives
        ]
        dispatched_at = time.perf_counter()
        self.model.dispatch(inputs, chunk, sample_later=True)
        for live in lives:
            live.steps += 1
        previous, started, timed = self._take_in_flight()
        seconds = self._read(previous, started, timed) if previous else None
        held = [live for live in lives if live.matcher is not None and self._active.get(live.slot) is live]
        if held:
            self._bans(held, {live.slot: live.rule.masks_control_tokens(live.resumed + live.steps) for live in held})
        self.model.dispatch_sampling()
        self._in_flight, self._dispatched_at = lives, dispatched_at
        return seconds

    def _bans(self, held: list[_Live], mask_control: dict[int, bool]) -> list[int]:
        """The constrained requests' next rows of banned ids, computed together
        (engine.core.constrained.banned_rows: one call into the grammar library) and sent in one
        `model.ban`; `mask_control[slot]`: the row bans the control ids too (below
        min_output_tokens). One whose row allows nothing, or whose matcher failed, is failed and
        its slot freed, alone. -> the slots banned."""
        rows, errors = banned_rows(
            [live.matcher for live in held], self.model.info.vocab_size,
            [live.rule.control_token_ids for live in held], [mask_control[live.slot] for live in held],
        )  # [R, V]
        for live, error in zip(held, errors):
            if error is not None:
                self._release(live)
                live.sink.fail(error)
        keep = [i for i, error in enumerate(errors) if error is None]
        if keep:
            self.model.ban([held[i].slot for i in keep], rows[keep] if len(keep) < len(held) else rows)
        return [held[i].slot for i in keep]
