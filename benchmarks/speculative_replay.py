"""An offline replay of batch-1 n-gram speculation (issue 45): the real model's greedy answers to
benchmarks/speculative.py's prompts, recorded once, then run through the scheduler's loop with
the proposer and policy code as they are, under a cost per step, so that a proposer or policy
change can be judged in a second instead of a benchmark run.

    python benchmarks/speculative_replay.py --record   # the answers (plain decoding), once
    python benchmarks/speculative_replay.py [--verify-cost 1.85] [--break-cost 0.15] [--shortest N] [--oracle]

Why it is exact about acceptance: greedy speculation emits plain decoding's ids, so the
accepted run of a guess is its longest prefix equal to the recorded answer from there. What it
models: the engine's batch-1 loop (engine.core.speculative_step) for the n-gram proposer, which
guesses ahead: a row not resting asks for guesses at every step (at most `policy.guesses_of` ids,
and the room left under the cap); with a step in flight the proposer guesses one more from the
ids known, the first standing for the one in flight, and a verify step of the smallest guess
bucket that holds the rest runs behind that step; with none in flight (after a verify) it guesses
from all the ids, where `expects` says it has some; no guess is a plain pipelined step. Cost, in plain steps: a plain step 1, a
verify step of K guesses `--verify-cost` scaled from K = 4 (K = 1, 2 as measured beside it:
docs/benchmarks.md, "Speculative decoding's verify step") plus `--break-cost`, the pipeline's
restart after it (benchmarks/verify_ahead.py measures both together). `--shortest`: the fewest
ids the proposer looks a source up from. `--oracle`: the answers replayed again, under the same policy and
costs, with a proposer that guesses the recorded ids, at every step (the most any proposer could
give at these costs) and only where they continue an earlier copy of `--shortest` ids (the most
a lookup proposer could). Printed: the replayed on / off tok/s ratio per workload,
and the counts the engine's metrics would show.
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


class _Oracle:
    """A proposer that knows each answer (`--oracle`): its guesses are the recorded ids that
    follow. With `lookup` n, only as far as each of them follows its own last n ids somewhere
    before it (prompt or output): the most a proposer that looks copies up from n ids could guess."""

    guesses_ahead = True

    def __init__(self, prompt: list[int], full: list[int], lookup: int = 0) -> None:
        self.ids = prompt + full
        self.reachable = [not lookup or _follows(self.ids, i, lookup) for i in range(len(self.ids))]

    def open(self, ids):
        return list(ids)

    def propose(self, rows):
        guesses = []
        for history, n in rows:
            at = len(history)
            end = next((i for i in range(at, min(at + n, len(self.ids))) if not self.reachable[i]), min(at + n, len(self.ids)))
            guesses.append(tuple(self.ids[at:end]))
        return guesses

    def expects(self, history) -> bool:
        return len(history) < len(self.ids) and self.reachable[len(history)]


def _follows(ids: list[int], i: int, n: int) -> bool:
    """Whether ids[i] follows ids[i - n : i] somewhere before i."""
    if i < n:
        return False
    key = ids[i - n : i + 1]
    return any(ids[j : j + n + 1] == key for j in range(i - n))


def replay(prompt: list[int], output: list[int], cap: int, policy: SpeculationPolicy | None,
           cost: dict[int, float], brk: float, proposer: NgramProposer | None = None) -> tuple[float, dict]:
    """One request's decode phase (its first id from prefill) -> (its time in plain steps, counts)."""
    full = output + ([EOS] if len(output) < cap else [])  # what the model samples, finish included
    proposer, counts = proposer or NgramProposer(), {"verify": 0, "proposed": 0, "accepted": 0, "plain": 0}
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
            ahead = int(in_flight)  # guesses past the id in flight, whose stand-in is dropped
            if not policy.rest(row) and (ahead or proposer.expects(history)):
                n = min(policy.guesses_of(row, policy.guesses), cap - known - ahead - 1)
                guess = proposer.propose([(history, n + ahead)])[0][ahead : ahead + n] if n > 0 else ()
                if n > 0 and not guess and not ahead:
                    policy.observe(row, n, 0)
                if guess:
                    at = known + ahead  # the position of the verify's first sample in `full`
                    m = next((i for i, t in enumerate(guess) if i >= len(full) - at - 1 or t != full[at + i]),
                             len(guess))
                    time += policy_cost(cost, len(guess)) + brk
                    policy.observe(row, len(guess), m)
                    counts["verify"] += 1
                    counts["proposed"] += len(guess)
                    counts["accepted"] += m
                    known, in_flight = at + m + 1, False
                    continue
        time += 1.0  # a plain pipelined step: dispatch the next, read the one in flight
        counts["plain"] += 1
        known, in_flight = known + in_flight, True
    return time, counts


