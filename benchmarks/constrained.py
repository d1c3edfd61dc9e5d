"""Constrained (JSON schema) against unconstrained decoding through the engine, on the real model.

    python benchmarks/constrained.py [--rounds 3] [--tokens 48] [--batches 32,1] [--split-sampler on]

One JaxModel (SmolLM2-135M as served on the CPU: int8 weights, the CPU kernels) behind one
Engine. Each round runs, per batch size, a constrained burst and an unconstrained one, which goes
first alternating by round, so a shared machine's noise falls on both alike. A burst is `batch`
greedy requests with the same prompt; a constrained one holds every request to SCHEMA (a JSON
object of a few fields, with long strings so that no output completes early).

* batch > 1: tok/s while every request of the burst decodes: tokens sent between the moment the
  last request got its first token and the moment the first one finished, over that time.
* batch 1: per-token latency: the median gap between consecutive tokens of the one stream.

The ratio "constrained / unconstrained" is per round (>= 0.9 in tok/s and <= 1.05 in latency are
the issue's targets). The mask's host time per step is what the engine thread spends in the
grammar (Matcher.banned and advance, or their batched forms) and in handing the rows to the model
(`Model.ban`), summed over a step's rows, p50 and p99 over the constrained steps. Where the model
samples the step apart from its layers (`Model.samples_apart`: every step with `--split-sampler
on`; by default on the CPU, a stream alone, so batch 1), that work runs while the step's layers
run on the device; otherwise between steps (docs/constraints.md, "Speed").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe  # noqa: E402
from engine.constraints.spec import Constraint  # noqa: E402
from engine.core.constrained import ConstraintCompiler  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.events import Finished, Token  # noqa: E402
from engine.core.request import Request, SamplingParams, StoppingCriteria  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 40, "maxLength": 80},
        "city": {"type": "string", "minLength": 40, "maxLength": 80},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
    },
    "required": ["name", "city", "age", "member"],
}
PROMPT = "Describe a person as JSON with their name, city, age and whether they are a member."


class Stream:
    """An EventSink that stamps each token's arrival."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def events(self, events) -> None:
        now = time.perf_counter()
        self.times += [now for e in events if isinstance(e, Token)]
        if isinstance(events[-1], Finished):
            self.finished_at = now
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()


class MaskClock:
    """Sums the engine thread's grammar and ban time per decode step (wrapping the calls that do
    that work), closed at each step's delivery."""

    def __init__(self) -> None:
        self.current = 0.0
        self.steps: dict[int, list[float]] = {}  # batch size -> seconds per constrained step
        self.recording: int | None = None  # the batch size of the constrained burst running

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current += time.perf_counter() - start

        setattr(owner, name, timed)

    def close_step(self) -> None:
        if self.recording and self.current > 0:
            self.steps.setdefault(self.recording, []).append(self.current)
        self.current = 0.0


def burst(engine: Engine, prompt: tuple[int, ...], batch: int, tokens: int, grammar) -> list[Stream]:
    streams = [Stream() for _ in range(batch)]
    for i, stream in enumerate(streams):
        stopping = StoppingCriteria(tokens, ignore_eos=grammar is None)
        engine.submit(Request(f"r{i}", prompt, SamplingParams(seed=i), stopping, constraint=grammar), stream)
    for stream in streams:
        if not stream.done.wait(300):
            raise RuntimeError("a request did not finish in 300 s")
        if stream.error is not None:
            raise stream.error
    return streams


def measure(streams: list[Stream]) -> float:
    """batch 1: seconds per token (median gap); more: tok/s while all decode."""
    if len(streams) == 1:
        times = streams[0].times
        return statistics.median(b - a for a, b in zip(times, times[1:]))
    start = max(s.times[0] for s in streams)
    end = min(s.finished_at for s in streams)
    sent = sum(sum(1 for t in s.times if start < t <= end) for s in streams)
    return sent / (end - start)


def median_range(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--batches", default="32,1", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--tokens", type=int, default=48, help="max output tokens a request")
    parser.add_argument("--split-sampler", choices=["on", "off"], default=None,
                        help="the step's sampler apart from its layers (both kinds of burst; default: the backend's, "
                        "off on the CPU); on, a constrained step's rows are computed while its layers run")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy', 'llguidance')}")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    split = None if args.split_sampler is None else args.split_sampler == "on"
    model = JaxModel.load(model_dir, max_batch_size=max(batches), max_context_length=512, split_sampler=split)
    model.warm_up()
    compiler = ConstraintCompiler(model_dir / "tokenizer.json", model.info.vocab_size, model.info.eos_token_ids)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    from tokenizers import Tokenizer

    prompt = tuple(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT).ids)
    clock = MaskClock()
    from engine.constraints import matcher

    for owner, names in ((matcher.Matcher, ("banned", "advance")), (matcher, ("banned_rows",)), (model, ("ban",))):
        for name in names:
            if hasattr(owner, name):
                clock.wrap(owner, name)
    engine = Engine(model, EngineConfig(max_queue_size=max(batches)))
    engine.after_delivery(clock.close_step)
    engine.start()
    print(
        f"model {model.info.model_id}: weights {'int8' if model.int8 else 'float'}, CPU kernels "
        f"{'on' if model.kernels else 'off'} ({model.cpu_threads} threads), split sampler {model.split_sampler} "
        f"(a constrained step of slots below {model.samples_apart}: layers, then rows, then sampling; "
        f"above: the step in flight read first); "
        f"prompt {len(prompt)} tokens, {args.tokens} output tokens a request, schema {json.dumps(SCHEMA)}"
    )
    try:
        for batch in batches:  # untimed: first calls pay for buffer set-up
            burst(engine, prompt, batch, 8, grammar)
            burst(engine, prompt, batch, 8, None)
        results = {(b, c): [] for b in batches for c in (True, False)}
        for r in range(args.rounds):
            for batch in batches:
                for constrained in (True, False) if r % 2 == 0 else (False, True):
                    clock.recording = batch if constrained else None
                    streams = burst(engine, prompt, batch, args.tokens, grammar if constrained else None)
                    clock.recording = None
                    results[batch, constrained].append(measure(streams))
    finally:
        engine.stop()
    for batch in batches:
        held, free = results[batch, True], results[batch, False]
        if batch == 1:
            ratio = [h / f for h, f in zip(held, free)]
            print(
                f"batch 1: per-token latency constrained {median_range([h * 1e3 for h in held], '{:.2f}')} ms, "
                f"unconstrained {median_range([f * 1e3 for f in free], '{:.2f}')} ms; "
                f"ratio {median_range(ratio, '{:.3f}')} (target <= 1.05)"
            )
        else:
            ratio = [h / f for h, f in zip(held, free)]
            print(
                f"batch {batch}: constrained {median_range(held, '{:.1f}')} tok/s, "
                f"unconstrained {median_range(free, '{:.1f}')} tok/s; ratio {median_range(ratio, '{:.3f}')} (target >= 0.9)"
            )
    for batch, steps in sorted(clock.steps.items(), reverse=True):
        steps = sorted(steps)
        p50, p99 = steps[len(steps) // 2], steps[min(len(steps) - 1, int(len(steps) * 0.99))]
        print(f"batch {batch}: mask host time per step ({len(steps)} steps): p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
