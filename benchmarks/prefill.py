"""Long prompts on this machine, in one process, interleaved over rounds: how fast a prompt is read,
whether running streams keep their pace while it is, and what a cached prefix saves.

    python benchmarks/prefill.py [--model smollm2-135m-instruct] [--lengths 128,512,2047] [--rounds 3]
        [--streams 1] [--long 1800] [--shared-prefix 1000] [--max-step-tokens N[,N...]]

Each round measures, in this order, with fresh random token ids (prefill cost does not depend on
which ids, and fresh ids keep the prefix cache from serving one round's prompt to the next):
1. **prefill**: one prompt of every length in `--lengths` into a free slot, straight on the model
   (best of `--repeats`), as JaxModel runs it when serving: pieces of the compiled chunk shapes
   (`--max-prefill-chunk`), each attending to the cache written so far.
2. **under load**: through the scheduler (engine.core.engine.Engine on a thread, no gRPC), `--streams`
   greedy streams decode; once each has 8 tokens and then STEADY_S more seconds, a `--long`-token
   prompt arrives. Its time to first token, and the streams' gaps between tokens: the median of
   the gaps before it arrived, past each stream's first SETTLING (steady decode), and the median,
   p99 and worst of the gaps while it was read (from its arrival to its first token). The stall target is worst <= 5x the steady median. Several
   `--max-step-tokens` budgets are measured in turn within each round (one engine each, over the
   same model), so their rows compare within the run.
3. **shared prefix**: a prompt of `--shared-prefix` tokens plus 24 of its own, then a second prompt
   with the same prefix and 24 other tokens, on an idle engine with the prefix cache on: the
   second's time to first token over the first's.
The tables give the median over rounds with the range. Warm-up (every compiled shape) is timed
once; compilations after it are counted and must be 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402
from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.events import Finished, Token  # noqa: E402
from engine.core.model import SlotSetup  # noqa: E402
from engine.core.request import Request, SamplingParams, StoppingCriteria  # noqa: E402
from engine.jax_backend.jax_model import JaxModel, smallest_chunk  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, seed=0)
OWN_TOKENS = 24  # each shared-prefix prompt's own tokens after the prefix


class Timeline:
    """An EventSink that notes when each token arrived (engine thread)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def events(self, events) -> None:
        now = time.perf_counter()
        self.times.extend(now for e in events if isinstance(e, Token))
        if isinstance(events[-1], Finished):
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()

    def wait(self, what: str, limit_s: float = 600.0) -> None:
        if not self.done.wait(limit_s) or self.error is not None:
            raise SystemExit(f"{what} did not finish: {self.error}")


def _prompt(rng: np.random.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(3, vocab, n))


def _submit(engine: Engine, prompt: tuple[int, ...], n: int, sink: Timeline) -> tuple[float, int]:
    """-> when it was sent, and its ticket."""
    request = Request("bench", prompt, GREEDY, StoppingCriteria(max_output_tokens=n, ignore_eos=True))
    sent = time.perf_counter()
    return sent, engine.submit(request, sink)


# The steady gap: a stream's gaps over STEADY_S seconds before the long prompt arrives, past its
# first SETTLING gaps (with the host one step behind, a new stream's first tokens can arrive in a
# pair, a few milliseconds apart; a median over the ~10 gaps around the prompt, as measured
# before, fell to 1-8 ms in some rounds because of such pairs).
STEADY_S = 1.5
SETTLING = 8


