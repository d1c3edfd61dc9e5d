"""One configuration of the real default model (SmolLM2-135M-Instruct), shared by the test files
that load it, as support.tiny_served is for the tiny checkpoints.

Each decode shape of the 30-layer model compiles every layer (several seconds of CPU each), and
the run's persistent compilation cache (tests/conftest.py, `_compilation_cache`) only answers a
program compiled before with the same shapes: the same slots, context and page pool. So
test_real_model (one int8 load, as served, for its services, its speculation and its agreement
with float32, which it loads in the same shapes) and test_prefill_chunked (float32, prompts of
~300 tokens) load this one configuration, and whichever runs first compiles the 8-row float32
decode step that the other reads back.

`CONFIG`: decode-server's configuration (engine.core.model_options.SERVED: the CPU kernels, the
served smallest chunk, chunks along with decode steps, the prefix pool) with 8 slots (the batch
the int8 agreement was measured at), a context of 512 with prompt chunks up to 256 (every piece
size test_prefill_chunked cuts a prompt into), and one row bucket, 8: every decode step runs
8 rows, the idle ones masked, so the files meet on the same decode program and each format
compiles one decode shape where the served ladder (1, 2, 4, 8 rows) would be four. The files' claims
compare two runs in this one configuration (chunked against whole prefill, int8 against float32)
or hold against fixed answers ("The capital of France is Paris."), so no claim rests on which row
bucket a step ran in. `weights` is the caller's: float32 where a claim compares against float32,
the served `auto` (int8 from the model's GGUF) otherwise.
"""

from __future__ import annotations

from pathlib import Path

from engine.jax_backend.jax_model import JaxModel

CONFIG = {"max_batch_size": 8, "max_context_length": 512, "max_chunk": 256, "min_rows": 8, "dtype": "float32"}


def load(model_dir: Path, *, cls: type[JaxModel] = JaxModel, **changes) -> JaxModel:
    """The real model (`model_dir`, the `real_model` fixture's directory) in CONFIG, loaded by
    `cls` (a JaxModel subclass compiles the same programs), with `changes` on top: `weights`, or a
    knob that only picks which shapes it compiles (`min_bucket`, `fused_chunk_tokens`,
    `max_guesses`). Not warmed up: the caller decides."""
    return cls.load(model_dir, **{**CONFIG, **changes})
