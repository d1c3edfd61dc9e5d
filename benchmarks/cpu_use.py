"""CPU time by process over one measurement, and how much of the host's CPU was stolen.

Why: on a shared 2-vCPU host the wall-clock figures of benchmarks/transport.py move by 2x between
identical runs (another guest takes the cores; /proc/stat's steal column shows it), while the CPU
time a process spends per token barely moves. So each service measurement also records the CPU
seconds of every process on the path (read from /proc/PID/stat: user + system, all threads), and
the host's steal share over the same window, so that a table can say what a change cost per token
and whether the host was starved during the run. Linux only: elsewhere `CpuMeter` measures nothing
(`available` is False) and the tables leave these columns out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (every thread); 0.0 once it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of proc(5))


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants now (children of every thread, from /proc/PID/task/*/children)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        try:
            tasks = list((PROC / str(current) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                pass
    return tree


def host_ticks() -> tuple[int, int]:
    """(all ticks, stolen ticks) of the host's CPUs so far, from /proc/stat's first line."""
    fields = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]), fields[7]  # user nice system idle iowait irq softirq steal (guest is in user)


@dataclass(frozen=True)
class CpuUse:
    """One measurement's CPU: seconds per group of processes, and the host's steal share."""

    seconds: Mapping[str, float]
    steal_share: float  # stolen / all CPU ticks of the host over the window (0..1)


class CpuMeter:
    """`groups`: a name -> a function giving that group's pids (asked at `start`, so processes
    started later are not counted; the groups here are servers started before the run)."""

    def __init__(self, groups: Mapping[str, Callable[[], Sequence[int]]]) -> None:
        self.available = (PROC / "stat").exists()
        self._groups = groups
        self._pids: dict[str, Sequence[int]] = {}
        self._start: dict[str, float] = {}
        self._ticks = (0, 0)

    def _cpu(self) -> dict[str, float]:
        return {name: sum(process_cpu_s(pid) for pid in pids) for name, pids in self._pids.items()}

    def start(self) -> None:
        if not self.available:
            return
        self._pids = {name: list(pids()) for name, pids in self._groups.items()}
        self._start, self._ticks = self._cpu(), host_ticks()

    def stop(self) -> CpuUse | None:
        if not self.available:
            return None
        end, (ticks, stolen) = self._cpu(), host_ticks()
        all_ticks, stolen_ticks = ticks - self._ticks[0], stolen - self._ticks[1]
        seconds = {name: end[name] - self._start[name] for name in end}
        return CpuUse(seconds, stolen_ticks / all_ticks if all_ticks > 0 else 0.0)


def this_process() -> list[int]:
    return [os.getpid()]
