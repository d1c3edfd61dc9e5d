"""Decode step time of two checkouts side by side, interleaved finely, in one run.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py /tmp/before . [--batches 1,8,32] [--rounds 16] [--steps 8] [--pin CPU]
        [--processes N] [--after-xla-flags FLAGS] [--after-env NAME=VALUE ...]

Each checkout gets a worker process that loads the model once and prefills its slots with the
same random prompts (each checkout's own benchmarks/decode.py `Slots`). The parent then asks the
two in turn for `--steps` decode steps at each batch size, alternating which goes first, so the
noise of a shared machine falls on both alike; the idle worker waits on a pipe and uses no CPU.
Per round and batch it prints nothing; at the end, per batch size and mode, the median step time
of each, the ratio "after / before" of speeds (>1: after is faster) as median and range over the
rounds, the minor page faults and kernel (sys) milliseconds per step, which is how a
per-call allocation that faults its pages in shows (engine.jax_backend.host_memory), and the
process's CPU milliseconds (user + sys, every thread) per step.

`--pin CPU` measures work rather than speed, for a host too busy for wall clock to decide: both
workers run on that one CPU with one kernel thread (cpu_threads 1), so their CPU milliseconds
per step are the step's work, with no thread spinning while it waits for another that the host
has descheduled; the wall-clock ratio then says little.

`--processes N` splits the rounds over N pairs of worker processes, a fresh pair for each group
of rounds (which of the two warms up first alternating), and prints each pair's median speed and
CPU ratios per batch and mode as well. Two processes of the same code do not run at the same
speed: a worker's matrix products (identical code and weights) can run a few per cent slower or
faster than its twin's for the whole life of the process, by where the weights' 4 KiB pages
landed (the page walks of streaming them; in huge pages, `--after-env
GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, the spread shrank), so one pair cannot tell a 3%
difference between checkouts from that draw, however many rounds it runs; several pairs can
(docs/notes/design-measurements.md, "Paged KV at batch 1").

Modes: "read" dispatches a step and reads its samples before the next (the step's own time);
"lag" dispatches step N+1 before reading step N, as the engine does. A checkout whose Slots has
no `pipelined` (before the host ran one step behind) runs "lag" as "read", which is what its
engine did. Slots are released and prefilled again before a run would pass 500 positions.
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(checkout: str, model_dir: str, max_batch: int, context: int, prompt_len: int, weights: str, pin: int) -> None:
    """Serve "batch steps mode" lines on stdin with "seconds_per_step faults_per_step sys_per_step
    cpu_per_step"; `pin` >= 0: on that CPU alone, one kernel thread."""
    if pin >= 0:  # before JAX starts, so that every thread it makes inherits the mask
        os.sched_setaffinity(0, {pin})
    os.chdir(checkout)
    sys.path.insert(0, checkout)
    from benchmarks.decode import Slots
    from engine.jax_backend.jax_model import JaxModel

    # Both checkouts load one configuration, stated here: JaxModel.load's defaults are decode-server's
    # since issue 47 (weights auto, a prefix cache, the served smallest chunk), and were float32, no
    # prefix cache and chunks from 16 before. A checkout from before int8 knows no weights=; one
    # from before paged KV (issue 41) keeps a prefix pool of its own, off here (paged KV shares
    # prompt pages in its one pool, which costs a decode step nothing).
    params = inspect.signature(JaxModel.load).parameters.values()
    knows_weights = any(p.name == "weights" or p.kind is p.VAR_KEYWORD for p in params)
    extra = {"weights": weights} if knows_weights or weights != "float32" else {}
    try:
        from engine.core.model_options import ModelOptions

        if "prefix_cache_tokens" in ModelOptions.__dataclass_fields__:
            extra["prefix_cache_tokens"] = 0
        if pin >= 0:
            extra["cpu_threads"] = 1
    except ImportError:  # before ModelOptions: a load keyword of its own
        extra["prefix_cache_tokens"] = 0
    model = JaxModel.load(model_dir, max_batch_size=max_batch, max_context_length=context, min_bucket=16, **extra)
    slots = Slots(model, max_batch, prompt_len)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, steps, mode = int(line.split()[0]), int(line.split()[1]), line.split()[2]
        if max(slots.length.values()) + steps + 2 >= min(500, context):
            slots.release()
            slots = Slots(model, max_batch, prompt_len)
        before = resource.getrusage(resource.RUSAGE_SELF)
        if mode == "lag" and hasattr(slots, "pipelined"):
            seconds = slots.pipelined(batch, steps) * steps
        else:
            start = time.perf_counter()
            for _ in range(steps):
                slots.step(batch)
            seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults, sys_s = after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime
        cpu = after.ru_utime - before.ru_utime + sys_s
        print(seconds / steps, faults / steps, sys_s / steps, cpu / steps, flush=True)