def under_load(engine: Engine, rng: np.random.Generator, vocab: int, streams: int, long: int) -> dict[str, float]:
    """`streams` decode; a `long` prompt arrives; -> its TTFT and the streams' gaps (seconds)."""
    running = [Timeline() for _ in range(streams)]
    tickets = [_submit(engine, _prompt(rng, vocab, 16), 100_000, sink)[1] for sink in running]  # until aborted
    while any(len(sink.times) < 8 for sink in running):
        time.sleep(0.005)
    time.sleep(STEADY_S)  # the streams' steady pace, measured before the long prompt arrives
    reader = Timeline()
    arrived, _ = _submit(engine, _prompt(rng, vocab, long), 1, reader)
    reader.wait("the long prompt")
    first = reader.times[0]
    for ticket in tickets:
        engine.abort(ticket)
    steady, during = [], []
    for sink in running:
        gaps = list(zip(sink.times[:-1], sink.times[1:]))
        steady += [b - a for a, b in gaps[SETTLING:] if b <= arrived]
        during += [b - a for a, b in gaps if b > arrived and a < first]
    during.sort()
    return dict(
        ttft=first - arrived, steady=statistics.median(steady), median=statistics.median(during),
        p99=during[min(len(during) - 1, int(0.99 * len(during)))], worst=during[-1],
    )


