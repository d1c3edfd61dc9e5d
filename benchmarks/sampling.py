"""What sampling costs per step on this machine: engine/jax_backend/sampling.py's `sample` and
`top_logprobs` together (as the decode step calls them), jitted, on random logits of the real
vocabulary sizes, at each batch size.

    python benchmarks/sampling.py [--vocabs 49152,151936] [--batches 1,8,32] [--rounds 5]
                                  [--calls 3] [--against REV]

Variants (columns): the CPU strategy (a branch skips what no row needs) with the top_k candidate
cap at 64, 128 (the module's CAP) and 256; the accelerators' strategy (threshold searches and a
two-stage top-k, everything computed, then selected), run here on the CPU, which is what the CPU
would pay with BRANCH_ON_CPU off; and, with `--against REV`, sampling.py as it was at git
revision REV (its public `sample`/`top_logprobs`).

Cases (rows): all rows greedy; plain sampling (temperature 1, no cut); a chat-like cut
(temperature 0.8, top_k 50, top_p 0.9 on peaked logits, inside the cap); top_p 0.95 on flat
logits, where the candidates fall short and the exact select runs.

The machine is shared and noisy, so the run is interleaved: every round times each case with
every variant (variant order rotated per round), `--calls` calls each, and each variant's ratio
to the CPU strategy at CAP is taken within the round. Printed: milliseconds per call and that
ratio, medians over the rounds with the range.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402
from engine.jax_backend import sampling  # noqa: E402
from engine.jax_backend.sampling import CAP, SlotSampling, seed_words  # noqa: E402

BASE = f"branch, cap {CAP}"


def _step(sample: Callable, top_logprobs: Callable) -> Callable:
    def step(logits, params, positions, mask, masked, wanted):
        return sample(logits, params, positions, mask, masked), top_logprobs(logits, wanted)

    return jax.jit(step)


def _variants(against: str | None) -> dict[str, Callable]:
    def ours(skip: bool, cap: int) -> Callable:
        return _step(partial(sampling._sample, skip=skip, cap=cap), partial(sampling._top_logprobs, skip=skip))

    variants = {f"branch, cap {cap}": ours(True, cap) for cap in (64, CAP, 256)}
    variants["select (accelerators)"] = ours(False, CAP)  # the cap plays no part there
    if against:
        show = ["git", "show", f"{against}:engine/jax_backend/sampling.py"]
        source = subprocess.run(show, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        path = Path(tempfile.mkdtemp()) / "sampling_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("sampling_before", path)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        variants[f"at {against}"] = _step(before.sample, before.top_logprobs)
    return variants


def _cases(b: int, v: int) -> dict[str, tuple]:
    rng = np.random.default_rng(0)
    peaked = rng.normal(0, 2, (b, v)).astype(np.float32)
    peaked[np.arange(b)[:, None], rng.integers(0, v, (b, 3))] += 12  # a few clear favourites
    flat = rng.normal(0, 0.5, (b, v)).astype(np.float32)

    def params(temperature: float, top_k: int, top_p: float) -> SlotSampling:
        full = lambda x, dtype: np.full(b, x, dtype)  # noqa: E731
        seeds = np.array([seed_words(s) for s in range(b)], np.uint32)
        return SlotSampling(full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                            full(0.0, np.float32), seeds)

    rest = (np.arange(b, dtype=np.int32), np.zeros((b, v), bool), np.zeros(b, bool), np.zeros(b, np.int32))
    return {
        "greedy": (peaked, params(0.0, 0, 1.0), *rest),
        "plain sampling": (peaked, params(1.0, 0, 1.0), *rest),
        "top_k 50, top_p 0.9": (peaked, params(0.8, 50, 0.9), *rest),
        "top_p 0.95, flat (exact)": (flat, params(1.0, 0, 0.95), *rest),
    }


def _time(fn: Callable, args: tuple, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default="49152,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--calls", type=int, default=3, help="calls timed per case, variant and round")
    parser.add_argument("--against", default=None, help="also time sampling.py at this git revision")
    args = parser.parse_args()
    print(describe("jax", "jaxlib"))
    variants = _variants(args.against)
    names = list(variants)
    print("| V | B | case | " + " | ".join(f"{n}: ms" for n in names) + " | "
          + " | ".join(f"{n} / {BASE}" for n in names if n != BASE) + " |")
    print("|" + "---|" * (3 + 2 * len(names) - 1))
    for v in (int(x) for x in args.vocabs.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            cases = _cases(b, v)
            for fn in variants.values():  # compile and warm every variant for this shape
                for case in cases.values():
                    jax.block_until_ready(fn(*case))
            ms = {(c, n): [] for c in cases for n in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for c, case in cases.items():
                    for n in order:
                        ms[c, n].append(_time(variants[n], case, args.calls))
            for c in cases:
                ratios = [
                    median_range([x / y for x, y in zip(ms[c, n], ms[c, BASE])], "{:.2f}x") for n in names if n != BASE
                ]
                times = [median_range(ms[c, n], "{:.1f}") for n in names]
                print(f"| {v} | {b} | {c} | " + " | ".join(times) + " | " + " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