def policy_cost(cost: dict[int, float], guesses: int) -> float:
    """A verify step of `guesses` guesses, in plain steps: its guess bucket's."""
    return cost[min(k for k in cost if k >= guesses)]


def project(cost: dict[int, float], brk: float, shortest: int = NgramProposer().shortest,
            oracle: bool = False) -> dict[str, dict]:
    """The recorded answers replayed under `cost` (a verify step of each guess bucket, in plain
    pipelined steps) and `brk`: per workload ("copy", "chat") the on / off ratio and the counts,
    and with `oracle` the two oracles' ratios ("every guess right", "every copy found"). A row
    guesses up to the largest bucket `cost` has."""
    data = json.loads(ANSWERS.read_text())
    cap, results, most = data["tokens"], {}, max(cost)
    for name, answers in data["answers"].items():
        plain = on = 0.0
        total = {"verify": 0, "proposed": 0, "accepted": 0, "plain": 0}
        for x in answers:
            on_time, counts = replay(x["prompt"], x["output"], cap, SpeculationPolicy(most, 1), cost, brk,
                                     NgramProposer(shortest=shortest))
            plain += replay(x["prompt"], x["output"], cap, None, cost, brk)[0]
            on += on_time
            total = {k: total[k] + counts[k] for k in total}
        results[name] = {"on_off": plain / on, **total}
        if oracle:
            for lookup, key in ((0, "every guess right"), (shortest, "every copy found")):
                best = sum(replay(x["prompt"], x["output"], cap, SpeculationPolicy(most, 1), cost, brk,
                                  _Oracle(x["prompt"], x["output"] + [EOS], lookup))[0] for x in answers)
                results[name][key] = plain / best
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the answers first (plain decoding)")
    parser.add_argument("--tokens", type=int, default=192, help="max output tokens a request (with --record)")
    parser.add_argument("--verify-cost", type=float, default=1.85, help="a verify of 4 guesses, in plain steps")
    parser.add_argument("--break-cost", type=float, default=0.15, help="a verify step's synchronous host part")
    parser.add_argument("--oracle", action="store_true", help="also replay a proposer whose guesses are always right")
    parser.add_argument("--shortest", type=int, default=NgramProposer().shortest,
                        help="the fewest ids a copy's source is looked up from (the proposer's default)")
    a = parser.parse_args()
    if a.record:
        record(a.tokens)
    scale = (a.verify_cost - 1.0) / 0.85  # K = 1, 2 as measured beside a K = 4 of 1.85
    cost = {1: 1.0 + 0.14 * scale, 2: 1.0 + 0.41 * scale, 4: a.verify_cost}
    for name, r in project(cost, a.break_cost, a.shortest, a.oracle).items():
        print(f"{name}: on / off {r['on_off']:.2f}; {r['verify']} verify steps, accepted {r['accepted']} of "
              f"{r['proposed']} guesses, {r['plain']} plain steps")
        if a.oracle:
            print(f"{name}, every guess right: on / off {r['every guess right']:.2f}")
            print(f"{name}, every copy of {a.shortest} ids or more found: on / off {r['every copy found']:.2f}")


if __name__ == "__main__":
    main()
