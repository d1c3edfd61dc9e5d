"""The compile budget: how many shapes warm-up compiles for stated configurations (counted as
warm-up's own log announces them and as the jitted steps ask for them: below), so a change that
adds shapes, and so minutes of GPU warm-up on every start without a compilation cache, fails here
first.

The configurations are the decode-server's defaults (8 slots, prompt chunks up to 512, a KV page
pool, whose block tables are inputs of one shape and so add no shape) on tiny-llama, whose context is 256 (the default model's 2048 adds 3 prompt buckets, and 3
attend buckets where there are several): once as the CPU runs them (the attention kernel: one
attend shape; rows from 1), and once with neither attention kernel, rows from 16, no
chunk along with a decode step, one packed prefill size and the decode step's sampler split off
in two variants, as an accelerator without the Pallas kernel runs them (attend buckets from 128).
A GPU with the Pallas kernel (engine.jax_backend.ragged_attention) has one attend shape:
1 + 2 + 15 + 2 + 1 = 21 there. (The prefix cache's two copies between its pool and a slot went
with the paged KV cache, issue 41: a prefix hit shares pages, so 45 -> 43 and 26 -> 24. A decode
step's constrained rows, written in one call, issue 43, add one per row bucket: 47 and 25. A
step whose sampling waits for its rows, issue 43, sampled under them in one call: 51 and 27.
Then every sampling call went through one sampler per row bucket, greedy and full (issue 47: the
full sampler had been compiled into every program that samples, most of a small model's
warm-up): the CPU's decode steps that sample, or carry a chunk along, run their layers and then
that sampler, a greedy step stays one executable, and each prompt's last positions are gathered
per (prompt size, row bucket) by a small program of their own. More programs, far less compile
time: 67 and 22. Speculative decoding's verify step, issue 45, adds one per verify row bucket (up
to the one that holds max_verify_rows, decode-server's --speculation-max-batch), guess bucket and
attend shape, only where max_guesses > 0: none here, and the last test counts it.) Each count is
written out, not computed from the model, so it reads as the budget it is.

Every count here lowers warm-up's programs without compiling them (`lower_only`: JAX's trace and
MLIR, about a tenth of the CPU time XLA's compile of 67 and 22 shapes takes; that compile is
XLA's, and the shapes are what is budgeted). The last test lowers test_verify's float32 model
(the served options at 4 slots, a context of 64, max_guesses 4, verify steps of at most 2 rows),
which tests/test_verify.py warms up for real: there its executables are counted in jit's caches
and its compile events, and nothing compiles after warm-up; both files write out the same 49, so
`lower_only` counts the programs that the compile made executables, which the two counts of the
defaults rely on.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.jax_backend.jax_model import JaxModel
from support import prerequisites, tiny_served

LLAMA = Path(__file__).parent / "assets" / "tiny-llama"
DEFAULTS = dict(max_batch_size=8, max_context_length=256, dtype="float32")


class LowerOnly:
    """One of a model's jitted steps that lowers each call (traced and lowered to MLIR, not
    compiled by XLA) and returns zeros of its outputs' shapes, so that warm-up runs through it
    as through the step. `_cache_size`, which `JaxModel.compilations` sums, is the number of
    distinct programs asked for: each program text with its arguments' shapes, dtypes and weak
    types, what jit's cache keeps one executable for."""

    def __init__(self, jitted) -> None:
        self.jitted, self.programs = jitted, set()

    def __call__(self, *args, **kwargs):
        lowered = self.jitted.lower(*args, **kwargs)
        avals = tuple((a._aval.shape, str(a._aval.dtype), a._aval.weak_type) for a in jax.tree.leaves(lowered.args_info))
        self.programs.add((hashlib.sha256(lowered.as_text().encode()).hexdigest(), avals))
        return jax.tree.map(lambda out: jnp.zeros(out.shape, out.dtype), lowered.out_info)

    def _cache_size(self) -> int:
        return len(self.programs)


def lower_only(model: JaxModel) -> JaxModel:
    """`model` with every jitted step (`Steps.jitted`) a LowerOnly: its warm-up compiles nothing
    of its own (jnp's small helpers only) and its `compilations()` counts what it asked for."""
    steps = model._steps
    for name, value in list(vars(steps).items()):
        if value in steps.jitted():
            setattr(steps, name, LowerOnly(value))
    assert all(isinstance(f, LowerOnly) for f in steps.jitted())
    return model


def _warm(caplog, **kw) -> JaxModel:
    model = lower_only(JaxModel.load(LLAMA, **DEFAULTS, **kw))
    with caplog.at_level(logging.INFO, logger="engine.jax_backend.warm_up"):
        model.warm_up()
    _check_progress(caplog, model.compilations())
    return model