class Worker:
    def __init__(self, checkout: str, args: argparse.Namespace, model_dir: str, after: bool = False) -> None:
        self.name = checkout
        extra = dict(item.split("=", 1) for item in args.after_env) if after else {}
        if after and args.after_xla_flags is not None:
            extra["XLA_FLAGS"] = args.after_xla_flags
        env = {**os.environ, **extra} if extra else None
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", checkout, model_dir, str(max(args.batches)),
             str(args.max_context_length), str(args.prompt_len), args.weights, str(args.pin)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"{self.name}: the worker did not start (it printed {line!r}); see its stderr above")

    def run(self, batch: int, steps: int, mode: str) -> tuple[float, float, float, float]:
        self.proc.stdin.write(f"{batch} {steps} {mode}\n")
        self.proc.stdin.flush()
        seconds, faults, sys_s, cpu = map(float, self.proc.stdout.readline().split())
        return seconds, faults, sys_s, cpu

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        checkout, model_dir, max_batch, context, prompt_len, weights, pin = sys.argv[2:9]
        _worker(checkout, model_dir, int(max_batch), int(context), int(prompt_len), weights, int(pin))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the baseline checkout (e.g. a git worktree of main)")
    parser.add_argument("after", help="the checkout compared with it (e.g. .)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name (resolved by this checkout)")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 32], help="comma-separated batch sizes")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["read", "lag"], help="comma-separated: read (each step read before the next), lag (the engine's way); default both")
    parser.add_argument("--rounds", type=int, default=16, help="interleaved rounds (the order of the two alternates)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per worker, batch and round")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-context-length", type=int, default=512)
    parser.add_argument("--weights", default="float32", choices=["float32", "int8"], help="int8: weight-only int8 in both")
    parser.add_argument("--pin", type=int, default=-1, metavar="CPU",
                        help="run both workers on this CPU with one kernel thread: compare CPU ms per step (work), not speed")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="split the rounds over N fresh pairs of workers, one pair after the other (see above)")
    parser.add_argument("--after-xla-flags", metavar="FLAGS",
                        help="XLA_FLAGS for the after worker only (an XLA option tried before it ships)")
    parser.add_argument("--after-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the after worker only (repeatable; e.g. a glibc tunable)")
    args = parser.parse_args()
    if args.pin >= 0 and args.pin not in os.sched_getaffinity(0):
        parser.error(f"--pin {args.pin}: not a CPU this process may run on ({sorted(os.sched_getaffinity(0))})")
    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import describe
    from benchmarks.summary import median_range
    from engine.model_store.registry import resolve_model

    model_dir = str(resolve_model(args.model))
    print(describe())
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if any("=" not in item for item in args.after_env):
        parser.error(f"--after-env takes NAME=VALUE, got {args.after_env}")
    if not 1 <= args.processes <= args.rounds:
        parser.error(f"--processes must be 1..{args.rounds} (the rounds are split over them), got {args.processes}")
    names = (str(Path(args.before).resolve()), str(Path(args.after).resolve()))
    results: dict[tuple[int, int, str], list[tuple[float, float, float, float]]] = {}  # (0 before | 1 after, batch, mode)
    pairs: list[int] = []  # the process pair of each round
    for pair in range(args.processes):
        rounds = range(pair * args.rounds // args.processes, (pair + 1) * args.rounds // args.processes)
        _run_pair(args, model_dir, names, pair % 2 == 1, rounds, results)
        pairs += [pair] * len(rounds)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    pinned = f", pinned to CPU {args.pin} with one kernel thread" if args.pin >= 0 else ""
    flags = f" (XLA_FLAGS={args.after_xla_flags})" if args.after_xla_flags is not None else ""
    flags += "".join(f" ({item})" for item in args.after_env)
    processes = f" over {args.processes} pairs of processes" if args.processes > 1 else ""
    print(f"{args.rounds} rounds of {args.steps} steps{processes}, {args.weights} weights{pinned}; before = {args.before}, after = {args.after}{flags}")
    print("| batch | mode | before ms/step | after ms/step | after / before speed | page faults/step before, after | "
          "sys ms/step before, after | CPU ms/step before, after | before / after CPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        for mode in args.modes:
            b, a = results[(0, batch, mode)], results[(1, batch, mode)]
            speed = [x[0] / y[0] for x, y in zip(b, a)]
            work = [x[3] / y[3] for x, y in zip(b, a)]  # >1: after does less work a step
            med = lambda rows, i: statistics.median(row[i] for row in rows)  # noqa: E731
            print(
                f"| {batch} | {mode} | {med(b, 0) * 1e3:.1f} | {med(a, 0) * 1e3:.1f} | {median_range(speed, '{:.3f}')}x | "
                f"{med(b, 1):.0f}, {med(a, 1):.0f} | {med(b, 2) * 1e3:.1f}, {med(a, 2) * 1e3:.1f} | "
                f"{med(b, 3) * 1e3:.2f}, {med(a, 3) * 1e3:.2f} | {median_range(work, '{:.3f}')}x |"
            )
    if args.processes > 1:
        print("each pair of processes, median over its rounds: after / before speed; before / after CPU")
        for batch in args.batches:
            for mode in args.modes:
                b, a = results[(0, batch, mode)], results[(1, batch, mode)]
                each = [
                    [statistics.median(x[i] / y[i] for x, y, p in zip(b, a, pairs) if p == pair) for pair in range(args.processes)]
                    for i in (0, 3)
                ]
                print(f"  batch {batch} {mode}: {' '.join(f'{r:.3f}' for r in each[0])}; CPU {' '.join(f'{r:.3f}' for r in each[1])}")


def _run_pair(args: argparse.Namespace, model_dir: str, names: tuple[str, str], after_first: bool, rounds: range,
              results: dict) -> None:
    """One pair of fresh workers (the before's and the after's, started together) for `rounds`;
    `after_first`: the after's warms up first."""
    before, after = Worker(names[0], args, model_dir), Worker(names[1], args, model_dir, after=True)
    try:
        for w in (after, before) if after_first else (before, after):
            w.wait_ready()
            for batch in args.batches:  # compile every shape before timing
                w.run(batch, 2, "read")
        for r in rounds:  # keyed by side, not by path: a checkout may be compared with itself (a control)
            for batch in args.batches:
                for mode in args.modes:
                    for side, w in ((0, before), (1, after)) if r % 2 == 0 else ((1, after), (0, before)):
                        results.setdefault((side, batch, mode), []).append(w.run(batch, args.steps, mode))
    finally:
        before.close()
        after.close()


if __name__ == "__main__":
    main()
