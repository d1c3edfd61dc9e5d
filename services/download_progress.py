"""A download's progress for a person: bytes, share and rate on stderr.

`pull` (engine.model_store.registry) reports bytes as pip receives them; this draws them. On a
terminal, one bar redrawn in place; when stderr is a file or a pipe (a container's log), a line
every `interval_s` and one at the end, so a log is neither silent for a minute nor flooded.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

BAR_WIDTH = 30


class DownloadProgress:
    """A `(done, total)` callback (registry.Progress) that draws what it is told."""

    def __init__(
        self, stream: TextIO | None = None, *, tty: bool | None = None, interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self._interval_s, self._clock = interval_s, clock
        self._started: float | None = None
        self._shown = -float("inf")  # when a log line was last written

    def __call__(self, done: int, total: int) -> None:
        now = self._clock()
        if self._started is None:
            self._started = now
        finished = total > 0 and done >= total
        text = self._text(done, total, now - self._started)
        if self._tty:
            filled = BAR_WIDTH * done // total if total else 0
            self._stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}" + ("\n" if finished else ""))
        elif finished or (done and now - self._shown >= self._interval_s):
            self._stream.write(f"downloaded {text}\n")
            self._shown = now
        self._stream.flush()

    @staticmethod
    def _text(done: int, total: int, elapsed_s: float) -> str:
        rate = f", {done / elapsed_s / 1e6:.1f} MB/s" if elapsed_s > 0 else ""
        if not total:
            return f"{done / 1e6:.1f} MB{rate}"
        return f"{done / 1e6:.1f} of {total / 1e6:.1f} MB ({100 * done // total}%){rate}"
