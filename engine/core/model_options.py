"""`ModelOptions`: how the engine loads a model, with the defaults `decode-server` serves.

One source of defaults: `SERVED` is what `tokenwire decode-server` runs with no flags. The
CLI's model flags take their defaults from it (services/cli.py), `services.config.model_options`
builds one from the flags, and `JaxModel.load` takes it as its default (engine.jax_backend), so a
test that loads a model with no options runs what ships. A field left None is decided by the
backend (engine.jax_backend.backend_profile) once the model's devices are known.

Here, in engine.core, because services.config may not import the JAX backend (pyproject.toml's
import-linter contracts) and the backend imports the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelOptions:
    """How the engine loads a model; the same for decode-server and `generate --local`."""

    max_context_length: int | None = None  # None: min(the model's, 2048)
    dtype: str | None = None  # None: the backend's (float32 on CPU, bfloat16 on GPU)
    cpu_kernels: bool = True  # the C++ decode kernels where they apply (CPU, float32)
    cache_dir: Path | None = None  # models and the built kernels; None: ~/.cache/tokenwire
    compiler: str | None = None  # the C++ compiler for the kernels ($CXX); None: g++ or clang++
    max_prefill_chunk: int = 512  # the largest prompt piece one prefill call runs
    # positions of KV the page pool holds, all sequences together, rounded up to whole pages; 0:
    # max_batch_size x max_context_length. A cached prompt prefix lives in pages no sequence holds
    # (engine.core.kv_pages), so it costs no memory of its own
    kv_cache_tokens: int = 0
    # the pool as this fraction (0 < F <= 1) of an accelerator's memory for JAX (its bytes_limit),
    # less the weights and the working memory the memory plan counts; resolved to kv_cache_tokens
    # at load (engine.jax_backend.loading), which then holds None here. None: kv_cache_tokens decides.
    # At most one of the two is set.
    kv_cache_memory_fraction: float | None = None
    kv_page_size: int = 16  # positions per KV page
    tensor_parallel: int = 1  # devices one model is split over (engine.jax_backend.mesh)
    # JAX's persistent compilation cache in <cache>/xla: process-wide, so the process's entry point
    # turns it on (services.cli), not JaxModel.load
    compilation_cache: bool = True
    weights: str = "auto"  # "float32", "int8", "fp8", "auto": int8 where the kernels run and the model has its GGUF
    cpu_threads: int | None = None  # threads per CPU kernel call; None: the CPUs the process may use
    memory_limit_bytes: int | None = None  # the memory check's limit per device; None: what the device reports
    # the scheduler's prompt budget per step, and the longest chunk a decode step takes along; None:
    # the backend's (8 on CPU, 512 on an accelerator); below 16 the smallest chunk shape follows it
    max_step_tokens: int | None = None
    # the most guesses one row of a verify step takes (speculative decoding, issue 45): the shapes
    # warm-up compiles for `Model.verify`; 0: no verify step (speculation off); at most MOST_GUESSES
    max_guesses: int = 0
    # the most rows (sequences) a verify step takes at once: warm-up compiles its row buckets up to
    # the one that holds this many, and a call with more runs as several steps; 0: every row
    # bucket. decode-server sets it to --speculation-max-batch, since the engine verifies no step
    # of more rows than that (the default, 1: one row bucket instead of three or more)
    max_verify_rows: int = 0


# The most guesses a row may take: its guesses and its last sample, 64 tokens, are one product of
# the CPU kernels (engine.jax_backend.verify checks its own figure against this one). Here, without
# JAX, so that the command line refuses more before a model is read.
MOST_GUESSES = 63


SERVED = ModelOptions()  # what decode-server runs with no flags


def least_kv_pages(max_batch_size: int) -> int:
    """The smallest pool (pages, the null page not counted) that serves `max_batch_size` sequences
    decoded together: admission keeps a page free for each of them to grow into
    (engine.core.admission.reserve_pages), so a pool of max_batch_size pages or fewer could admit
    a request only when none runs. Both ways of sizing the pool are held to it (services.config for
    kv_cache_tokens, engine.jax_backend.memory_plan for the memory fraction)."""
    return max_batch_size + 1
