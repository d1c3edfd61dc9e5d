"""The real default model, SmolLM2-135M-Instruct, prepared by the same `tokenwire pull` a user
runs (the session's `real_model` fixture, conftest), with its served weights (int8 from the
model's GGUF) and CPU kernels, loaded once for the file:

- served by both services: a chat answer ends on the model's EOS (<|im_end|>), which is never
  sent as a token, never counted and never shown. Expected answer (greedy, default system prompt)
  from shared/NOTES.md, measured with transformers f32: "The capital of France is Paris." then id 2.
- int8 from the model's GGUF follows float32: the agreement gate (issue 15's figure, the set
  benchmarks/vs_llamacpp.py measures llama.cpp on).
- speculative decoding (issue 45): n-gram guesses, checked by `JaxModel.verify`, change no greedy
  id, and on a prompt whose answer copies its input the model accepts some of them. Two engines
  over the model one after the other (plain, then speculative: the second starts with an empty
  page table, so nothing of the first's prefix cache is read). The wider check, 18 prompts in
  float32 and int8, is `python benchmarks/speculative.py --check`.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine.core.engine import Engine, EngineConfig
from engine.core.request import Request, SamplingParams, StoppingCriteria
from engine.jax_backend.jax_model import JaxModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from engine.model_store import gguf_convert
from support import real_served
from support.greedy import greedy_ids
from support.recording_sink import Recorder
from support.unwarmed import Unwarmed
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer

pytestmark = pytest.mark.real_model

# the int8 model's shapes (its fixture says why), and its float32 reference's
ONE_CHUNK = {"min_bucket": 64, "max_chunk": 64, "fused_chunk_tokens": 0}
GUESSES = 1  # the speculative test's tokens a step, and the model's max_guesses (its fixture says why)


@pytest.fixture(scope="module")
def model_dir(real_model) -> Path:
    return real_model  # pulled once per run (conftest), as `tokenwire pull` does


@pytest.fixture(scope="module")
def model(model_dir) -> JaxModel:
    """The file's one load of the 30-layer model in its served weights, in support.real_served's
    configuration, with verify steps of one guess (the speculative test's; a model's other
    programs do not depend on them): one guess bucket, a verify step of all 30 layers (about 3 s
    of CPU to compile; runs of up to 4 guesses, across every guess and row bucket, are
    tests/test_verify.py's, on the tiny checkpoints). Not warmed up (support.unwarmed: the greedy
    requests here never run the full sampler or the decode layers apart from sampling). Off the served
    configuration only where it costs compiles: one prompt chunk size, 64 (every prompt here is
    read in one or two calls of it; test_prefill_chunked reads prompts in every size to 256 on
    this model), and no chunk along with a decode step (each size of one is a decode step of every
    layer to compile, and no prompt here arrives while another decodes: the requests run one at a
    time; test_prefill_chunked runs chunks along on this model)."""
    loaded = real_served.load(model_dir, **ONE_CHUNK, max_guesses=GUESSES, cls=Unwarmed)
    assert loaded.int8 and loaded.kernels and loaded.buckets == loaded.packed_prefill_sizes == (64,)
    return loaded


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(model_dir)


async def test_chat_answer_ends_on_eos_with_no_control_token_in_text(model, tokenizer):
    decode = await start_decode_server(model)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
            for keep in (False, True):
                request = pb.GenerateRequest(chat=chat, keep_special_tokens=keep)
                request.stopping.max_output_tokens = 40
                responses = [r async for r in stub.Generate(request)]
                finished = responses[-1].finished
                ids = [i for r in responses[:-1] for i in r.delta.token_ids]
                answer = "".join(r.delta.text for r in responses[:-1])
                assert answer == "The capital of France is Paris."
                assert (finished.reason, finished.stop_token_id) == (dpb.FINISH_REASON_STOP, 2)
                assert finished.usage.completion_tokens == len(ids) == 7
                assert 2 not in ids and "<|im_end|>" not in answer
                completion = await stub.Complete(request)
                assert completion.text == answer and list(completion.token_ids) == ids
    finally:
        await text.stop(None)
        await decode.stop(None)  # (its engine reads its last step in flight: the next one starts on an idle model)


SPECULATED = [
    'Repeat the following passage exactly, word for word:\n\n"It was the best of times, it was the worst of times, '
    'it was the age of wisdom, it was the age of foolishness, it was the epoch of belief."',
    "Rewrite this Python code with one change: rename `total` to `result`. Output only the code.\n\n```python\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n```",
    "Why is the sky blue?",
]
SPECULATED_TOKENS = 40


def _engine_greedy_ids(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    engine.start()
    try:
        for i, prompt in enumerate(prompts):  # one at a time: one row, which guesses all it may
            sink = Recorder()
            request = Request(f"r{i}", tuple(prompt), SamplingParams(temperature=0.0), StoppingCriteria(SPECULATED_TOKENS))
            engine.submit(request, sink)
            assert sink.done.wait(120), f"prompt {i} did not finish"
            assert sink.error is None, sink.error
            outputs.append(sink.tokens)
    finally:
        engine.stop()
    return outputs


def test_ngram_speculation_keeps_greedy_ids_and_accepts_guesses(model, tokenizer):
    prompts = [tokenizer.encode_chat([ChatMessage("user", m)]) for m in SPECULATED]
    plain = _engine_greedy_ids(Engine(model, EngineConfig()), prompts)
    speculative_engine = Engine(model, EngineConfig(speculation="ngram", speculative_tokens=GUESSES))
    speculative = _engine_greedy_ids(speculative_engine, prompts)
    for i, (a, b) in enumerate(zip(plain, speculative)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert a == b, (
            f"prompt {i}: first difference at output id {first}: plain {a[first:first + 3]}, speculative {b[first:first + 3]}"
        )
    stats = speculative_engine.stats().speculation
    assert stats.steps > 0 and stats.accepted > 0, stats


def test_the_default_model_served_int8_from_its_gguf_follows_float32(model_dir, model):
    """The pulled default model (a Q4_1 GGUF kept as model.gguf: its Q4_1 blocks served with their
    offsets, the Q8_0 embedding and tied head as they are, so int8 holds the values float32 does),
    8 chat prompts x 64 greedy tokens, the 8 decoded together (the set benchmarks/vs_llamacpp.py
    measures llama.cpp on): int8's free-running greedy ids equal float32's at >= 95% of the
    positions (measured 100%; requantized to symmetric blocks it was 64.5%). ("The capital of
    France is Paris." from int8: the chat test above.)"""
    from benchmarks.vs_llamacpp import AGREEMENT_TOKENS, agreement, agreement_prompts

    assert (model_dir / gguf_convert.GGUF_NAME).is_file()
    prompts = [tuple(p) for p in agreement_prompts(model_dir)]
    # float32 in the int8 model's configuration: the same shapes (test_prefill_chunked compiles
    # float32's 8-row decode step too)
    float32 = real_served.load(model_dir, weights="float32", **ONE_CHUNK)
    want = greedy_ids(float32, prompts, AGREEMENT_TOKENS)
    assert agreement(want, greedy_ids(model, prompts, AGREEMENT_TOKENS)) >= 0.95
