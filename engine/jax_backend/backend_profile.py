"""What this process's JAX backend does by default: one `BackendProfile`, built once.

Every "on this backend, by default" question is answered here and nowhere else: the smallest
decode row bucket and packed prefill size, the scheduler's prompt budget per step (and with it
the smallest prompt chunk), whether the decode step's sampler is split off, the compute dtype,
the XLA compiler options, whether XLA:CPU's scratch is kept mapped, and whether the CPU kernels
can apply. It is the only caller of `jax.default_backend()` in engine/ and services/.

`profile()` asks JAX for its backend, which starts it: call it only once the devices are set
(`mesh.request_cpu_devices` before, for tensor parallelism on a CPU host).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import jax
import numpy as np

log = logging.getLogger(__name__)

# Most prompt tokens, all prompts together, in one packed prefill (Model.prefill_packed): the
# largest prompt bucket up to this. A burst of short prompts is then about one call instead of one
# each, which on a GPU took a large share of a burst's first window (docs/benchmarks.md, 'Figures behind code comments').
PACKED_TOKENS = 256

# XLA:CPU hands matmuls with more than one row, batched attention products and reductions to
# YNNPACK by default; its own emitters and Eigen were faster for the decode shapes measured here
# (docs/benchmarks.md, "Design measurements"), so on CPU every call compiles with YNNPACK fusions off.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@dataclass(frozen=True)
class BackendProfile:
    """A backend's defaults. Two kinds: the CPU and an accelerator (GPU, TPU)."""

    name: str  # jax.default_backend(): "cpu", "gpu", "tpu"
    # Smallest decode row bucket. On the CPU a step's products cost more with every row, so rows
    # double from 1. On an accelerator a decode step reads every weight once whatever its rows, and
    # up to ~100 rows the arithmetic hides under that read, so smaller buckets would cost compiles
    # and save nothing (docs/benchmarks.md, 'Figures behind code comments').
    min_rows: int
    # Smallest packed prefill size compiled (the prompt buckets from it up to PACKED_TOKENS): on
    # the CPU a prefill is arithmetic and padding costs its share, so every bucket; on an
    # accelerator a pass of up to a few hundred token rows costs about what one row's does (the
    # weights' read), and each size is compiled at every start without the cache, so only
    # PACKED_TOKENS itself.
    min_packed: int
    # The scheduler's default prefill budget per step while others decode (Model.default_step_tokens),
    # so that a decoding stream's gaps stay within a few steps while a long prompt is read
    # (docs/benchmarks.md, "Long prompts"). On the CPU a chunk rides along with the decode step,
    # and 8 of its rows with a few decoding ones stay within one register block of the panel
    # kernel (12 rows), whose cost there is the weights' read: a stream's gaps while a long prompt
    # was read were closer to its steady gap than with 16 a step (docs/benchmarks.md, 'Figures behind code comments').
    step_tokens: int
    # Every decode step as its layers and then the row bucket's sampler (greedy or full, the host
    # picks). False (the CPU): a step whose rows are all greedy runs as one executable with the
    # greedy sampler inside, which saves a dispatch that is a measurable part of a batch-1 step
    # there; steps that sample, or carry a chunk along, are the two calls on every backend.
    split_sampler: bool
    dtype: str  # float32 on CPU (XLA:CPU's bfloat16 products are far slower there), bfloat16 elsewhere
    host_scratch: bool  # keep XLA:CPU's per-call scratch mapped (engine.jax_backend.host_memory)
    cpu: bool  # the CPU backend: where the C++ kernels can apply (cpu_kernels checks the rest)

    @functools.cached_property
    def compiler_options(self) -> dict[str, str] | None:
        """CPU_COMPILER_OPTIONS on a CPU backend whose XLA still knows the (experimental) flag; None
        elsewhere, so a jaxlib that renamed or dropped it compiles with its defaults instead of
        failing (and says so, once)."""
        if not self.cpu:
            return None
        try:
            jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(np.float32(0)).compile()
        except Exception as e:  # XLA rejects unknown options at compile time
            log.warning("XLA rejected the compiler options %s; compiling with its defaults: %s", CPU_COMPILER_OPTIONS, e)
            return None
        return CPU_COMPILER_OPTIONS


CPU = BackendProfile(
    name="cpu", min_rows=1, min_packed=1, step_tokens=8, split_sampler=False, dtype="float32",
    host_scratch=True, cpu=True,
)
ACCELERATOR = BackendProfile(
    name="accelerator", min_rows=16, min_packed=PACKED_TOKENS, step_tokens=512, split_sampler=True,
    dtype="bfloat16", host_scratch=False, cpu=False,
)


@functools.cache
def profile() -> BackendProfile:
    """This process's profile (its backend is fixed for its life, so built once)."""
    name = jax.default_backend()
    return CPU if name == "cpu" else dataclasses.replace(ACCELERATOR, name=name)
