"""The order in which scripts/test hands test files to its pytest-xdist workers: longest first.

scripts/test runs a file per worker (`--dist loadfile`) and gives a worker its next file as it
finishes one. With a random file order (pytest-randomly) or xdist's own (most tests first), a file
of one long test (gpu_check's smoke profile, the tensor-parallel child) could start last and
leave the other worker idle until it ends: the same tests took from 9.7 to 11.5 minutes. Longest
first is the classic fix for this (a greedy list schedule on the longest jobs first ends within
4/3 of the best one): the short files fill in at the end.

Each file's cost is its summed set-up, call and tear-down time in seconds from an earlier run,
kept in file_costs.json beside this module. Tests inside a file keep pytest-randomly's shuffled
order (this is a stable sort of whole files), so order dependence inside a file still fails; a
file missing from the table (a new one) counts as the median file.

    TOKENWIRE_TEST_COSTS=write bash scripts/test    # refresh file_costs.json from this run
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("file_costs.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def ordered(nodeids: list[str], costs: dict[str, float]) -> list[int]:
    """The indices of `nodeids` with whole files longest first (by `costs`; a file not in it
    counts as the median), ties and each file's own tests in the order given."""
    default = statistics.median(costs.values()) if costs else 0.0
    return sorted(range(len(nodeids)), key=lambda i: -costs.get(file_of(nodeids[i]), default))


class FileOrder:
    """A pytest plugin: orders the collected tests (`ordered`), and where TOKENWIRE_TEST_COSTS
    is "write", sums each file's durations as the reports arrive (in the process that starts the
    run: xdist's workers send it theirs) and writes them to file_costs.json at the end."""

    def __init__(self, write: bool) -> None:
        self.write = write
        self.seconds: dict[str, float] = defaultdict(float)

    @pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle, which this keeps inside files
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        costs = json.loads(COSTS.read_text()) if COSTS.exists() else {}
        items[:] = [items[i] for i in ordered([item.nodeid for item in items], costs)]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.write:
            self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.write and self.seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
            costs = {name: round(s, 1) for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
            COSTS.write_text(json.dumps(costs, indent=0) + "\n")


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(FileOrder(os.environ.get("TOKENWIRE_TEST_COSTS") == "write"), "tokenwire-file-order")
