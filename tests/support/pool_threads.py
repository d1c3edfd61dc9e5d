"""`on_threads`: a kernel call on the CPU kernels' pool set to a thread count, checked to have run
on that many threads (tests of the pool's split: tests/test_cpu_kernels.py, tests/test_int8.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from engine.jax_backend import cpu_kernels
from support.cpu_alone import alone

T = TypeVar("T")


def on_threads(kernels: cpu_kernels.Kernels, threads: int, call: Callable[[], T], tries: int = 20) -> T:
    """Sets the pool to `threads` and runs `call` (which must wait for its result) until one call
    ran on all of them, at most `tries` times; asserts that one did and that none ran on fewer
    than one. A worker that is not scheduled in time leaves its chunks to the others, so the most
    of a few calls is what is checked. Another pytest-xdist worker's load can keep the pool's
    threads waiting on every try: then the tries run again with the CPUs to this test alone
    (`support.cpu_alone`), which waits for the other worker's running test to end, so it is
    taken only when the first round did not see every thread. -> the last call's result. The
    caller restores the count."""
    cpu_kernels.set_threads(kernels, threads)
    seen: list[int] = []

    def attempt() -> T:
        for _ in range(tries):
            result = call()
            seen.append(cpu_kernels.last_threads(kernels))
            if max(seen) == threads:
                break
        return result

    result = attempt()
    if max(seen) != threads:
        with alone():
            result = attempt()
    assert max(seen) == threads and min(seen) >= 1, seen
    return result
