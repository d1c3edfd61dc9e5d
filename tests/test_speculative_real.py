"""Speculative decoding on the real default model (issue 45): n-gram guesses, checked by
`JaxModel.verify` with the served int8 weights and CPU kernels, change no greedy id, and on a
prompt whose answer copies its input the model accepts some of them.

One model load, two engines over it one after the other (plain, then speculative: the second
starts with an empty page table, so nothing of the first's prefix cache is read). The wider
check, 18 prompts in float32 and int8, is `python benchmarks/speculative.py --check`.
"""

from __future__ import annotations

import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.jax_backend.jax_model import JaxModel
from support.recording_sink import Recorder
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.real_model

MESSAGES = [
    'Repeat the following passage exactly, word for word:\n\n"It was the best of times, it was the worst of times, '
    'it was the age of wisdom, it was the age of foolishness, it was the epoch of belief."',
    "Rewrite this Python code with one change: rename `total` to `result`. Output only the code.\n\n```python\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n```",
    "Why is the sky blue?",
]
TOKENS = 40


def greedy_ids(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    engine.start()
    try:
        for i, prompt in enumerate(prompts):  # one at a time: batch 1, where a row guesses all it may
            sink = Recorder()
            request = Request(f"r{i}", tuple(prompt), SamplingParams(temperature=0.0), StoppingCriteria(TOKENS))
            engine.submit(request, sink)
            assert sink.done.wait(120), f"prompt {i} did not finish"
            assert sink.error is None, sink.error
            outputs.append(sink.tokens)
    finally:
        engine.stop()
    return outputs


def test_ngram_speculation_keeps_greedy_ids_and_accepts_guesses(real_model):
    tokenizer = TextTokenizer.from_dir(real_model)
    prompts = [tokenizer.encode_chat([ChatMessage("user", m)]) for m in MESSAGES]
    # served weights (int8 from the GGUF) and kernels; a small context and prompt ladder for a short compile
    model = JaxModel.load(real_model, max_batch_size=1, max_context_length=256, min_bucket=64, max_guesses=4)
    assert model.int8 and model.kernels
    plain = greedy_ids(Engine(model, EngineConfig()), prompts)
    speculative_engine = Engine(model, EngineConfig(speculation="ngram", speculative_tokens=4))
    speculative = greedy_ids(speculative_engine, prompts)
    for i, (a, b) in enumerate(zip(plain, speculative)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (
            f"prompt {i}: first difference at output id {first}: plain {a[first:first + 3]}, speculative {b[first:first + 3]}"
        )
    stats = speculative_engine.stats().speculation
    assert stats.steps > 0 and stats.accepted > 0, stats