def _check_progress(caplog, compiled: int) -> None:
    """Warm-up's log counts the shapes up front and says "compiled k of n shapes" as it goes: the
    same n, which is what it compiles, k rising to n on the last line."""
    said = [r.getMessage() for r in caplog.records if r.name == "engine.jax_backend.warm_up"]
    assert said[0] == f"warm-up: compiling {compiled} shapes", said
    counts = [(int(m[1]), int(m[2])) for line in said[1:] if (m := re.match(r"warm-up: compiled (\d+) of (\d+) shapes", line))]
    assert len(counts) == len(said) - 1 >= 4, said  # a line at each quarter at least
    assert {n for _, n in counts} == {compiled} and counts[-1][0] == compiled, said
    assert [k for k, _ in counts] == sorted({k for k, _ in counts}), said  # rising


def test_the_cpu_shape_of_the_defaults_compiles_67_shapes(caplog):
    prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
    model = _warm(caplog, kernels=True, min_rows=1, min_bucket=None)  # the smallest chunk as decode-server sets it
    assert model.row_buckets == (1, 2, 4, 8) and model.attend_buckets == (256,)
    assert model.buckets == (8, 16, 32, 64, 128, 256)  # from the CPU's default budget, 8
    # decode steps, 4 rows x 1 attend: the layers alone (a step that samples or waits for its
    # rows), the greedy step as one executable, the layers with an 8-token chunk along (the
    # default budget); per row bucket the sampler, greedy and full (4 x 2); per prompt bucket:
    # embed, one prefill layer, its last position as the smallest row bucket's rows (6 x 3); the
    # mask write; a step's constrained rows written at once, per row bucket (4)
    assert model.fused_chunk_tokens == 8 and model.fused_chunk_sizes == (8,)
    # packed prefill: per packed size (every prompt bucket) a layer, and the last positions per
    # row bucket from 2 (6 x (1 + 3))
    assert model.packed_prefill_sizes == model.buckets and model.packed_prefill_rows == (2, 4, 8)
    assert model.samples_apart == 1  # a stream alone samples apart (issue 43): the layers alone, above
    assert model.compilations() == 4 * 3 + 4 * 2 + 18 + 1 + 4 + 6 * 4 == 67


def test_the_plain_accelerator_shape_of_the_defaults_compiles_22_shapes(caplog):
    # an accelerator's defaults: no chunk along, rows from 16, one packed size (the largest, 256),
    # the sampler split off (greedy and full)
    model = _warm(caplog, kernels=False, min_rows=16, fused_chunk_tokens=0, min_packed=256, split_sampler=True)
    assert model.row_buckets == (8,)  # the batch itself: no bucket below 16 rows
    assert model.attend_buckets == (128, 256)
    assert model.packed_prefill_sizes == (256,) and model.packed_prefill_rows == (8,)
    # decode steps' layers: 1 row bucket x 2 attend, and its two samplers; 5 prompt buckets x 3;
    # mask; the constrained rows' write (1 row bucket); a packed layer (its last positions at 8
    # rows are the 256-token prompt bucket's own program)
    assert model.samples_apart == 8
    assert model.compilations() == 2 + 2 + 15 + 1 + 1 + 1 == 22


def test_speculative_decoding_adds_a_verify_step_per_row_and_guess_bucket(caplog):
    # test_verify's float32 tiny-llama (support.tiny_served's: the served options at 4 slots and a
    # context of 64; with max_guesses 4, off, 0, by default: no verify shape, as the counts above
    # show; and verify steps of at most 2 rows), lowered: the same 49 programs that its warm-up
    # compiles there for real (tests/test_verify.py counts them in jit's caches and JAX's compile
    # events, and shows that nothing compiles after), so the lowered counts here are the compiled
    # ones where both are taken. The verify steps are one per verify row bucket (those up to the
    # one that holds max_verify_rows 2, each of R x 5 fed tokens within the CPU kernels' products
    # of up to 64 rows: 1 and 2), guess bucket (1, 2, 4) and attend shape (1), on top of 43: 4 prompt buckets x 3,
    # 3 rows x (the layers alone, the greedy step, the layers with the 8-token chunk), 3 rows x 2
    # samplers, the mask, 3 constrained-row writes, 4 packed sizes x (a layer, the last positions
    # of 2 row buckets).
    prerequisites.cpu_kernels()
    model = lower_only(tiny_served.load(max_guesses=4, max_verify_rows=2))
    with caplog.at_level(logging.INFO, logger="engine.jax_backend.warm_up"):
        model.warm_up()
    _check_progress(caplog, model.compilations())
    assert model.verify_rows == (1, 2) and model.guess_buckets == (1, 2, 4) and model.attend_buckets == (64,)
    assert model.compilations() == 4 * 3 + 3 * 3 + 3 * 2 + 1 + 3 + 4 * 3 + 2 * 3 == 49
