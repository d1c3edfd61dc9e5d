"""Speculative decoding with a draft model (issue 45, `--draft-model`) against plain decoding, at
batch 1: acceptance, tok/s of each arm and their ratio, and whether the greedy ids are equal.

    python benchmarks/speculative_draft.py [--model DIR] [--draft DIR] [--tokens 48] [--rounds 2]

The target is `--model` as decode-server serves it on this backend (int8 from its GGUF with the
CPU kernels, on the CPU) with a verify step of K = 4 guesses; the draft is `--draft` (default: the
model itself, the only draft at hand for the default model) loaded alike without one. Both arms
run on one Engine each over the same loaded models, one prompt at a time (batch 1), greedy, each
answer `--tokens` long (EOS ignored); a round runs plain then draft, and each ratio is taken
within its round (the host is shared and noisy). tok/s counts each request from submit to its
last token, prefill included (the draft's own prefill is part of its cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.core.engine import Engine, EngineConfig  # noqa: E402
from engine.core.events import Finished, Token  # noqa: E402
from engine.core.request import Request, SamplingParams, StoppingCriteria  # noqa: E402
from engine.core.speculation.draft import DraftProposer  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from tokenizer_svc.chat import ChatMessage  # noqa: E402
from tokenizer_svc.tokenizer import TextTokenizer  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "tokenwire" / "models" / "smollm2-135m-instruct"
MESSAGES = [
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "Rewrite this Python code with one change: rename `total` to `result`. Output only the code.\n\n```python\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n```",
]


class Collect:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def events(self, events) -> None:
        self.ids += [e.id for e in events if isinstance(e, Token)]
        if isinstance(events[-1], Finished):
            self.done.set()

    def fail(self, error) -> None:
        self.error = error
        self.done.set()


def run(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Each prompt alone to `tokens` ids. -> (the ids, tok/s over the requests' time)."""
    outputs, seconds = [], 0.0
    engine.start()
    try:
        for i, prompt in enumerate(prompts):
            sink = Collect()
            started = time.perf_counter()
            engine.submit(Request(f"r{i}", tuple(prompt), SamplingParams(temperature=0.0), StoppingCriteria(tokens, ignore_eos=True)), sink)
            if not sink.done.wait(300) or sink.error is not None:
                raise RuntimeError(f"prompt {i}: {sink.error or 'no answer in 300 s'}")
            seconds += time.perf_counter() - started
            outputs.append(sink.ids)
    finally:
        engine.stop()
    return outputs, sum(map(len, outputs)) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--draft", type=Path, default=None, help="the draft model (default: --model itself)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    a = parser.parse_args()
    tokenizer = TextTokenizer.from_dir(a.model)
    prompts = [tokenizer.encode_chat([ChatMessage("user", m)]) for m in MESSAGES]
    options = dict(max_batch_size=1, max_context_length=256, min_bucket=64)  # a short warm-up
    target = JaxModel.load(a.model, max_guesses=4, **options)
    draft = JaxModel.load(a.draft or a.model, **options)
    target.warm_up()
    draft.warm_up()
    print(f"target {a.model.name} ({'int8' if target.int8 else 'float'}), draft {(a.draft or a.model).name}", flush=True)
    ratios = []
    for round_ in range(a.rounds):
        plain, plain_rate = run(Engine(target, EngineConfig()), prompts, a.tokens)
        engine = Engine(target, EngineConfig(speculation="draft", speculative_tokens=4), proposer=DraftProposer(draft))
        guessed, draft_rate = run(engine, prompts, a.tokens)
        s = engine.stats().speculation
        ratios.append(draft_rate / plain_rate)
        print(f"round {round_}: plain {plain_rate:.1f} tok/s, draft {draft_rate:.1f} tok/s ({ratios[-1]:.2f}x); acceptance "
              f"{s.accepted}/{s.proposed} = {s.accepted / max(1, s.proposed):.3f} over {s.steps} verify steps; "
              f"greedy ids equal: {plain == guessed}", flush=True)
    print(f"draft / plain: median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
