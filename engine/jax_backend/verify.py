"""How `JaxModel` verifies guessed tokens (speculative decoding, issue 45): `Model.verify`, its
checks, its host arrays and its compiled shapes. The step itself is engine.jax_backend.verify_step.

A verify call runs its inputs in input order, row i being input i (not slot i, as in a decode
step): R is the smallest verify row bucket that holds them, K the smallest guess bucket that holds
its longest row of guesses (a row with fewer guesses, or none, leaves the rest unfed, and pays for
them). The guess buckets (`guess_buckets`) are the powers of two below `max_guesses`, then
`max_guesses` itself (4: 1, 2, 4): a step's cost grows with its R x (K + 1) rows on a CPU, where a
few rows' products are not free once the cores are busy (docs/benchmarks.md, "Speculative
decoding"), so a scheduler that guesses fewer pays for fewer; each bucket is a warm-up shape per
row bucket. The row buckets are the decode step's, up to the largest whose R x (max_guesses + 1)
fed tokens the CPU kernels take in one product (cpu_kernels.PANEL_ROWS; elsewhere all of them):
there every row's products are the bits a decode step gives it, which is what makes a greedy
verify equal to plain greedy decoding id for id. `max_verify_rows` (ModelOptions; decode-server's
--speculation-max-batch, the most rows the engine verifies in one step) cuts them further, to the
smallest bucket that holds that many. A call with more inputs than the largest row bucket runs as
several steps of it, one after the other.

The seed contract with speculation on. A row samples at each fed token exactly as plain decoding
samples at that position (its parameters, its masked ids, the draw keyed by its seed and the
sampled token's position), and accepts a guess when that sample equals it, so:
- greedy: the same ids as plain decoding (logits of the same bits, above);
- sampled: the same ids as plain decoding with the same seed, under the same condition; and in any
  case each token's distribution is the target's (verify_step: rejection sampling for a one-hot
  proposal, its draw shared with the plain sample). Where logits could differ in their last bits
  (a path whose products depend on their row count: XLA's GEMM without the kernels, a GPU), the
  ids may differ after a near-tie, and the distribution holds.
A constrained request's banned row depends on the token before it, which a guess would have to
be checked against first (engine.core.constrained): a verify samples every token of a row under
the slot's one row of banned ids, so a constrained request verifies only with no guesses.

Where `max_guesses` is 0: when it is configured so (the default: no verify shape compiled), and
under tensor parallelism, where the verify step's inputs would need the mesh's placements, which
no test covers yet.

A mixin of JaxModel (its arrays, slots and compiled steps), kept apart so that the model's file
stays one sitting's read. Shapes as engine.jax_backend.verify_step.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from engine.core import model_options
from engine.core.model import DecodeInput, Sample, VerifyInput
from engine.jax_backend import cpu_kernels
from engine.jax_backend.shapes import bucket, length_buckets
from engine.jax_backend.slot_sampling import TOP_N
from engine.jax_backend.slot_table import require
from engine.jax_backend.steps import alternatives
from engine.jax_backend.verify_step import COUNT, GUESSES, SLOT

MOST_GUESSES = cpu_kernels.PANEL_ROWS - 1  # a row's K + 1 tokens within one product of the CPU kernels
assert MOST_GUESSES == model_options.MOST_GUESSES, "the command line's limit (engine.core.model_options) is this one"


def max_guesses(requested: int, mesh: bool) -> int:
    """The model's `max_guesses` from the configured one (module docstring: 0 under a mesh);
    ValueError for a count no verify step takes."""
    if not 0 <= requested <= MOST_GUESSES:
        raise ValueError(f"max_guesses must be in 0..{MOST_GUESSES}, got {requested}")
    return 0 if mesh else requested


def guess_buckets(guesses: int) -> tuple[int, ...]:
    """The guess counts K a verify step compiles for (module docstring); () when it does not verify."""
    return length_buckets(guesses, 1) if guesses else ()


def verify_rows(decode_rows: tuple[int, ...], guesses: int, kernels: bool, most: int = 0) -> tuple[int, ...]:
    """The row buckets a verify step compiles for (module docstring), of the decode step's
    `decode_rows`: up to the smallest that holds `most` rows (0: every one); () when it does not
    verify."""
    if not guesses:
        return ()
    rows = [r for r in decode_rows if not kernels or r * (guesses + 1) <= cpu_kernels.PANEL_ROWS]
    if most > 0:
        rows = [r for r in rows if r < most] + [r for r in rows if r >= most][:1]
    return tuple(rows)


class Verifying:
    """JaxModel's `verify` (see the module docstring)."""

    def verify(self, inputs: Sequence[VerifyInput]) -> list[tuple[Sample, ...]]:
        require(self.max_guesses > 0, "verify on a model with max_guesses 0")
        require(self._held is None, "verify while a dispatched step's sampling waits")
        self._check_verify(inputs)
        top = self.verify_rows[-1]
        return [run for lo in range(0, len(inputs), top) for run in self._verify_once(inputs[lo : lo + top])]

    def _check_verify(self, inputs: Sequence[VerifyInput]) -> None:
        """The decode step's checks (slot_table.check_step) for each input's first token, then
        its guesses': in the vocabulary, at most max_guesses, inside the context, with pages."""
        self._slots.check_step([DecodeInput(i.slot, None, i.position, i.masked) for i in inputs])
        for i in inputs:
            n, end = len(i.guesses), i.position + len(i.guesses)
            require(n <= self.max_guesses, f"{n} guesses for slot {i.slot}, past max_guesses {self.max_guesses}")
            require(end < self.info.max_context_length, f"slot {i.slot}'s guesses run past the context")
            require(self._slots.covers(i.slot, end + 1), f"slot {i.slot}'s guesses reach a position with no page")
            require(all(0 <= t < self.info.vocab_size for t in i.guesses), "a guessed id outside the vocabulary")

    def _verify_once(self, inputs: Sequence[VerifyInput]) -> list[tuple[Sample, ...]]:
        """One verify step for at most the largest verify row bucket's inputs: enqueue, read the
        runs back, advance each slot's count past its accepted run."""
        rows = bucket(self.verify_rows, len(inputs))
        k = bucket(self.guess_buckets, max(len(i.guesses) for i in inputs))
        attend = bucket(self.shapes.attend, max(i.position + len(i.guesses) for i in inputs) + 1)
        ints, floats, guessed = self._verify_arrays(inputs, rows, k)
        samples, logprobs, m, top_n, tops = self._run_verify(ints, floats, guessed, attend)
        k1, runs = k + 1, []
        for row, i in enumerate(inputs):
            n = int(m[row]) + 1  # the accepted run: s_0 .. s_m
            self._slots.length[i.slot] = i.position + n
            fed = slice(row * k1, row * k1 + n)
            alts = alternatives(tops[0][fed], tops[1][fed], top_n[fed]) if tops else [()] * n
            runs.append(tuple(Sample(int(t), float(p), a) for t, p, a in zip(samples[row, :n], logprobs[row, :n], alts)))
        return runs

    def _run_verify(self, ints: np.ndarray, floats: np.ndarray, guessed: np.ndarray, attend: int) -> tuple:
        """Enqueue one verify step and read it back: -> (samples [R, K + 1], logprobs [R, K + 1],
        m [R], top_n [F], and (top ids [F, M], top logprobs [F, M]) when some row asks, else ())."""
        w = self._weights
        k, v, self._last, *out = self._steps.verify(
            w.embed, w.final_norm, self._lm_head, self._decode_weights, tuple(self._k), tuple(self._v), self._last,
            self._mask, ints, floats, guessed, cfg=self.config, attend=attend,
        )
        self._k, self._v = list(k), list(v)
        top_n = np.repeat(ints[:, TOP_N], guessed.shape[1] - GUESSES + 1)  # [F]
        wanted = top_n.any()
        got = jax.device_get(tuple(out) if wanted else tuple(out[:3]))
        return (*got[:3], top_n, tuple(got[3:]) if wanted else ())

    def _verify_arrays(self, inputs: Sequence[VerifyInput], rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A verify step's host inputs, row i for input i: a decode step's packed columns (with
        the row's slot's parameters and table), and `guessed` [R, 2 + K] (slot, count, guesses).
        Rows past the inputs are idle, at a slot none of the inputs holds (so the write of each
        row's last sample never meets an input's at the same slot)."""
        b = self.info.max_batch_size
        order = [i.slot for i in inputs]
        idle = next((s for s in range(b) if s not in set(order)), 0)  # none: no idle rows
        slots = np.array(order + [idle] * (rows - len(inputs)), np.int64)  # [R]
        # the decode packing lays row s out for slot s: pack every slot, then take the rows' slots
        decode = [DecodeInput(i.slot, None, i.position, i.masked) for i in inputs]
        ints, floats = self._sampling.pack(decode, b, self._slots.tables)
        ints, floats = ints[slots], floats[slots]
        ints[len(inputs):] = 0  # idle rows: inactive, greedy, the null table
        floats[len(inputs):] = (0.0, 1.0, 0.0)
        guessed = np.zeros((rows, GUESSES + k), np.int32)
        guessed[:, SLOT] = slots
        for row, i in enumerate(inputs):
            guessed[row, COUNT] = len(i.guesses)
            guessed[row, GUESSES : GUESSES + len(i.guesses)] = i.guesses
        return ints, floats, guessed

    def _verify_shapes(self) -> int:
        """How many executables `_warm_up_verify` compiles: one per (verify rows, guesses, attend)."""
        return len(self.verify_rows) * len(self.guess_buckets) * len(self.shapes.attend)

    def _warm_up_verify(self, progress) -> None:
        """Compile each verify shape, every row idle (every write into the null page), counting
        each on warm-up's `progress` (compile_progress.CompileProgress)."""
        for rows in self.verify_rows:
            for k in self.guess_buckets:
                for attend in self.shapes.attend:
                    self._run_verify(*self._verify_arrays([], rows, k), attend)
                    progress.advance()
