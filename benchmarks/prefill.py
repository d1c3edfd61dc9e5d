"""Prefill speed of a model on this machine: seconds and tokens/s to read a prompt of each length
and sample its first token, in one process, interleaved over rounds.

    python benchmarks/prefill.py [--model smollm2-135m-instruct] [--lengths 128,512,2047] [--rounds 3]

Each round prefills one prompt of every length into slot 0 (best of `--repeats`), so a noisy
neighbour hits every length alike; the table gives the median over rounds with the range. Prompts
are random token ids (prefill cost does not depend on which). Warm-up (every compiled shape) is
timed once. The prompt runs as JaxModel runs it when serving: pieces of the compiled chunk shapes
(`--max-prefill-chunk`), each attending to the cache written so far.

Not here yet (issue 12): the time to first token of a long prompt while other streams decode, and
their inter-token gaps; the time to first token of a request sharing a cached prefix.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from engine.core.model import SlotSetup  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--lengths", default="128,512,2047", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every length once each)")
    parser.add_argument("--repeats", type=int, default=2, help="prefills per length and round; the best counts")
    parser.add_argument("--max-context-length", type=int, default=2048)
    parser.add_argument("--max-prefill-chunk", type=int, default=512, help="largest prompt piece one prefill call runs")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) >= args.max_context_length:
        parser.error(f"every length must be below --max-context-length ({args.max_context_length}): room for one token")

    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}; backend {jax.default_backend()}")
    started = time.perf_counter()
    model = JaxModel.load(
        model_dir, max_batch_size=1, max_context_length=args.max_context_length, dtype=args.dtype,
        max_chunk=args.max_prefill_chunk,
    )
    model.warm_up()
    warm_compilations = model.compilations()
    print(f"model {model_dir.name}: context {args.max_context_length}, chunk shapes {model.buckets}; "
          f"load and warm-up {time.perf_counter() - started:.1f} s; kernels {model.kernel_state}")
    setup = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())
    rng = np.random.default_rng(0)
    vocab = model.info.vocab_size
    seconds: dict[int, list[float]] = {n: [] for n in lengths}
    for round_ in range(1, args.rounds + 1):
        for n in lengths:
            prompt = tuple(int(t) for t in rng.integers(0, vocab, n))
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                model.prefill(0, prompt, setup, False)
                best = min(best, time.perf_counter() - start)
                model.release(0)
            seconds[n].append(best)
            print(f"round {round_}: {n} tokens in {best:.2f} s ({n / best:.0f} tok/s)", flush=True)
    print()
    print("| prompt tokens | seconds | tok/s |")
    print("|---|---|---|")
    for n in lengths:
        s = seconds[n]
        rates = [n / x for x in s]
        print(f"| {n} | {statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | "
              f"{statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) |")
    print(f"\ncompilations after warm-up: {model.compilations() - warm_compilations}")


if __name__ == "__main__":
    main()
