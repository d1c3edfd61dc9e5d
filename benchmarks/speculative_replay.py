"""An offline replay of batch-1 n-gram speculation (issue 45): the real model's greedy answers to
benchmarks/speculative.py's prompts, recorded once, then run through the scheduler's loop with
the proposer and policy code as they are, under a cost per step, so that a proposer or policy
change can be judged in a second instead of a benchmark run.

    python benchmarks/speculative_replay.py --record   # the answers (plain decoding), once
    python benchmarks/speculative_replay.py [--verify-cost 1.85] [--break-cost 0.15]

Why it is exact about acceptance: greedy speculation emits plain decoding's ids, so the
accepted run of a guess is its longest prefix equal to the recorded answer from there. What it
models: the engine's batch-1 loop (engine.core.speculative_step): before the step in flight is
read, a row not resting asks `expects`; if so the step is read, the proposer guesses (at most
`policy.guesses_of` ids, and the room left under the cap), and a verify step of the smallest
guess bucket that holds them runs; otherwise a plain pipelined step. Cost, in plain steps: a
plain step 1, a verify step of K guesses `--verify-cost` scaled from K = 4 (K = 1, 2 as
measured beside it: docs/benchmarks.md, "Speculative decoding's verify step") plus
`--break-cost`, the host's synchronous part. Printed: the replayed on / off tok/s ratio per
workload, and the counts the engine's metrics would show.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core.speculation.ngram import NgramProposer  # noqa: E402
from engine.core.speculation.policy import SpeculationPolicy  # noqa: E402

ANSWERS = Path(__file__).resolve().parent / "results" / "speculative_answers.json"
EOS = 2  # the default model's end of sequence: a finished answer's last sample


def record(tokens: int) -> None:
    from benchmarks import speculative as bench  # (loads JAX: only when recording)
    from engine.jax_backend.jax_model import JaxModel
    from engine.model_store.registry import resolve_model

    model_dir = resolve_model("smollm2-135m-instruct", log=lambda line: print(line, file=sys.stderr))
    model = JaxModel.load(model_dir, max_batch_size=1, max_context_length=1024, max_guesses=4)
    model.warm_up()
    runner = bench.Bench(model, 4, 1)
    runner.speculate(False)
    answers = {}
    try:
        for name, messages in (("copy", bench.COPY), ("chat", bench.CHAT)):
            answers[name] = [{"prompt": list(p), "output": runner.burst([p], tokens)[0].ids}
                             for p in bench.encode_chats(model_dir, messages)]
    finally:
        runner.engine.stop()
    ANSWERS.write_text(json.dumps({"tokens": tokens, "answers": answers}) + "\n")
    print(f"wrote {ANSWERS}")


def replay(prompt: list[int], output: list[int], cap: int, policy: SpeculationPolicy | None,
           cost: dict[int, float], brk: float) -> tuple[float, dict]:
    """One request's decode phase (its first id from prefill) -> (its time in plain steps, counts)."""
    full = output + ([EOS] if len(output) < cap else [])  # what the model samples, finish included
    proposer, counts = NgramProposer(), {"verify": 0, "proposed": 0, "accepted": 0, "plain": 0}
    known, in_flight, time, history, row = 1, False, 0.0, None, None
    while known < len(output) or in_flight:
        if known + in_flight >= len(full):  # the last sample is in flight: read it
            known, in_flight = len(output), False
            continue
        if policy is not None:
            if history is None:
                history = proposer.open(prompt + output[:known])
                row, seen = policy.row(history, known), known
            history.extend(output[seen:known])
            seen = known
            if not policy.rest(row) and proposer.expects(history):
                if in_flight:  # the step in flight is read first
                    known, in_flight = known + 1, False
                    if known >= len(output):
                        break
                    history.extend(output[seen:known])
                    seen = known
                n = min(policy.guesses_of(row, policy.guesses), cap - known - 1)
                guess = proposer.propose([(history, n)])[0][:n] if n > 0 else ()
                if n > 0 and not guess:
                    policy.observe(row, n, 0)
                if guess:
                    m = next((i for i, t in enumerate(guess) if i >= len(full) - known - 1 or t != full[known + i]),
                             len(guess))
                    time += cost[min(k for k in cost if k >= len(guess))] + brk
                    policy.observe(row, len(guess), m)
                    counts["verify"] += 1
                    counts["proposed"] += len(guess)
                    counts["accepted"] += m
                    known += m + 1
                    continue
        time += 1.0  # a plain pipelined step: dispatch the next, read the one in flight
        counts["plain"] += 1
        known, in_flight = known + in_flight, True
    return time, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the answers first (plain decoding)")
    parser.add_argument("--tokens", type=int, default=192, help="max output tokens a request (with --record)")
    parser.add_argument("--verify-cost", type=float, default=1.85, help="a verify of 4 guesses, in plain steps")
    parser.add_argument("--break-cost", type=float, default=0.15, help="a verify step's synchronous host part")
    a = parser.parse_args()
    if a.record:
        record(a.tokens)
    data = json.loads(ANSWERS.read_text())
    scale = (a.verify_cost - 1.0) / 0.85  # K = 1, 2 as measured beside a K = 4 of 1.85
    cost = {1: 1.0 + 0.14 * scale, 2: 1.0 + 0.41 * scale, 4: a.verify_cost}
    for name, answers in data["answers"].items():
        plain = on = 0.0
        total = {"verify": 0, "proposed": 0, "accepted": 0, "plain": 0}
        for answer in answers:
            prompt, output = answer["prompt"], answer["output"]
            on_time, counts = replay(prompt, output, data["tokens"], SpeculationPolicy(4, 1), cost, a.break_cost)
            plain += replay(prompt, output, data["tokens"], None, cost, a.break_cost)[0]
            on += on_time
            total = {k: total[k] + counts[k] for k in total}
        print(f"{name}: on / off {plain / on:.2f}; {total['verify']} verify steps, accepted {total['accepted']} of "
              f"{total['proposed']} guesses, {total['plain']} plain steps")


if __name__ == "__main__":
    main()
