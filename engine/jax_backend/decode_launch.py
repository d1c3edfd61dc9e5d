"""How `JaxModel` enqueues a decode step: one executable (steps.decode_step), or with
`split_sampler` the layers (steps.decode_layers) and then the sampler (steps.step_sample).

Split, a step's sampling may also wait (`dispatch(..., sample_later=True)`): the layers are
enqueued at once, and the sampler only at `dispatch_sampling`, so the mask rows a scheduler
writes in between (`ban`: a constrained request's next row, which depends on the sample of the
step before, read while these layers run) apply to this step's samples. The host's grammar work
then runs while the device runs the layers, instead of between steps (engine.core.engine).

A mixin of JaxModel (its arrays and compiled steps), kept apart so that the model's file stays
one sitting's read.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from engine.jax_backend.slot_sampling import TEMPERATURE, TOP_N, chunk_arrays
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


class DecodeLaunch:
    """JaxModel's step launching (see the module docstring)."""

    def _launch(
        self, slots: np.ndarray, ints: np.ndarray, floats: np.ndarray, attend: int,
        chunk: tuple[np.ndarray, np.ndarray] | None = None, greedy_only: bool | None = None, sample_later: bool = False,
    ) -> None:
        """Enqueue a decode step: one executable, or with split_sampler the layers and then the
        sampler variant `greedy_only` says (None: greedy where every row is greedy and wants no
        alternatives, and greedy_variant allows it), at once or, `sample_later`, at
        `dispatch_sampling`."""
        require(self._held is None, "a decode step dispatched while the last one's sampling waits")
        along = None if chunk is None else self._put(chunk)
        if not self.split_sampler:
            require(not sample_later, "sampling apart from the layers needs split_sampler")
            k, v, self._last, *samples = self._steps.step(
                *self._step_args(*self._put((ints, floats)), along), cfg=self.config, attend=attend
            )
            self._k, self._v = list(k), list(v)
            self._pending.append(Pending(slots, ints[:, TOP_N].copy(), tuple(samples)))
            return
        on_device = self._put((ints, floats)) if self.plan else jax.device_put((ints, floats))  # once for both calls
        k, v, x = self._steps.layers_step(*self._layers_args(on_device[0], along), cfg=self.config, attend=attend)
        self._k, self._v = list(k), list(v)
        self._held = Held(slots, ints, floats, on_device, x, greedy_only)
        if not sample_later:
            self.dispatch_sampling()

    def dispatch_sampling(self) -> None:
        """Enqueue the sampling of the step whose layers wait for it (`dispatch(...,
        sample_later=True)`), under the slots' mask rows as they are now."""
        require(self._held is not None, "dispatch_sampling with no step waiting for its sampling")
        h, self._held = self._held, None
        greedy_only = h.greedy_only
        if greedy_only is None:
            greedy_only = self.greedy_variant and not (h.floats[:, TEMPERATURE] > 0).any() and not (h.ints[:, TOP_N] > 0).any()
        self.sampler_calls["greedy" if greedy_only else "full"] += 1
        self._last, *samples = self._steps.step_sampler(
            h.x, self._weights.final_norm, self._lm_head, self._mask, self._last, *h.on_device, cfg=self.config,
            greedy_only=bool(greedy_only),
        )
        self._pending.append(Pending(h.slots, h.ints[:, TOP_N].copy(), tuple(samples)))

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
