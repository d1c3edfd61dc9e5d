"""Interleaved rounds, the way this project's benchmarks time several cases on a shared, noisy
machine: every round runs each case once, the order rotating by one each round, so that a burst
of noise falls on all the cases alike; a ratio is taken within each round, then its median and
range over the rounds."""

from __future__ import annotations

import statistics
from typing import Callable


def run_rounds(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case's result (a time) per round, the cases in rotating order."""
    names = list(cases)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            results[name].append(cases[name]())
    return results


def within_rounds(results: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Each case's ratio to `base`, round by round."""
    return {name: [t / b for t, b in zip(values, results[base])] for name, values in results.items()}


def ratio_lines(results: dict[str, list[float]], base: str, unit: str, digits: int = 2) -> list[str]:
    """A line per case: its median in milliseconds (`unit` names it), and its ratio to `base`
    within each round: median (range)."""
    lines = []
    over = within_rounds(results, base)
    for name, values in results.items():
        ratios = over[name]
        f = f"{{:.{digits}f}}"
        lines.append(f"{name}: {1e3 * statistics.median(values):.2f} {unit}, / {base}: median "
                     f"{f.format(statistics.median(ratios))} (range {f.format(min(ratios))}-{f.format(max(ratios))})")
    return lines
