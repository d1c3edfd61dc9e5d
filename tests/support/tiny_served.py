"""One served configuration per tiny checkpoint, shared by the test files that load one.

Most of this suite's time is XLA compiling the tiny models' shapes. The run's persistent
compilation cache (tests/conftest.py, `_compilation_cache`) is keyed on the program compiled, so
a file that loads a checkpoint with the same options as another file reads every executable back
instead of compiling it (a tiny-llama warm-up: about a seventh of its CPU time), whichever
pytest-xdist worker compiled it first. That happens only when the configurations are the same, so
files with no reason of their own for another one load it here, and a file that loads another
configuration on purpose says why where it does.

`CONFIG` is decode-server's configuration (engine.core.model_options.SERVED: the CPU kernels, the
served smallest chunk and page size, a pool of a whole context per slot) at 4 slots (row buckets
1, 2, 4) and a context of 64 (prompt buckets 8 to 64), in float32: the CPU's served dtype, and
the one that claims of equal ids between two runs are about (support.backend).
"""

from __future__ import annotations

from pathlib import Path

from engine.jax_backend.jax_model import JaxModel

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CONFIG = {"max_batch_size": 4, "max_context_length": 64, "dtype": "float32"}


def load(name: str = "tiny-llama", *, cls: type[JaxModel] = JaxModel, **changes) -> JaxModel:
    """The checkpoint `name` (a folder of tests/assets) in CONFIG, loaded by `cls` (a JaxModel
    subclass that counts calls compiles the same programs), with `changes` on top: each is another
    program (`weights`, `split_sampler`), compiled once in the run by whichever file loads it
    first. Not warmed up: the caller decides."""
    return cls.load(ASSETS / name, **{**CONFIG, **changes})
