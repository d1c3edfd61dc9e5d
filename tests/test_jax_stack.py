"""The stream invariants again, now with the real JAX engine (tiny-llama checkpoint) behind both
services, with float32 weights and with int8, and streaming == unary == `tokenwire generate --local`
(with the same weights).

Greedy decoding is deterministic, so a first greedy run (with ignore_eos) gives the reference
sequence g0, g1, g2, ...; each case then picks its stop ids or cap from it and works out the
expected stream by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from engine.core.engine import EngineConfig
from protos.decode.v1 import decode_pb2 as dpb
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2_grpc
from services.client import decode_request, generate_request
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support import tiny_served
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
PROMPT = "def main():\n    print("
STOP, LENGTH = dpb.FINISH_REASON_STOP, dpb.FINISH_REASON_LENGTH
# Greedy runs must agree across batch shapes (the concurrent test): a CPU float32 claim (tests/support/backend.py).
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_backend")]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["float32", "int8"])
async def stack(request):
    """Both services over tiny-llama, served with float32 weights and with int8 (issue 15: every
    invariant holds with int8 too)."""
    # The shared configuration (support.tiny_served), whose executables other files compile too;
    # weights: both, said above (test_int8 warms up the int8 one).
    model = tiny_served.load(weights=request.param)
    assert model.int8 == (request.param == "int8")
    decode = await start_decode_server(model, EngineConfig(max_queue_size=16))
    tokenizer = TextTokenizer.from_dir(TINY)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    decode_channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
    text_channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    yield (
        model,
        decode_pb2_grpc.DecoderStub(decode_channel),
        text_pb2_grpc.TextGenerationStub(text_channel),
        tokenizer,
        text.port,
    )
    await decode_channel.close()
    await text_channel.close()
    await text.stop(None)
    await decode.stop(None)


async def run(decoder, prompt_ids, **params):
    events = [e async for r in decoder.Decode(decode_request(prompt_ids, **params)) for e in r.events]
    assert [e.WhichOneof("event") for e in events].count("finished") == 1 and events[-1].HasField("finished")
    tokens = [e.token.id for e in events[:-1]]
    finished = events[-1].finished
    assert finished.usage.completion_tokens == len(tokens)
    assert finished.usage.prompt_tokens == len(prompt_ids)
    return tokens, finished


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(stack):
    model, decoder, _, tokenizer, _ = stack
    prompt_ids = tokenizer.encode(PROMPT)
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=40, ignore_eos=True)
    assert finished.reason == LENGTH and len(tokens) == 40
    return prompt_ids, tokens


def upto(ref: list[int], stop: int) -> list[int]:
    return ref[: ref.index(stop)]


@pytest.mark.parametrize("n", [1, 2, 3])
async def test_exactly_n_tokens(stack, reference, n):
    _, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=n, ignore_eos=True)
    assert tokens == ref[:n] and finished.reason == LENGTH


async def test_large_n_with_ignore_eos(stack, reference):
    model, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    room = model.info.max_context_length - len(prompt_ids)  # the whole context
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=room, ignore_eos=True)
    assert len(tokens) == room and tokens[:40] == ref and finished.reason == LENGTH


async def test_control_token_at_prefill(stack, reference):
    _, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=5, ignore_eos=True, stop_token_ids=[ref[0]])
    assert tokens == [] and (finished.reason, finished.stop_token_id) == (STOP, ref[0])


async def test_control_token_exactly_at_the_cap(stack, reference):
    _, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    k = next(i for i in range(1, 40) if ref[i] not in ref[:i])  # the first new id after position 0
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=k + 1, ignore_eos=True, stop_token_ids=[ref[k]])
    assert tokens == ref[:k] and finished.reason == STOP and finished.usage.completion_tokens == k


async def test_stop_token_ids(stack, reference):
    _, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    stop = ref[5]
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    assert tokens == upto(ref, stop) and (finished.reason, finished.stop_token_id) == (STOP, stop)


async def test_eos_is_never_output(stack, reference):
    model, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    tokens, finished = await run(decoder, prompt_ids, max_output_tokens=40)
    eos = model.info.eos_token_ids
    if any(t in eos for t in ref):  # the model's own EOS ends it, unsent
        first = next(i for i, t in enumerate(ref) if t in eos)
        assert tokens == ref[:first] and finished.reason == STOP and finished.stop_token_id == ref[first]
    else:
        assert tokens == ref and finished.reason == LENGTH
    assert not set(tokens) & eos


async def test_streaming_equals_unary_equals_local(stack):
    _, _, generation, tokenizer, text_port = stack
    request = generate_request(PROMPT, max_output_tokens=24)
    responses = [r async for r in generation.Generate(request)]
    streamed_text = "".join(r.delta.text for r in responses if r.HasField("delta"))
    streamed_ids = [i for r in responses if r.HasField("delta") for i in r.delta.token_ids]
    completion = await generation.Complete(request)
    assert (completion.text, list(completion.token_ids)) == (streamed_text, streamed_ids)
    assert completion.usage == responses[-1].finished.usage
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "--log-level", "WARNING", "generate", "--local",
        "--model", str(TINY), "--max-context-length", str(stack[0].info.max_context_length), "--json", "--max-tokens", "24",
        "--weights", "int8" if stack[0].int8 else "float32", PROMPT,
        cwd=ROOT, env={**os.environ}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()
    local = json.loads(out)
    assert local["text"] == completion.text and local["token_ids"] == list(completion.token_ids)
    assert local["usage"]["completion_tokens"] == completion.usage.completion_tokens
    assert local["text"] == tokenizer.decode(local["token_ids"])


async def test_concurrent_requests_match_the_reference(stack, reference):
    _, decoder, _, _, _ = stack
    prompt_ids, ref = reference
    others = [run(decoder, prompt_ids[: 3 + i], max_output_tokens=10 + i, ignore_eos=True) for i in range(3)]
    mine = run(decoder, prompt_ids, max_output_tokens=40, ignore_eos=True)
    results = await asyncio.gather(mine, *others)
    assert results[0][0] == ref  # batch invariance through the whole stack (CPU, float32)
