"""How `JaxModel` enqueues a decode step: its layers (steps.decode_layers) and then the
sampler of its row bucket (steps.step_sample, greedy or full, the variant the host picks), or,
where the backend does not split the sampler off (`split_sampler` False: the CPU) and the step's
rows are all greedy and want no alternatives, one executable with the greedy sampler inside
(steps.decode_step), whose single dispatch keeps a batch-1 step as short as it can be. A step
with a prompt chunk along, or one whose rows sample, runs as the two calls.

A step's sampling may also wait (`dispatch(..., sample_later=True)`): the layers are enqueued
at once, and the sampler only at `dispatch_sampling`, so the mask rows a scheduler gives in
between (`ban`: a constrained request's next row, which depends on the sample of the step
before, read while these layers run) apply to this step's samples. The host's grammar work then
runs while the device runs the layers, instead of between steps (engine.core.engine). Those rows
are written (`write_masks`, one call of a row bucket) just before the sampling call. Split, any
step may wait so (`samples_apart`: every slot); otherwise only a step of the smallest row bucket
(a stream alone, on the CPU): at larger batches a step is long enough that reading first costs
it little (docs/constraints.md, "Speed").

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
    greedy_only: bool  # the sampler variant
    rows: np.ndarray | None = None  # [R, V'] bool, those rows, at their slots (None: none yet)
    fresh: np.ndarray | None = None  # [R] bool, the slots `ban` gave a row


class DecodeLaunch:
    """JaxModel's step launching (see the module docstring)."""

    def _launch(
        self, slots: np.ndarray, ints: np.ndarray, floats: np.ndarray, attend: int,
        chunk: tuple[np.ndarray, np.ndarray] | None = None, greedy_only: bool | None = None, sample_later: bool = False,
        apart: bool = False,
    ) -> None:
        """Enqueue a decode step with the sampler variant `greedy_only` says (None: greedy where
        every row is greedy and wants no alternatives, and greedy_variant allows it): one
        executable where that is greedy and nothing asks for two calls (the module docstring;
        `apart`: two calls regardless, for warm-up), else the layers and then the sampler, at
        once or, with `sample_later`, at `dispatch_sampling`."""
        require(self._held is None, "a decode step dispatched while the last one's sampling waits")
        require(not sample_later or self.split_sampler or ints.shape[0] <= self.samples_apart,
                f"sampling apart from the layers in a step of {ints.shape[0]} rows, past {self.samples_apart}")
        if greedy_only is None:
            greedy_only = self._all_greedy(ints, floats)
        if greedy_only and not (self.split_sampler or sample_later or apart or chunk is not None):
            k, v, self._last, *samples = self._steps.step(*self._step_args(self._put(ints)), cfg=self.config, attend=attend)
            self._k, self._v = list(k), list(v)
            self._pending.append(Pending(slots, ints[:, TOP_N].copy(), tuple(samples)))
            return
        along = None if chunk is None else self._put(chunk)
        on_device = self._both_calls((ints, floats))
        k, v, x = self._steps.layers_step(*self._layers_args(on_device[0], along), cfg=self.config, attend=attend)
        self._k, self._v = list(k), list(v)
        self._held = Held(slots, ints, floats, on_device, x, bool(greedy_only))
        if not sample_later:
            self.dispatch_sampling()

    def _both_calls(self, tree):
        """Host inputs that two calls read (a split step's columns: the layers, then the sampler):
        on the device once. Every sampling call passes its columns so, and its slots as host
        arrays: jit's cache tells a device array from a host one, so calls that mixed them would
        add entries after warm-up."""
        return self._put(tree) if self.plan else jax.device_put(tree)

    def _all_greedy(self, ints: np.ndarray, floats: np.ndarray) -> bool:
        """Whether the greedy sampler serves these rows: none samples or wants alternatives (and
        greedy_variant is on)."""
        return self.greedy_variant and not (floats[:, TEMPERATURE] > 0).any() and not (ints[:, TOP_N] > 0).any()

    def ban(self, slots: Sequence[int], banned: np.ndarray) -> None:
        """Banned ids [R, V] bool: the slots' mask rows from the next sampling on. For a step
        whose sampling waits (`sample_later`), they are written just before that sampling call;
        otherwise at once, in one call of `ban`'s row bucket."""
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
        self.sampler_calls["greedy" if h.greedy_only else "full"] += 1
        if h.fresh is not None:
            at = np.flatnonzero(h.fresh).astype(np.int32)  # [F] slots with a fresh row
            size = bucket(self.shapes.rows, len(at))
            rows, slots = np.repeat(h.rows[at[:1]], size, axis=0), np.full(size, at[0], np.int32)  # padding: the first again
            rows[: len(at)], slots[: len(at)] = h.rows[at], at
            self._mask = self._steps.write_masks(self._mask, *self._put((rows, slots)))
        r = h.ints.shape[0]
        samples = self._sample(h.x, *h.on_device, self._put(np.arange(r, dtype=np.int32)), h.greedy_only)
        self._pending.append(Pending(h.slots, h.ints[:, TOP_N].copy(), samples))

    def _sample(self, x: jax.Array, ints, floats, slots, greedy_only: bool) -> tuple[jax.Array, ...]:
        """One call of the sampler of x's row bucket (steps.step_sample) for rows x [R, 1, E]
        with their packed columns and slots: the samples, on the device, each active row's also
        at its slot of `last`."""
        self._last, *samples = self._steps.step_sampler(
            x, self._weights.final_norm, self._lm_head, self._mask, self._last, ints, floats, slots, cfg=self.config,
            greedy_only=bool(greedy_only),
        )
        return tuple(samples)

    def _step_shapes(self) -> int:
        """How many executables `_warm_up_steps` compiles: per (rows, attend) the layers alone
        (split off, or for a step that samples), where a step is otherwise one executable that
        greedy step, and the layers with each chunk size along; per row bucket both samplers."""
        per_attend = 1 + (0 if self.split_sampler else 1) + len(self.shapes.fused)
        return len(self.shapes.rows) * (len(self.shapes.attend) * per_attend + 2)

    def _warm_up_steps(self, progress) -> None:
        """Compile, every row idle (a step that writes nothing and samples for nobody), every
        decode step serving can run (`_step_shapes`), advancing `progress` by each."""
        for rows in self.shapes.rows:
            for attend in self.shapes.attend:
                runs = [dict(greedy_only=False), dict(greedy_only=True, apart=True)]  # the layers, both samplers
                if not self.split_sampler:
                    runs.append(dict(greedy_only=True))  # the greedy step as one executable
                runs += [dict(chunk=chunk_arrays(self._null_table, [0] * size, 0)) for size in self.shapes.fused]
                for run in runs:
                    before = self.compilations()
                    self._launch(np.zeros(0, np.int64), *self._pack([], rows), attend, **run)
                    self.collect()
                    progress.advance(self.compilations() - before)

    def _lower_step(self, rows: int, attend: int, chunk: bool = False):
        ints, floats = self._put(self._pack([], rows))
        along = self._put(chunk_arrays(self._null_table, [0] * self.shapes.fused[-1], 0)) if chunk else None
        if self.split_sampler or chunk:
            return self._steps.layers_step.lower(*self._layers_args(ints, along), cfg=self.config, attend=attend)
        return self._steps.step.lower(*self._step_args(ints), cfg=self.config, attend=attend)

    def _step_args(self, ints) -> tuple:
        """The one-executable greedy decode step's positional arguments (steps.decode_step)."""
        w = self._weights
        return (w.embed, w.final_norm, self._lm_head, self._decode_weights, tuple(self._k), tuple(self._v), self._last,
                self._mask, ints)

    def _layers_args(self, ints, along) -> tuple:
        """The split step's layers' positional arguments (steps.decode_layers)."""
        return (self._weights.embed, self._decode_weights, tuple(self._k), tuple(self._v), self._last, ints, along)
