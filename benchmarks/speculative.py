"""Speculative decoding (issue 45) on the real model: n-gram speculation on against off, through the
engine, side by side in one run; and, with `--check`, that it changes no greedy id.

    python benchmarks/speculative.py [--rounds 3] [--tokens 192] [--mixed-tokens 96] [--guesses 4] [--cpu-threads N]
    python benchmarks/speculative.py --check [--check-tokens 96]

One JaxModel (SmolLM2-135M as decode-server serves it on the CPU: int8 weights, the CPU kernels,
the served defaults) behind one Engine with `speculation="ngram"`; the "off" arm hands the
engine no policy for its bursts, so both arms share the model, its compiled shapes and its
prefix cache, and differ only in speculation. Prompts are chat messages through the model's
chat template, as the text service sends them; every request is greedy and ends on EOS or
`--tokens`. Each round runs every workload in both arms, which goes first alternating by round,
and each ratio (on / off) is taken within the round, so a shared machine's noise falls on both:

* copy, batch 1: prompts that make the answer copy its input (rewrite code with one change,
  extract fields as JSON, repeat a quoted passage), one at a time. tok/s: a request's tokens
  after its first over the time from its first token to its last (prefill excluded: it is the
  same in both arms), summed over the workload's requests;
* chat, batch 1: open questions, one at a time, measured alike;
* mixed, batch 32: 32 requests at once, copy and chat prompts alternating. tok/s: all tokens over
  the time from submitting the burst to its last finish (what a loaded server delivers).

Acceptance rate (accepted / proposed guesses) and accepted guesses per verify step come from
the engine's counters over each workload's "on" bursts; at batch 1 a verify step is one row, so
the latter is the mean accepted run.

`--check`: every prompt (copy and chat, >= 16) decoded greedily with speculation off and on, at
batch 1, in float32 and in int8; prints, per prompt, whether the ids are equal, and at the first
divergence the plain run's top-2 logprob gap there (a near-tie, < 1e-4, is numerics; a wider
gap is a bug). Exits 1 on any divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.speculative_prompts import CHAT, COPY  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.events import Finished, Token  # noqa: E402
from engine.core.request import Request, SamplingParams, StoppingCriteria  # noqa: E402
from engine.jax_backend import compilation_cache  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402
from tokenizer_svc.chat import ChatMessage  # noqa: E402
from tokenizer_svc.tokenizer import TextTokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "speculative.json"


class Stream:
    """An EventSink that keeps each token with its arrival time."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.times: list[float] = []
        self.logprobs: list[tuple[tuple[int, float], ...]] = []
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def events(self, events) -> None:
        now = time.perf_counter()
        for event in events:
            if isinstance(event, Token):
                self.ids.append(event.id)
                self.times.append(now)
                self.logprobs.append(event.top_logprobs)
        if isinstance(events[-1], Finished):
            self.finished_at = now
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()


class Bench:
    """The model, its engine, and speculation switched per burst."""

    def __init__(self, model: JaxModel, guesses: int, max_batch: int) -> None:
        self.model = model
        config = EngineConfig(max_queue_size=64, speculation="ngram", speculative_tokens=guesses,
                              speculation_max_batch=max_batch)
        self.engine = Engine(model, config)
        self._policy = self.engine._policy  # the "off" arm runs with none: plain pipelined steps only
        self.tokens = 0  # tokens received, every burst
        self.engine.start()

    def speculate(self, on: bool) -> None:
        """Between bursts only (no request live): the engine reads its policy each step."""
        self.engine._policy = self._policy if on else None

    def burst(self, prompts: list[tuple[int, ...]], tokens: int, top_logprobs: int = 0) -> list[Stream]:
        streams = [Stream() for _ in prompts]
        for i, (prompt, stream) in enumerate(zip(prompts, streams)):
            sampling = SamplingParams(temperature=0.0, seed=i, top_logprobs=top_logprobs)
            request = Request(f"r{i}", prompt, sampling, StoppingCriteria(tokens), return_logprobs=top_logprobs > 0)
            self.engine.submit(request, stream)
        for stream in streams:
            if not stream.done.wait(600):
                raise RuntimeError("a request did not finish in 600 s")
            if stream.error is not None:
                raise stream.error
        self.tokens += sum(len(stream.ids) for stream in streams)
        return streams

    def counters(self) -> tuple[int, int, int, int]:
        s = self.engine.stats().speculation
        return s.proposed, s.accepted, s.steps, self.tokens


