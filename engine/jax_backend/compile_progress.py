"""Warm-up's progress, as log lines: "compiled k of n shapes".

Warm-up compiles every shape serving can use before the model takes requests, which takes tens
of seconds on a CPU and minutes on a GPU without a compilation cache; these lines show an operator
that it is moving and how far it has got. The count is known up front (JaxModel.warm_up adds up
its ladders), so every line says k of the same n and the last one says n of n.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("engine.jax_backend.warm_up")


class CompileProgress:
    """Counts compiled shapes and logs a line at each quarter of `total`, at least every
    `interval_s` while shapes keep coming, and at the end."""

    def __init__(self, total: int, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done = total, 0
        self._interval_s, self._clock = interval_s, clock
        self._started = self._logged = clock()
        log.info("warm-up: compiling %d shapes", total)

    def advance(self, shapes: int = 1) -> None:
        before, self.done = self.done, self.done + shapes
        now = self._clock()
        quarter = self.done * 4 // max(self.total, 1) > before * 4 // max(self.total, 1)
        if quarter or now - self._logged >= self._interval_s:
            log.info("warm-up: compiled %d of %d shapes (%.1f s)", self.done, self.total, now - self._started)
            self._logged = now
