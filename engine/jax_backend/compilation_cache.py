"""JAX's persistent compilation cache, so that a restart loads warm-up's executables instead of
compiling them again.

Warm-up compiles every shape serving can use (tens of shapes; minutes on a GPU at large batch and
context), and a process restarts on every deploy, crash or scale-up. With the cache in a directory
that outlives the process, the second start reads them back: on the project's CPU machine the
default model's warm-up went from 53.5 s to 6.6 s (docs/benchmarks.md, "Design measurements").

A cached executable is code this process will run, like the CPU kernels' library
(engine.jax_backend.cpu_kernels), so the same rule applies: the directory must be this user's
own and writable by no one else, or the cache stays off (with a WARNING saying why) and every
start compiles.

Only `enable` touches JAX's global configuration, and it must run before the first compile. The
first directory a process enables is its cache for good: JAX goes on reading and writing the
cache it opened first, but keys every later executable on the directory configured (the path is
in the compile options the key hashes), so moving it would only key this process's executables
apart from every other process's (a test worker that loads a model as a server does, seen as
the same programs compiled under two keys in one run).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import jax

log = logging.getLogger(__name__)


def enable(directory: Path) -> bool:
    """Use `directory` (created, mode 0700, if missing) as the persistent compilation cache for
    every compile of this process, however short; where the process already has one, that one
    stays (module docstring). -> whether it is on (False, logged, when the directory cannot be
    made or is not private to this user)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory)
    except OSError as error:
        log.warning("XLA compilation cache off: %s; every start compiles its shapes", error)
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        log.warning(
            "XLA compilation cache off: %s is not a directory of uid %d that no one else can write "
            "(mode %o, uid %d); every start compiles its shapes", directory, os.geteuid(), stat.S_IMODE(st.st_mode), st.st_uid,
        )
        return False
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current) != directory:
        log.info("XLA compilation cache: %s stays this process's (not %s)", current, directory)
        return True
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # warm-up's many small compiles add up
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("XLA compilation cache: %s", directory)
    return True