def encode_chats(model_dir: Path, messages: list[str]) -> list[tuple[int, ...]]:
    tokenizer = TextTokenizer.from_dir(model_dir)
    return [tuple(tokenizer.encode_chat([ChatMessage("user", m)])) for m in messages]


def batch1_rate(bench: Bench, prompts, tokens: int) -> float:
    """tok/s of the decode phase, one request at a time (see the module docstring)."""
    sent = seconds = 0.0
    for prompt in prompts:
        (stream,) = bench.burst([prompt], tokens)
        if len(stream.times) > 1:
            sent += len(stream.times) - 1
            seconds += stream.times[-1] - stream.times[0]
    return sent / seconds


def burst_rate(bench: Bench, prompts, tokens: int) -> float:
    started = time.perf_counter()
    streams = bench.burst(prompts, tokens)
    return sum(len(s.ids) for s in streams) / (max(s.finished_at for s in streams) - started)


def median_range(values: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def benchmark(args, model_dir: Path) -> None:
    copy, chat = encode_chats(model_dir, COPY), encode_chats(model_dir, CHAT)
    mixed = [(copy if i % 2 == 0 else chat)[(i // 2) % len(copy if i % 2 == 0 else chat)] for i in range(args.batch)]
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    model = JaxModel.load(model_dir, max_batch_size=args.batch, max_context_length=1024, max_guesses=args.guesses,
                          max_verify_rows=args.max_batch, cpu_threads=args.cpu_threads or None)  # as decode-server
    model.warm_up()
    bench = Bench(model, args.guesses, args.max_batch)
    print(f"model {model.info.model_id}: weights {'int8' if model.int8 else 'float'}, CPU kernels "
          f"{'on' if model.kernels else 'off'} ({model.cpu_threads} threads); speculation ngram, "
          f"{args.guesses} guesses, max batch {args.max_batch}; "
          f"copy prompts {[len(p) for p in copy]} tokens, chat {[len(p) for p in chat]}")
    workloads = {
        "copy, batch 1": lambda: batch1_rate(bench, copy[: args.copy_prompts], args.tokens),
        "chat, batch 1": lambda: batch1_rate(bench, chat[: args.chat_prompts], args.tokens),
        f"mixed, batch {args.batch}": lambda: burst_rate(bench, mixed, args.mixed_tokens),
    }
    targets = {"copy, batch 1": 1.8, "chat, batch 1": 0.97, f"mixed, batch {args.batch}": 0.97}
    for on in (False, True):  # untimed: first calls pay for buffer set-up
        bench.speculate(on)
        bench.burst([copy[0], chat[0]], 16)
    rates = {(name, on): [] for name in workloads for on in (False, True)}
    counted = {name: [0, 0, 0, 0] for name in workloads}  # the "on" bursts' proposed, accepted, steps, tokens
    try:
        for r in range(args.rounds):
            for name, run in workloads.items():
                for on in (False, True) if r % 2 == 0 else (True, False):
                    bench.speculate(on)
                    before = bench.counters()
                    rates[name, on].append(run())
                    if on:
                        counted[name] = [c + a - b for c, a, b in zip(counted[name], bench.counters(), before)]
    finally:
        bench.engine.stop()
    results = []
    for name in workloads:
        off, on = rates[name, False], rates[name, True]
        ratio = [b / a for a, b in zip(off, on)]
        proposed, accepted, steps, tokens = counted[name]
        acceptance = accepted / proposed if proposed else 0.0
        per_step = accepted / steps if steps else 0.0
        # a verify row emits its accepted guesses and one sample (fewer where it finishes: an upper bound)
        verified = min(1.0, (accepted + steps) / tokens) if tokens and name.endswith("batch 1") else None
        print(f"{name}: off {median_range(off)} tok/s, on {median_range(on)} tok/s; on/off {median_range(ratio, '{:.2f}')}"
              f" (target >= {targets[name]}); acceptance {acceptance:.2f} ({accepted}/{proposed}),"
              f" {per_step:.2f} accepted a verify step ({steps} steps)"
              + (f", {verified:.0%} of {tokens} tokens from verify steps" if verified is not None else ""))
        results.append({"workload": name, "off_tok_s": off, "on_tok_s": on, "ratio": ratio,
                        "ratio_median": statistics.median(ratio), "target": targets[name], "proposed": proposed,
                        "accepted": accepted, "verify_steps": steps, "acceptance": acceptance,
                        "accepted_per_verify_step": per_step, "tokens_on": tokens, "share_from_verify_steps": verified})
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())
    if args.json:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({
            "command": "python benchmarks/speculative.py " + " ".join(sys.argv[1:]),
            "machine": describe("jax", "jaxlib", "numpy"), "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "load_average": os.getloadavg(), "model": model.info.model_id, "weights": "int8" if model.int8 else "float",
            "guesses": args.guesses, "max_batch": args.max_batch, "cpu_threads": model.cpu_threads,
            "rounds": args.rounds, "tokens": args.tokens,
            "mixed_tokens": args.mixed_tokens, "results": results,
        }, indent=2) + "\n")
        print(f"wrote {RESULTS}")


def check(args, model_dir: Path) -> int:
    """Greedy ids with speculation on against off, every prompt, float32 and int8 (see the module docstring)."""
    prompts = encode_chats(model_dir, COPY + CHAT)
    diverged = 0
    for weights in ("float32", "int8"):
        model = JaxModel.load(model_dir, max_batch_size=1, max_context_length=1024, weights=weights,
                              max_guesses=args.guesses)
        model.warm_up()
        print(f"{weights}: model weights {'int8' if model.int8 else 'float32'}, CPU kernels {'on' if model.kernels else 'off'}")
        bench = Bench(model, args.guesses, args.max_batch)
        accepted_before = bench.counters()[1]
        outputs = []
        try:
            for i, prompt in enumerate(prompts):
                bench.speculate(False)
                (plain,) = bench.burst([prompt], args.check_tokens)
                bench.speculate(True)
                (fast,) = bench.burst([prompt], args.check_tokens)
                at = next((j for j, (a, b) in enumerate(zip(plain.ids, fast.ids)) if a != b), None)
                if at is None and len(plain.ids) != len(fast.ids):
                    at = min(len(plain.ids), len(fast.ids))
                outputs.append(plain.ids)
                if at is None:
                    print(f"{weights} prompt {i}: equal, {len(plain.ids)} ids")
                    continue
                diverged += 1
                bench.speculate(False)
                (scored,) = bench.burst([prompt], at + 1, top_logprobs=2)
                top = scored.logprobs[at] if at < len(scored.logprobs) else ()
                gap = f"{top[0][1] - top[1][1]:.2e}" if len(top) == 2 else "n/a (a finish)"
                print(f"{weights} prompt {i}: DIVERGED at id {at}: plain {plain.ids[at:at + 1]}, speculative "
                      f"{fast.ids[at:at + 1]}; plain top-2 logprob gap there {gap}")
        finally:
            bench.engine.stop()
        print(f"{weights}: {bench.counters()[1] - accepted_before} guesses accepted over {len(prompts)} prompts; "
              f"plain outputs' digest {hash(tuple(map(tuple, outputs))) & 0xFFFFFFFF:08x}")
    print(f"{diverged} of {2 * len(prompts)} runs diverged")
    return 1 if diverged else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--tokens", type=int, default=192, help="max output tokens a batch-1 request")
    parser.add_argument("--mixed-tokens", type=int, default=96, help="max output tokens a request of the mixed burst")
    parser.add_argument("--batch", type=int, default=32, help="the mixed burst's size")
    parser.add_argument("--copy-prompts", type=int, default=len(COPY), help="copy prompts a round (the first N)")
    parser.add_argument("--chat-prompts", type=int, default=3, help="chat prompts a round (the first N)")
    parser.add_argument("--guesses", type=int, default=EngineConfig.speculative_tokens, help="--speculative-tokens")
    parser.add_argument("--max-batch", type=int, default=EngineConfig.speculation_max_batch,
                        help="--speculation-max-batch")
    parser.add_argument("--cpu-threads", type=int, default=0,
                        help="decode-server's --cpu-threads: threads per CPU kernel call (0: the CPUs it may use)")
    parser.add_argument("--json", action="store_true", help="write the figures to benchmarks/results/speculative.json")
    parser.add_argument("--check", action="store_true", help="exactness: greedy ids on against off, float32 and int8")
    parser.add_argument("--check-tokens", type=int, default=96, help="max output tokens a --check request")
    args = parser.parse_args()
    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    compilation_cache.enable(model_dir.parent.parent / "xla")  # as decode-server does: a rerun skips compiling
    if args.check:
        sys.exit(check(args, model_dir))
    benchmark(args, model_dir)


if __name__ == "__main__":
    main()
