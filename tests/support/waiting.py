"""Bounded waits: each fails the test when the condition is not reached within its limit, so a
broken feature fails instead of hanging the suite. None returns how long it took: how long is a
benchmark's question, not a test's; a test counts steps or rounds instead (`steps_until_freed`).

- `until` / `until_sync`: poll a predicate (from a coroutine, or blocking from a plain thread).
- `until_answer`: poll an async question until it gives the wanted answer.
- `steps_until_freed` / `steps_until_freed_sync`: wait for a slot to be freed, failing as soon as
  more than `at_most` of the model's decode steps passed with it held (the cancel did nothing),
  whatever the clock says.
- `read_line`: a subprocess's next stdout line, or a failure after the limit (a plain
  `readline()` blocks forever on a child that hangs before writing it).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import selectors
import subprocess
import time
from typing import Awaitable, Callable

# Bound on any one wait: far above the work the tests wait for on a busy 2-core machine, far
# below forever.
LIMIT_S = 10.0


async def until(predicate: Callable[[], object], what: str, limit_s: float = LIMIT_S, interval_s: float = 0.002) -> None:
    """Poll until `predicate()` is true (awaited, when it returns an awaitable: a health check);
    fails the test past `limit_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"{what}: not reached in {limit_s} s"
        await asyncio.sleep(interval_s)


def until_sync(predicate: Callable[[], object], what: str, limit_s: float = LIMIT_S, interval_s: float = 0.002) -> None:
    """`until` for a plain (blocking) test."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached in {limit_s} s"
        time.sleep(interval_s)


async def until_answer(ask: Callable[[], Awaitable[object]], wanted: object, what: str, limit_s: float = LIMIT_S,
                       interval_s: float = 0.05) -> None:
    """Poll `await ask()` until it answers `wanted`; fails the test past `limit_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while (got := await ask()) != wanted:
        assert loop.time() < deadline, f"{what}: still {got}, not {wanted}, after {limit_s} s"
        await asyncio.sleep(interval_s)


def _freed(held: Callable[[], object], steps: Callable[[], float], since: float, at_most: float) -> bool:
    if not held():
        return True
    taken = steps() - since
    assert taken <= at_most, f"a slot still held {taken:.0f} decode steps on: the request was not cancelled"
    return False


async def steps_until_freed(
    held: Callable[[], object], steps: Callable[[], float], since: float, at_most: float, limit_s: float = LIMIT_S
) -> float:
    """Wait until `held()` is false (no slot in use); returns the decode steps (`steps()`) taken
    since `since` by then. Fails as soon as more than `at_most` steps have passed with a slot still
    held (the request runs on: its cancel did nothing), or after `limit_s` (nothing steps)."""
    await until(lambda: _freed(held, steps, since, at_most), f"the slot freed ({steps() - since:.0f} decode steps on)", limit_s)
    return steps() - since


def steps_until_freed_sync(
    held: Callable[[], object], steps: Callable[[], float], since: float, at_most: float, limit_s: float = LIMIT_S
) -> float:
    """`steps_until_freed` for a plain (blocking) test."""
    until_sync(lambda: _freed(held, steps, since, at_most), f"the slot freed ({steps() - since:.0f} decode steps on)", limit_s)
    return steps() - since


def read_line(process: subprocess.Popen, limit_s: float = LIMIT_S) -> str:
    """The next line of `process.stdout`, a pipe that only this reads (byte by byte, from its file
    descriptor, so nothing after the line is taken from a later call); fails the test when no whole
    line comes within `limit_s` or the process closes its output first."""
    fd = process.stdout.fileno()
    deadline = time.monotonic() + limit_s
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            assert left > 0 and selector.select(left), f"no line from pid {process.pid} in {limit_s} s (so far {line!r})"
            byte = os.read(fd, 1)
            assert byte, f"pid {process.pid} closed its output (exit {process.poll()}) before a whole line: {line!r}"
            line += byte
    return line.decode()
