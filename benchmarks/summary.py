"""How the benchmarks print a measurement taken over interleaved rounds: its median, and its range."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence


def median_range(values: Sequence[float], fmt: str | Callable[[float], str] = "{:.2f}") -> str:
    """"median (min-max)", each value shown by `fmt`: a str.format pattern or a function."""
    show = fmt.format if isinstance(fmt, str) else fmt
    return f"{show(statistics.median(values))} ({show(min(values))}-{show(max(values))})"
