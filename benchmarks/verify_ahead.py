"""What a verify step costs the decode loop around it (speculative decoding, issue 45): after a
read of the step in flight, or enqueued behind that step ("ahead", as the engine does for the
n-gram proposer: engine.core.speculative_step), on the real model (the default one, int8 from its
GGUF, the CPU kernels, as decode-server loads it), one sequence.

    python benchmarks/verify_ahead.py [--model DIR] [--rounds 12] [--tokens 48] [--every 6] [--guesses 1]

Each loop decodes `--tokens` tokens with plain pipelined steps (dispatch the next step, then read
the one before it), the host one step behind the device as the engine runs; every `--every`-th
step is replaced by:
* read: the step in flight is read, then a plain step is dispatched (the pipeline's break alone,
  what a proposer that expected a guess and then had none cost the engine before "ahead");
* read + verify: the step in flight is read, then a verify step of `--guesses` guesses runs (the
  engine's path for a draft model);
* ahead verify: the verify step is enqueued behind the step in flight, which is read after it.
The guesses are ids the model does not continue with, so every verify yields one token, as a
plain step does, and the difference in time is the verify's whole cost to the loop. Printed: each
loop's time a token against the plain loop's, the median ratio of the rounds (interleaved, the
order rotating, so a shared machine's noise falls on all) and its range.
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
from benchmarks.machine import describe  # noqa: E402
from engine.core.model import DecodeInput, SlotSetup, VerifyInput  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "tokenwire" / "models" / "smollm2-135m-instruct"
MODES = ("plain", "read", "read + verify", "ahead verify")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48, help="tokens a loop")
    parser.add_argument("--every", type=int, default=6, help="a break or verify every N steps")
    parser.add_argument("--guesses", type=int, default=1, help="guesses a verify step")
    a = parser.parse_args()
    context = 1024
    model = JaxModel.load(a.model, max_batch_size=1, max_context_length=context, weights="int8", max_guesses=a.guesses)
    model.warm_up()
    pages = list(range(1, 1 + context // model.kv.page_size))
    prompt = tuple(range(100, 228))  # 128 tokens
    guesses = tuple(range(300, 300 + a.guesses))  # ids the model does not continue with
    setup = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())

    def loop(mode: str) -> float:
        """Seconds a token of one loop of `mode` (the module docstring)."""
        model.set_pages(0, pages)
        model.prefill(0, prompt, setup, False)
        at, produced, in_flight, step = len(prompt), 0, False, 0
        started = time.perf_counter()
        while produced < a.tokens:
            step += 1
            if mode == "plain" or step % a.every:  # dispatch the next, then read the one in flight
                model.dispatch([DecodeInput(0, None, at, False)])
                at += 1
                if in_flight:
                    model.collect()
                    produced += 1
                in_flight = True
            elif mode == "read":
                if in_flight:
                    model.collect()
                    produced += 1
                model.dispatch([DecodeInput(0, None, at, False)])
                at += 1
                in_flight = True
            else:
                if mode == "read + verify" and in_flight:
                    model.collect()
                    produced, in_flight = produced + 1, False
                (run,) = model.verify([VerifyInput(0, at, guesses, False)])
                at, produced = at + len(run), produced + len(run)
                if in_flight:  # ahead: read after the verify that ran behind it
                    model.collect()
                    produced, in_flight = produced + 1, False
        if in_flight:
            model.collect()
            produced += 1
        took = time.perf_counter() - started
        model.release(0)
        return took / produced

    for mode in MODES:  # untimed: each path's first calls
        loop(mode)
    times = run_rounds({mode: (lambda mode=mode: loop(mode)) for mode in MODES}, a.rounds)
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}")
    print(f"{a.rounds} rounds of {a.tokens} tokens, a break every {a.every} steps, {a.guesses} guesses a verify, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("\n".join(ratio_lines(times, "plain", "ms a token", digits=3)))

if __name__ == "__main__":
    main()
