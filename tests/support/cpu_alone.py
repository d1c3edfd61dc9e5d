"""`alone()`: a stretch of a test that must have the machine's CPUs to itself, among pytest-xdist's
workers (scripts/test runs the suite on several).

A run-wide readers-writer lock on a file all the run's workers share (fcntl.flock): every test
holds it shared while it runs (tests/conftest.py, `_cpu_share`), and `alone()` turns that into an
exclusive hold, so it starts once the other workers' running tests have ended, and none starts
another until it is done. What needs it: the CPU kernels' thread-pool tests
(`support.pool_threads`), which check that a call ran on all of n threads; a worker thread that
another process's load keeps off the CPU leaves its chunks to the others, and the check fails
for a reason that is not the pool's. Outside a worker, or before the shared hold is taken, it
does nothing (one process alone has the CPUs it has).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_fd: int | None = None


def open_lock(path: Path) -> None:
    """Opens the run's lock file (created if need be); once per worker process."""
    global _fd
    if _fd is None:
        _fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def shared() -> None:
    if _fd is not None:
        fcntl.flock(_fd, fcntl.LOCK_SH)


def release() -> None:
    if _fd is not None:
        fcntl.flock(_fd, fcntl.LOCK_UN)


@contextmanager
def alone() -> Iterator[None]:
    """The CPUs to this worker while inside: the shared hold becomes exclusive (flock converts it
    by releasing first, so two workers asking at once cannot deadlock), then shared again."""
    if _fd is None:
        yield
        return
    fcntl.flock(_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(_fd, fcntl.LOCK_SH)
