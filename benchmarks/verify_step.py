"""What a verify step of speculative decoding (issue 45) costs against a plain decode step: the
real model (the default one, int8 from its GGUF, the CPU kernels), or random weights of a GPU
check shape (`--shape`, for an accelerator: the issue's 1B shape at batch 1 and 64), `--batch`
sequences, each its last sample and K guesses fed in one step, against one plain decode step of
the same sequences, for each K the model compiles (its guess buckets up to `--guesses`: 1, 2, 4).

    python benchmarks/verify_step.py [--model DIR] [--guesses 4] [--batch 1] [--rounds 30]
    python benchmarks/verify_step.py --shape llama-3.2-1b [--dtype bfloat16] --batch 64 [--project] [--json F]

The machine is shared and noisy, so the rounds interleave: each round times one decode step, a
pipelined loop of `--loop` plain steps (each dispatched before the one before it is read, as the
engine runs: its time a token), and one verify step of each K (the order rotating per round), and
each ratio is taken within the round. Printed: the median milliseconds of each and the median
ratio to the decode step with its range. The guesses are ids the model does not continue with, so
every row runs all its K + 1 tokens and returns one sample. With the ratio r and a accepted
guesses per verify on average, speculation yields (1 + a) / r tokens per decode step's time
(before the proposer's own cost).

`--project` (batch 1): the recorded answers of the default model (benchmarks/speculative_replay.py)
replayed at the costs measured here, each verify step costing its median time over the pipelined
loop's time a token (a verify step is synchronous: its host part is in its time, so no break is
added): the on / off ratio the n-gram proposer would give on the copy and chat workloads, and what
a proposer that never guesses wrong would. With random weights (`--shape`) the acceptance cannot
be measured, only the costs: the projection is how the default model's answers would fare at them.
`--shape NAME[/F]` takes a shape of benchmarks/gpu_check/plan.py (llama-3.2-1b, llama-3-8b), /F
scaled down F times for a rehearsal on a CPU; `--dtype` defaults to bfloat16 on an accelerator and
float32 on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.interleaved import ratio_lines, run_rounds, within_rounds  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from engine.core.model import DecodeInput, SlotSetup, VerifyInput  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.jax_backend.verify import guess_buckets  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "tokenwire" / "models" / "smollm2-135m-instruct"
PROMPT = 128  # tokens each sequence is prefilled with


def context_for(rounds: int, loop: int, guesses: int) -> int:
    """Room for the rounds' positions (a decode step, the loop and a verify of each K a round,
    compiling included), whole multiples of 64."""
    per_round = 1 + loop + sum(k + 1 for k in guess_buckets(guesses)) + 1
    return -(-(PROMPT + (rounds + 2) * per_round + 8) // 64) * 64


def random_shape_model(shape, dtype: str, batch: int, context: int, guesses: int) -> JaxModel:
    """Random weights of a GPU check shape, one attend bucket (the context) and one prompt bucket,
    as the GPU check's speed phases build theirs (few compiles); verify steps up to `batch` rows."""
    from benchmarks.gpu_check.random_model import random_model

    model, _ = random_model(shape, dtype, max_batch_size=batch, max_context_length=context, min_attend=context,
                            min_bucket=PROMPT, max_chunk=PROMPT, fused_chunk_tokens=0, max_guesses=guesses,
                            max_verify_rows=batch)
    return model


def load(a: argparse.Namespace, context: int) -> JaxModel:
    """The model the rounds time: the default one as decode-server serves it on the CPU, or
    random weights of `--shape`."""
    if a.shape is None:
        return JaxModel.load(a.model, max_batch_size=a.batch, max_context_length=context, weights="int8",
                             max_guesses=a.guesses, max_verify_rows=a.batch)
    import jax

    from benchmarks.gpu_check.plan import LLAMA3_8B, LLAMA32_1B

    name, _, factor = a.shape.partition("/")
    shapes = {s.name: s for s in (LLAMA3_8B, LLAMA32_1B)}
    if name not in shapes:
        raise SystemExit(f"verify_step: --shape must be one of {', '.join(shapes)} (optionally /F), got {a.shape!r}")
    dtype = a.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    return random_shape_model(shapes[name].scaled(int(factor or 1)), dtype, a.batch, context, a.guesses)


