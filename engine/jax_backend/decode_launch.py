"""How `JaxModel` enqueues a decode step: one executable (steps.decode_step), or with
`split_sampler` the layers (steps.decode_layers) and then the sampler (steps.step_sample).

A step's sampling may also wait (`dispatch(..., sample_later=True)`): the layers are enqueued
at once, and the sampler only at `dispatch_sampling`, so the mask rows a scheduler gives in
between (`ban`: a constrained request's next row, which depends on the sample of the step
before, read while these layers run) apply to this step's samples. The host's grammar work then
runs while the device runs the layers, instead of between steps (engine.core.engine). Those rows
go into the sampling call itself (steps.step_sample_under), not a call of their own. Split, any
step may wait so (`samples_apart`: every slot); with one executable a step, only a step of the
smallest row bucket (a stream alone, on the CPU), for which warm-up compiles the layers apart:
a bucket more would add its layers' compiles, and at larger batches a step is long enough that
reading first costs it little (docs/constraints.md, "Speed").

A mixin of JaxModel (its arrays and compiled steps), kept apart so that the model's file stays
one sitting's read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import jax
import numpy as np

from engine.jax_backend.shapes import bucket
from engine.jax_backend.slot_sampling import TEMPERATURE, TOP_N, chunk_arrays, mask_rows
from engine.jax_backend.slot_table import require
from engine.jax_backend.steps import Pending


@dataclass(frozen=True)
class Held:
    """A split step whose layers are enqueued and whose sampling waits for `dispatch_sampling`."""

    slots: np.ndarray  # [N] the slots of the step's inputs, in input order
    ints: np.ndarray  # [R, 9 + W] i32 host columns (slot_sampling.pack)
    floats: np.ndarray  # [R, 3] f32
    on_device: tuple  # (ints, floats) as the layers read them, for the sampler too
    x: jax.Array  # [R, 1, E] the rows' final hidden states
    greedy_only: bool | None
    later: bool  # dispatched with sample_later: its sampling writes the rows `ban` gave meanwhile
    rows: np.ndarray | None = None  # [R, V'] bool, those rows, at their slots (None: none yet)
    fresh: np.ndarray | None = None  # [R] bool, the slots `ban` gave a row


class DecodeLaunch:
    """JaxModel's step launching (see the module docstring)."""

    def _launch(
        self, slots: np.ndarray, ints: np.ndarray, floats: np.ndarray, attend: int,
        chunk: tuple[np.ndarray, np.ndarray] | None = None, greedy_only: bool | None = None, sample_later: bool = False,
    ) -> None:
        """Enqueue a decode step: one executable, or with split_sampler (or `sample_later`) the
        layers and then the sampler variant `greedy_only` says (None: greedy where every row is
        greedy and wants no alternatives, and greedy_variant allows it), at once or, with
        `sample_later`, at `dispatch_sampling`."""
        require(self._held is None, "a decode step dispatched while the last one's sampling waits")
        along = None if chunk is None else self._put(chunk)
        require(not sample_later or self.split_sampler or ints.shape[0] <= self.samples_apart,
                f"sampling apart from the layers in a step of {ints.shape[0]} rows, past {self.samples_apart}")
        if not (self.split_sampler or sample_later):
            k, v, self._last, *samples = self._steps.step(
                *self._step_args(*self._put((ints, floats)), along), cfg=self.config, attend=attend
            )
            self._k, self._v = list(k), list(v)
            self._pending.append(Pending(slots, ints[:, TOP_N].copy(), tuple(samples)))
            return
        on_device = self._put((ints, floats)) if self.plan else jax.device_put((ints, floats))  # once for both calls
        k, v, x = self._steps.layers_step(*self._layers_args(on_device[0], along), cfg=self.config, attend=attend)
        self._k, self._v = list(k), list(v)
        self._held = Held(slots, ints, floats, on_device, x, greedy_only, sample_later)
        if not sample_later:
            self.dispatch_sampling()

    def ban(self, slots: Sequence[int], banned: np.ndarray) -> None:
        """Banned ids [R, V] bool: the slots' mask rows from the next sampling on. For a step
        whose sampling waits (`sample_later`), they go with that sampling call; otherwise they are
        written in one call of their own (`ban`'s row bucket)."""
        require(not any(self._slots.free(s) for s in slots), f"ban on slots {list(slots)}, not all holding a request")
        h = self._held
        if h is None:
            rows = mask_rows(self._head_size, self.info.vocab_size, slots, banned, bucket(self.shapes.rows, len(slots)))
            self._mask = self._steps.write_masks(self._mask, *rows)  # [B, V'] with rows [R', V'] at slots [R']
            return
        r, n = h.ints.shape[0], min(self.info.vocab_size, self._head_size)
        require(banned.dtype == bool and banned.shape == (len(slots), self.info.vocab_size), f"banned rows of {banned.dtype} {banned.shape}")
        require(len(set(slots)) == len(slots) and all(s < r for s in slots), f"ban on slots {list(slots)} beside a step of {r} rows")
        if h.rows is None:
            h = self._held = replace(h, rows=np.zeros((r, self._head_size), bool), fresh=np.zeros(r, bool))
        h.rows[list(slots), :n] = banned[:, :n]  # ids past the vocabulary (a padded head) stay allowed, as mask_rows leaves them
        h.fresh[list(slots)] = True

    def dispatch_sampling(self) -> None:
        """Enqueue the sampling of the step whose layers wait for it (`dispatch(...,
        sample_later=True)`), under the slots' mask rows as they are now, with the rows `ban`
        gave since its layers written first."""
        require(self._held is not None, "dispatch_sampling with no step waiting for its sampling")
        h, self._held = self._held, None
        greedy_only = h.greedy_only
        if greedy_only is None:
            greedy_only = self.greedy_variant and not (h.floats[:, TEMPERATURE] > 0).any() and not (h.ints[:, TOP_N] > 0).any()
        self.sampler_calls["greedy" if greedy_only else "full"] += 1
        head = (h.x, self._weights.final_norm, self._lm_head)
        if h.later:  # one compiled shape whether or not rows came: none fresh keeps every slot's row
            r = h.ints.shape[0]
            rows = (np.zeros((r, self._head_size), bool), np.zeros(r, bool)) if h.rows is None else (h.rows, h.fresh)
            self._mask, self._last, *samples = self._steps.step_sampler_under(
                *head, self._mask, self._last, *h.on_device, *self._put(rows), cfg=self.config, greedy_only=bool(greedy_only),
                keep=None if self.plan is None else self.plan.replicated,
            )
        else:
            self._last, *samples = self._steps.step_sampler(
                *head, self._mask, self._last, *h.on_device, cfg=self.config, greedy_only=bool(greedy_only),
            )
        self._pending.append(Pending(h.slots, h.ints[:, TOP_N].copy(), tuple(samples)))

    def _apart_shapes(self) -> int:
        """How many executables `_warm_up_apart` compiles: the sampling under fresh rows (greedy
        and full) per row bucket a step may sample apart with, and where a step is otherwise one
        executable, its layers apart per (rows, attend), alone and with each chunk size along."""
        rows = [r for r in self.shapes.rows if r <= self.samples_apart]
        layers = 0 if self.split_sampler else len(rows) * len(self.shapes.attend) * (1 + len(self.shapes.fused))
        return 2 * len(rows) + layers

    def _warm_up_apart(self) -> None:
        """Compile, every row idle, what a step dispatched with `sample_later` runs: its sampling
        under fresh rows (greedy and full) for each row bucket it may have, and where a step is
        otherwise one executable, its layers apart, alone and with each chunk size along."""
        for rows in self.shapes.rows:
            if rows > self.samples_apart:
                break
            for attend in self.shapes.attend:
                alongs = [None] if self.split_sampler else [None] + [
                    chunk_arrays(self._null_table, [0] * size, 0) for size in self.shapes.fused
                ]
                for along in alongs:
                    for variant in (True, False) if along is None else (True,):
                        self._launch(np.zeros(0, np.int64), *self._pack([], rows), attend, along, greedy_only=variant,
                                     sample_later=True)
                        self.dispatch_sampling()
                        self.collect()

    def _lower_step(self, rows: int, attend: int, chunk: bool = False):
        ints, floats = self._put(self._pack([], rows))
        along = self._put(chunk_arrays(self._null_table, [0] * self.shapes.fused[-1], 0)) if chunk else None
        if self.split_sampler:
            return self._steps.layers_step.lower(*self._layers_args(ints, along), cfg=self.config, attend=attend)
        return self._steps.step.lower(*self._step_args(ints, floats, along), cfg=self.config, attend=attend)

    def _step_args(self, ints, floats, along) -> tuple:
        """The one-executable decode step's positional arguments (steps.decode_step)."""
        w = self._weights
        return (w.embed, w.final_norm, self._lm_head, self._decode_weights, tuple(self._k), tuple(self._v), self._last,
                self._mask, ints, floats, along)

    def _layers_args(self, ints, along) -> tuple:
        """The split step's layers' positional arguments (steps.decode_layers)."""
        return (self._weights.embed, self._decode_weights, tuple(self._k), tuple(self._v), self._last, ints, along)