def shared_prefix(engine: Engine, rng: np.random.Generator, vocab: int, prefix_len: int) -> tuple[float, float]:
    """-> TTFT of a prompt with a new prefix, then of one sharing it (seconds)."""
    prefix = _prompt(rng, vocab, prefix_len)
    ttfts = []
    for _ in range(2):
        sink = Timeline()
        sent, _ = _submit(engine, prefix + _prompt(rng, vocab, OWN_TOKENS), 1, sink)
        sink.wait("a shared-prefix prompt")
        ttfts.append(sink.times[0] - sent)
    return ttfts[0], ttfts[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--lengths", default="128,512,2047", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every measurement once each)")
    parser.add_argument("--repeats", type=int, default=2, help="prefills per length and round; the best counts")
    parser.add_argument("--streams", type=int, default=1, help="streams decoding while the long prompt is read (0: skip)")
    parser.add_argument("--long", type=int, default=1800, help="tokens of the prompt read under load")
    parser.add_argument("--shared-prefix", type=int, default=1000, help="tokens of the shared prefix (0: skip)")
    parser.add_argument("--max-step-tokens", default="", help="the scheduler's budgets to compare, comma-separated "
                        "(default: the decode service's, which is the model's)")
    parser.add_argument("--kv-cache-tokens", type=int, default=0, help="the KV page pool (0: every stream a whole context)")
    parser.add_argument("--max-context-length", type=int, default=2048)
    parser.add_argument("--max-prefill-chunk", type=int, default=512, help="largest prompt piece one prefill call runs")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--weights", default="float32", choices=["float32", "int8", "auto"],
                        help="the weights measured (float32: what the figures in docs/benchmarks.md used; auto: as served)")
    parser.add_argument("--min-bucket", type=int, default=None, help="smallest chunk shape (JaxModel.load's min_bucket; "
                        "default: as decode-server sets it for the smallest --max-step-tokens)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else []
    if max([*lengths, args.long, args.shared_prefix + OWN_TOKENS]) >= args.max_context_length:
        parser.error(f"every prompt must be below --max-context-length ({args.max_context_length}): room for one token")

    budgets = [int(b) for b in args.max_step_tokens.split(",")] if args.max_step_tokens else []
    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}; backend {jax.default_backend()}")
    started = time.perf_counter()
    model = JaxModel.load(
        model_dir, max_batch_size=args.streams + 1, max_context_length=args.max_context_length, dtype=args.dtype,
        max_chunk=args.max_prefill_chunk, kv_cache_tokens=args.kv_cache_tokens, weights=args.weights,
        min_bucket=args.min_bucket or smallest_chunk(min(budgets, default=None)),
        fused_chunk_tokens=max(budgets, default=None),  # chunks along with decode steps, each budget its own size
    )
    model.warm_up()
    warm_compilations = model.compilations()
    budgets = budgets or [model.default_step_tokens]
    print(f"model {model_dir.name}: context {args.max_context_length}, chunk shapes {model.buckets}, "
          f"max_step_tokens {budgets} (the model's default {model.default_step_tokens}), KV pool "
          f"{model.kv.num_pages - 1} pages of {model.kv.page_size}; load and warm-up {time.perf_counter() - started:.1f} s; kernels {model.kernel_state}")
    engine = Engine(model, EngineConfig(max_step_tokens=budgets[0]))
    engine.start()
    setup = SlotSetup(GREEDY, frozenset())
    rng = np.random.default_rng(0)
    vocab = model.info.vocab_size
    seconds: dict[int, list[float]] = {n: [] for n in lengths}
    loads: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    shared: list[tuple[float, float]] = []
    try:
        for round_ in range(1, args.rounds + 1):
            for n in lengths:  # straight on the model: the engine is idle
                prompt = _prompt(rng, vocab, n)
                best = float("inf")
                for _ in range(args.repeats):
                    # the pool's first pages, in order, as the engine's allocator gives a prompt in
                    # an empty pool; pages the idle engine cached may be overwritten, but every
                    # round's prompts are fresh ids, so none of its cached prefixes is hit again
                    model.set_pages(0, range(1, 1 + -(-n // model.kv.page_size)))
                    start = time.perf_counter()
                    model.prefill(0, prompt, setup, False)
                    best = min(best, time.perf_counter() - start)
                    model.release(0)
                seconds[n].append(best)
                print(f"round {round_}: prefill {n} tokens in {best:.2f} s ({n / best:.0f} tok/s)", flush=True)
            for budget in budgets if args.streams else []:
                engine.stop()
                engine = Engine(model, EngineConfig(max_step_tokens=budget))
                engine.start()
                m = under_load(engine, rng, vocab, args.streams, args.long)
                loads[budget].append(m)
                print(f"round {round_}: {args.long} tokens under {args.streams} streams, budget {budget}: TTFT "
                      f"{m['ttft']:.2f} s; gaps steady {m['steady'] * 1e3:.0f} ms, while read median "
                      f"{m['median'] * 1e3:.0f} / p99 {m['p99'] * 1e3:.0f} / worst {m['worst'] * 1e3:.0f} ms", flush=True)
            if args.shared_prefix:
                first, second = shared_prefix(engine, rng, vocab, args.shared_prefix)
                shared.append((first, second))
                print(f"round {round_}: shared {args.shared_prefix}-token prefix: TTFT {first:.2f} s, then "
                      f"{second:.3f} s ({second / first:.3f}x)", flush=True)
    finally:
        engine.stop()
    print()
    if lengths:
        print("| prompt tokens | seconds | tok/s |")
        print("|---|---|---|")
        for n in lengths:
            s = seconds[n]
            print(f"| {n} | {median_range(s)} | {median_range([n / x for x in s], '{:.0f}')} |")
    if args.streams:
        print(f"\n{args.long}-token prompt while {args.streams} stream(s) decode:")
        print("| max_step_tokens | its TTFT s | steady gap ms | gaps while read: median | p99 | worst | worst / steady |")
        print("|---|---|---|---|---|---|---|")
        for budget, runs in loads.items():
            ms = lambda key: median_range([m[key] * 1e3 for m in runs], "{:.0f}")  # noqa: E731
            print(f"| {budget} | {median_range([m['ttft'] for m in runs])} | {ms('steady')} | {ms('median')} | {ms('p99')} | "
                  f"{ms('worst')} | {median_range([m['worst'] / m['steady'] for m in runs], '{:.1f}')} |")
    if shared:
        print(f"\nshared {args.shared_prefix}-token prefix (+{OWN_TOKENS} own tokens each):")
        print("| first TTFT s | second TTFT s | second / first |")
        print("|---|---|---|")
        print(f"| {median_range([a for a, _ in shared])} | {median_range([b for _, b in shared], '{:.3f}')} | "
              f"{median_range([b / a for a, b in shared], '{:.3f}')} |")
    print(f"\ncompilations after warm-up: {model.compilations() - warm_compilations}")


if __name__ == "__main__":
    main()