def measure(model: JaxModel, batch: int, rounds: int, loop: int, project: bool) -> dict:
    """Slots 0..batch-1 prefilled, then the interleaved rounds (the module docstring): each case's
    times a round, the median of each and its ratio to the decode step, and with `project` (batch
    1) the replay at these costs. The model's context must hold `context_for` positions; its slots
    are released at the end."""
    pages = model.info.max_context_length // model.kv.page_size
    at = []
    for slot in range(batch):
        model.set_pages(slot, list(range(1 + slot * pages, 1 + (slot + 1) * pages)))
        prompt = tuple(range(100 + slot, 100 + slot + PROMPT))
        model.prefill(slot, prompt, SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset()), False)
        at.append(PROMPT)

    def step() -> None:
        model.dispatch([DecodeInput(s, None, at[s], False) for s in range(batch)])
        for s in range(batch):
            at[s] += 1

    def decode() -> float:
        start = time.perf_counter()
        step()
        model.collect()
        return time.perf_counter() - start

    def pipelined() -> float:
        start = time.perf_counter()
        step()
        for _ in range(loop - 1):
            step()
            model.collect()
        model.collect()
        return (time.perf_counter() - start) / loop

    def verify(k: int) -> float:
        guesses = tuple(range(300, 300 + k))  # ids the model does not continue with: whole rows run
        start = time.perf_counter()
        runs = model.verify([VerifyInput(s, at[s], guesses, False) for s in range(batch)])
        took = time.perf_counter() - start
        for s, run in enumerate(runs):
            at[s] += len(run)
        return took

    cases = {"decode": decode, "pipelined": pipelined,
             **{f"verify K={k}": (lambda k=k: verify(k)) for k in model.guess_buckets}}
    for case in cases.values():  # compile each
        case()
    times = run_rounds(cases, rounds)
    for slot in range(batch):
        model.release(slot)
    over = within_rounds(times, "decode")
    result = {"batch": batch, "rounds": rounds, "context_at_end": at[0], "times": times, "cases": {
        name: {"median_ms": 1e3 * statistics.median(v), "over_decode": statistics.median(over[name]),
               "over_decode_range": [min(over[name]), max(over[name])]}
        for name, v in times.items()}}
    if project:
        from benchmarks.speculative_replay import project as replay_at

        over_loop = within_rounds(times, "pipelined")
        cost = {k: statistics.median(over_loop[f"verify K={k}"]) for k in model.guess_buckets}
        result["verify_over_pipelined"] = cost
        result["projected"] = replay_at(cost, 0.0, oracle=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--shape", help="random weights of this GPU check shape instead (NAME or NAME/F)")
    parser.add_argument("--dtype", help="with --shape: bfloat16 on an accelerator, float32 on a CPU by default")
    parser.add_argument("--guesses", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--loop", type=int, default=8, help="plain steps in each round's pipelined loop")
    parser.add_argument("--project", action="store_true", help="batch 1: the recorded answers replayed at these costs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    a = parser.parse_args()
    if a.project and a.batch != 1:
        raise SystemExit("verify_step: --project models batch 1 only (the replay's loop)")
    model = load(a, context_for(a.rounds, a.loop, a.guesses))
    result = measure(model, a.batch, a.rounds, a.loop, a.project)
    result["model"], result["machine"] = a.shape or f"{a.model.name} int8", describe("jax", "jaxlib")
    print(f"{result['model']}, batch {a.batch}, {a.rounds} rounds, context {result['context_at_end']} at the end, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"machine: {result['machine']}")
    print("\n".join(ratio_lines(result.pop("times"), "decode", "ms")))
    for line in projection_lines(result):
        print(line)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


def projection_lines(result: dict) -> list[str]:
    """`measure`'s projection, as lines (none without it)."""
    if "projected" not in result:
        return []
    costs = ", ".join(f"K={k} {c:.2f}" for k, c in result["verify_over_pipelined"].items())
    lines = [f"a verify step over the pipelined loop's time a token: {costs}"]
    for name, r in result["projected"].items():
        lines.append(f"projected {name}, batch 1 (the default model's recorded answers): on / off {r['on_off']:.2f} "
                     f"(a flawless lookup {r['every copy found']:.2f}, every guess right {r['every guess right']:.2f})")
    return lines


if __name__ == "__main__":
    main()
