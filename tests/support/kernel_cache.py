"""The CPU kernels built once per test run, for the servers tests start with a cache of their own.

A `decode-server` started with `--cache DIR` (TOKENWIRE_CACHE) looks for the kernels in
DIR/kernels and, finding none, compiles them: a minute of g++ per test on a shared 2-core host,
for tests that are not about building. `seed(DIR)` puts the library this session found or built
(engine.jax_backend.cpu_kernels.status with the default options, the one in-process models
load) into DIR/kernels with its sha256 record, as a build would have left it, so the server finds
it "cached" and checks it as it would any cached library. The tests about building, finding and
trusting the library are in tests/test_cpu_kernels.py and build into their own directories.

`expected_state()` is what the served defaults give on this machine, worked out from the
machine (the CPU, a prebuilt library, a compiler) without asking a server or the loader.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _status():
    from engine.jax_backend import cpu_kernels

    return cpu_kernels.status()  # memoised there: the call support.prerequisites and JaxModel's default load make


def expected_state() -> str:
    """The state word a decode-server on its defaults reports here, from this machine's facts:
    "not applicable" (not an x86-64 CPU with AVX2, FMA and F16C, or not the CPU backend), else
    "on" when a prebuilt library or a C++ compiler is present, else "off"."""
    from engine.jax_backend import cpu_kernels

    if cpu_kernels._not_applicable():
        return cpu_kernels.NOT_APPLICABLE
    prebuilt = (cpu_kernels._KERNEL_DIR / cpu_kernels.library_name()).exists()
    return cpu_kernels.ON if prebuilt or cpu_kernels._compiler(None) else cpu_kernels.OFF


def seed(cache_dir: Path) -> bool:
    """Copy this session's library and its sha256 record into cache_dir/kernels (private, as a
    build makes it); False, writing nothing, when there is no library file to copy."""
    kernels = _status().kernels
    if kernels is None or not kernels.path.is_file():  # off, not applicable, or built for one process only
        return False
    target = cache_dir / "kernels"
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(target, 0o700)
    shutil.copyfile(kernels.path, target / kernels.path.name)
    os.chmod(target / kernels.path.name, 0o644)
    record = target / f"{kernels.path.name}.sha256"
    record.write_text(kernels.sha256 + "\n")
    os.chmod(record, 0o644)
    return True
