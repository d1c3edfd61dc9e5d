"""What a verify step of speculative decoding (issue 45) costs against a plain decode step: the
real model (the default one, int8 from its GGUF, the CPU kernels), `--batch` sequences, each
its last sample and K guesses fed in one step, against one plain decode step of the same
sequences, for each K the model compiles (its guess buckets up to `--guesses`: 1, 2, 4).

    python benchmarks/verify_step.py [--model DIR] [--guesses 4] [--batch 1] [--rounds 30]

The machine is shared and noisy, so the rounds interleave: each round times one decode step and
one verify step of each K (the order rotating per round), and each ratio is taken within the
round. Printed: the median milliseconds of each and the median ratio with its range. The guesses
are ids the model does not continue with, so every row runs all its K + 1 tokens and returns one
sample. With the ratio r and a accepted guesses per verify on average, speculation yields
(1 + a) / r tokens per decode step's time (before the proposer's own cost).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.interleaved import ratio_lines, run_rounds  # noqa: E402
from engine.core.model import DecodeInput, SlotSetup, VerifyInput  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "tokenwire" / "models" / "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--guesses", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    a = parser.parse_args()
    context = 1024  # room for the rounds' positions
    model = JaxModel.load(a.model, max_batch_size=a.batch, max_context_length=context, weights="int8", max_guesses=a.guesses)
    pages = context // model.kv.page_size
    prompt = tuple(range(100, 228))  # 128 tokens
    at = []
    for slot in range(a.batch):
        model.set_pages(slot, list(range(1 + slot * pages, 1 + (slot + 1) * pages)))
        model.prefill(slot, prompt, SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset()), False)
        at.append(len(prompt))

    def decode() -> float:
        start = time.perf_counter()
        model.decode([DecodeInput(s, None, at[s], False) for s in range(a.batch)])
        took = time.perf_counter() - start
        for s in range(a.batch):
            at[s] += 1
        return took

    def verify(k: int) -> float:
        guesses = tuple(range(300, 300 + k))  # ids the model does not continue with: whole rows run
        start = time.perf_counter()
        runs = model.verify([VerifyInput(s, at[s], guesses, False) for s in range(a.batch)])
        took = time.perf_counter() - start
        for s, run in enumerate(runs):
            at[s] += len(run)
        return took

    cases = {"decode": decode, **{f"verify K={k}": (lambda k=k: verify(k)) for k in model.guess_buckets}}
    for case in cases.values():  # compile each
        case()
    times = run_rounds(cases, a.rounds)
    print(f"batch {a.batch}, {a.rounds} rounds, context {at[0]} at the end, load average {os.getloadavg()[0]:.1f}")
    print("\n".join(ratio_lines(times, "decode", "ms")))

if __name__ == "__main__":
    main()
