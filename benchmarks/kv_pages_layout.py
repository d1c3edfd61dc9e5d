"""The block tables `KvPages` makes under a simulated serving workload, and what they cost to make.

Why: the CPU decode kernel reads a row's pages one after another and is as fast as over a
contiguous cache only when they lie in runs of adjacent pages (benchmarks/paged_attention_kernel.py),
so the allocator hands them out in runs (engine/core/kv_pages.py). This drives it, and the free
list it replaced (`FreeListPages`), through the same traffic, and prints per allocator: the mean
and median run of adjacent pages in the live tables, and the time an admission, a decode step's
growth (most are no-ops: a page every page_size tokens) and a free take, in microseconds per call.
paged_attention_kernel.py times the decode kernel on the tables `served_tables` makes.

The workload (`Serving`): `slots` sequences decoded together, each admitted with a prompt of
20-200 ids (its own: no prefix is shared) and ending at a total length drawn from `lengths`; every
step each grows by one token, a finished one is freed and a waiting one admitted in its place
(FIFO, when `can_admit`); a growth that finds no page preempts `victim()` (freed and requeued).

    python -m benchmarks.kv_pages_layout [--slots 64] [--pages 1024] [--steps 4000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from engine.core.kv_pages import FreeListPages, KvPages

PAGE_SIZE = 16
ALLOCATORS = {"free list": FreeListPages, "runs": KvPages}


class Serving:
    """The module docstring's workload over one allocator, a step at a time; `seconds` and
    `calls` add up the time spent in admit, grow and free."""

    def __init__(
        self, allocator: type[KvPages], slots: int, num_pages: int, lengths: tuple[int, int], seed: int
    ) -> None:
        self.pool = allocator(num_pages, PAGE_SIZE, reserve_pages=min(slots, num_pages // 8))
        self.slots, self.lengths = slots, lengths
        self.rng = random.Random(seed)
        self.live: dict[int, list[int]] = {}  # sequence -> [its length, its final length]
        self.waiting: list[tuple[int, int]] = []  # (prompt length, final length), FIFO
        self.next_id = self.finished = 0
        self.seconds = {"admit": 0.0, "grow": 0.0, "grow a page": 0.0, "free": 0.0}
        self.calls = dict.fromkeys(self.seconds, 0)

    def _timed(self, name: str, call, *args):
        began = time.perf_counter()
        out = call(*args)
        self.seconds[name] += time.perf_counter() - began
        self.calls[name] += 1
        return out

    def _arrivals(self) -> None:
        while len(self.live) + len(self.waiting) < self.slots:
            prompt = self.rng.randint(20, 200)
            self.waiting.append((prompt, max(prompt + 1, self.rng.randint(*self.lengths))))
        while self.waiting and len(self.live) < self.slots:
            prompt, final = self.waiting[0]
            ids = list(range(self.next_id * 1000, self.next_id * 1000 + prompt))  # distinct: no shared prefix
            reserve = None if self.live else 0
            if not self.pool.can_admit(ids, reserve):
                return
            self._timed("admit", self.pool.admit, self.next_id, ids, reserve)
            self.live[self.next_id] = [prompt, final]
            self.waiting.pop(0)
            self.next_id += 1

    def step(self) -> None:
        """Admit what fits, then one decode step: every live sequence one token longer."""
        self._arrivals()
        for seq in list(self.live):
            if seq not in self.live:  # preempted earlier in this step
                continue
            state = self.live[seq]
            kind = "grow a page" if state[0] % PAGE_SIZE == 0 else "grow"  # position state[0] starts a page
            while not self._timed(kind, self.pool.grow, seq, state[0] + 1):
                victim = self.pool.victim()
                self._timed("free", self.pool.free, victim)
                self.waiting.insert(0, tuple(self.live.pop(victim)))  # its prompt: all it has so far
                if victim == seq:
                    break
            else:
                state[0] += 1
                if state[0] >= state[1]:
                    self._timed("free", self.pool.free, seq)
                    del self.live[seq]
                    self.finished += 1


def runs(pages: tuple[int, ...]) -> list[int]:
    """The lengths of a table's runs of adjacent page ids."""
    lengths = [1]
    for before, page in zip(pages, pages[1:]):
        if page == before + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def served_tables(allocator: type[KvPages], rows: int, keys: int, seed: int = 0) -> np.ndarray:
    """`rows` block tables of `keys` positions each ([rows, keys / PAGE_SIZE] int32, 0-based page
    ids), as `allocator` made them for live sequences of the workload: 2 x rows slots, final
    lengths keys..3 x keys, a pool of 2 x keys positions a slot (so it fills at times and
    preempts); after 3 x slots sequences have finished, the first step with `rows` sequences of
    at least `keys` positions, the earliest admitted of them. The ids are packed, keeping every
    pair of pages adjacent or not as it was, so the benchmark's pools stay small."""
    slots, width = 2 * rows, -(-keys // PAGE_SIZE)
    serving = Serving(allocator, slots, slots * 2 * width + 1, (keys, 3 * keys), seed)
    for _ in range(200_000):
        serving.step()
        long = [seq for seq, (length, _) in serving.live.items() if length >= keys]
        if serving.finished >= 3 * slots and len(long) >= rows:
            tables = np.array([serving.pool.pages(seq)[:width] for seq in long[:rows]])  # [R, W]
            return _packed(tables)
    raise RuntimeError(f"the workload never had {rows} sequences of {keys} positions")


def _packed(tables: np.ndarray) -> np.ndarray:
    """`tables` renumbered 0, 1, ... in page order, with one unused id wherever two of its pages
    that follow each other in the pool were not adjacent, so adjacency is kept and nothing else."""
    pages = np.unique(tables)
    gaps = np.concatenate([[0], np.cumsum(np.diff(pages) > 1)])
    new = np.arange(len(pages)) + gaps
    return new[np.searchsorted(pages, tables)].astype(np.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_pages_layout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--lengths", default="64,400", help="the range of final lengths (prompt + output)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    low, high = (int(n) for n in args.lengths.split(","))
    print(f"{args.slots} sequences of final lengths {low}-{high}, {args.pages} pages of {PAGE_SIZE}, {args.steps} "
          f"decode steps; microseconds per call: admit, grow within a page, grow to a new page, free")
    print(f"{'allocator':>10} {'run mean':>8} {'median':>6} {'admit':>6} {'grow':>6} {'+page':>6} {'free':>6} "
          f"{'admits':>6} {'grows':>7} {'+pages':>6} {'frees':>6}")
    for name, allocator in ALLOCATORS.items():
        serving = Serving(allocator, args.slots, args.pages, (low, high), args.seed)
        for _ in range(args.steps):
            serving.step()
        lengths = [n for seq in serving.live for n in runs(serving.pool.pages(seq))]
        us = {k: serving.seconds[k] / max(1, serving.calls[k]) * 1e6 for k in serving.seconds}
        n = serving.calls
        print(f"{name:>10} {statistics.mean(lengths):>8.1f} {statistics.median(lengths):>6.0f} {us['admit']:>6.2f} "
              f"{us['grow']:>6.2f} {us['grow a page']:>6.2f} {us['free']:>6.2f} {n['admit']:>6} {n['grow']:>7} "
              f"{n['grow a page']:>6} {n['free']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
