"""Per-request text state is bounded and freed on finish, error and cancel.

Each Generate/Complete holds one `TextStream`: an `IncrementalDetokenizer` (a window of ids) and,
with stop strings, a `StopStringMatcher` (the text that may begin one). Counted with `gc`, no
mocks, through a real stack (text server -> decode server, scripted model, tiny-llama's tokenizer):
  * 1,000 mixed requests (250 in the CI profile), 16 at a time: Generate and Complete, prompt and chat input, stop
    strings, keep_special_tokens, early client cancels, deadlines, and invalid requests (some
    refused before the stream exists, some by the decoder after it does). While they run, the
    live state is bounded by what is in flight; afterwards none is alive, the engine holds no
    slot, no queued request and no KV page (its pool half what 4 contexts take, so requests are
    preempted too), the model no slot, and neither server counts a request in flight;
  * every way a request can end frees its state as it ends, by reference counting: state kept
    alive by a reference cycle waits for the cycle collector, which may not run for a long time.
And directly: a detokenizer holds at most CONTEXT_TOKENS ids plus the current run of byte-fallback
tokens (the one thing its window cannot bound); a matcher holds less text than its longest stop
string.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import random
import weakref
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.examples import examples
from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.text.v1 import text_pb2 as tpb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from support.idle import until_nothing_held
from support.waiting import until
from tokenizer_svc.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from tokenizer_svc.stop_strings import StopStringMatcher
from tokenizer_svc.text_stream import TextStream
from tokenizer_svc.tokenizer import TextTokenizer

ASSETS = Path(__file__).parent / "assets"
VOCAB, EOS, CONTEXT = 512, frozenset({0, 2}), 64
# 1,000 requests in the thorough profile, 250 in CI's (support.examples): the state sampled every
# 50 requests is bounded by the 16 in flight either way, and a leak is one object a request
REQUESTS, CONCURRENCY = examples(1000), 16
PER_REQUEST_STATE = (TextStream, IncrementalDetokenizer, StopStringMatcher)
Code = grpc.StatusCode


@functools.cache
def tiny_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(ASSETS / "tiny-llama")


def live_state(exclude: weakref.WeakSet) -> list[object]:
    """Per-request state objects alive now, but those in `exclude` (gc tracks these classes)."""
    return [o for o in gc.get_objects() if isinstance(o, PER_REQUEST_STATE) and o not in exclude]


def by_class(objects: list[object]) -> dict[str, int]:
    return dict(collections.Counter(type(o).__name__ for o in objects))


@pytest.fixture
async def stack():
    # slow enough that cancels and deadlines land mid-stream; a KV pool of 8 pages (half of 4
    # contexts) so that requests are also preempted and recomputed, and their pages freed
    model = ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=4, max_context_length=CONTEXT,
                          step_delay_s=0.001, kv_cache_tokens=8 * 16)
    decode = await start_decode_server(model, EngineConfig(max_queue_size=CONCURRENCY))
    text = await start_text_server(tiny_tokenizer(), f"127.0.0.1:{decode.port}")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    gc.collect()
    before = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, PER_REQUEST_STATE))  # not ours to judge
    # What the worker holds from earlier tests (hundreds of thousands of objects late in a run) is
    # set aside from collection: each collection here, the tests' own and the automatic ones, then
    # scans only what this test made, which is all that could be its state.
    gc.freeze()
    try:
        yield text_pb2_grpc.TextGenerationStub(channel), decode, text, model, before
    finally:
        gc.unfreeze()
        await channel.close()
        await text.stop(None)
        await decode.stop(None)


# -- the mix ------------------------------------------------------------------------------------

STOP_TEXT = [*"etaoinsrl ", "\n", "in", "re", "er", " s", "self", "__", "\ufffd", "zzz!", "ion!"]
INVALID = {  # what makes a request invalid (the text service refuses it unless noted)
    "empty prompt": lambda r: r.ClearField("input"),
    "17 stop strings": lambda r: r.stop_strings.extend(["a"] * 17),
    "empty stop string": lambda r: r.stop_strings.append(""),
    "empty chat role": lambda r: r.chat.CopyFrom(tpb.Chat(messages=[tpb.ChatMessage(role="", content="x")])),
    "control char in request_id": lambda r: setattr(r, "request_id", "a\x07b"),
    "stop id out of range": lambda r: r.stopping.stop_token_ids.append(VOCAB),  # by the decoder
    "max_output_tokens 0": lambda r: setattr(r.stopping, "max_output_tokens", 0),  # by the decoder
    "temperature -1": lambda r: setattr(r.sampling, "temperature", -1.0),  # by the decoder
}
ENDINGS = ["full", "cancel", "deadline", *INVALID]


def mixed_request(rng: random.Random, ending: str | None = None) -> tuple[tpb.GenerateRequest, str, str]:
    """(request, rpc, ending); `ending` ("full", "cancel", "deadline" or an INVALID key) is drawn
    when not given."""
    request = tpb.GenerateRequest(keep_special_tokens=rng.random() < 0.3, include_stop_string=rng.random() < 0.5)
    if rng.random() < 0.3:
        request.chat.CopyFrom(tpb.Chat(messages=[tpb.ChatMessage(role="user", content=rng.choice(["hi", "é€", "?"]))]))
    else:
        request.prompt = "".join(rng.choice("abcdefgh ijk\n€😀") for _ in range(rng.randint(1, 12)))
    request.stopping.ignore_eos = rng.random() < 0.5
    if rng.random() < 0.8:
        request.stopping.max_output_tokens = rng.randint(1, 24)
    if rng.random() < 0.5:
        request.stop_strings.extend(rng.sample(STOP_TEXT, rng.randint(1, 3)))
    if ending is None:
        ending = rng.choices(["full", "cancel", "deadline", "invalid"], weights=[55, 20, 10, 15])[0]
        ending = rng.choice(sorted(INVALID)) if ending == "invalid" else ending
    if ending in INVALID:
        INVALID[ending](request)
    return request, rng.choice(["Generate", "Complete"]), ending


async def run(stub: text_pb2_grpc.TextGenerationStub, request, rpc: str, ending: str, rng: random.Random) -> Code:
    """Make one call and end it as `ending` says; returns its status code."""
    timeout = rng.uniform(0.001, 0.02) if ending == "deadline" else 10.0
    call = getattr(stub, rpc)(request, timeout=timeout)
    with contextlib.suppress(grpc.aio.AioRpcError):  # the status is what counts
        if ending == "cancel" and rpc == "Generate":
            for _ in range(rng.randint(0, 3)):
                if await call.read() is grpc.aio.EOF:
                    break
            call.cancel()
        elif ending == "cancel":
            await asyncio.sleep(rng.uniform(0, 0.01))
            call.cancel()
        elif rpc == "Generate":
            async for _ in call:
                pass
        else:
            await call
    return await call.code()


EXPECTED = {  # ending -> the statuses it may get (RESOURCE_EXHAUSTED aside)
    "full": {Code.OK},
    "cancel": {Code.CANCELLED, Code.OK},  # OK: it finished before the cancel
    "deadline": {Code.DEADLINE_EXCEEDED, Code.OK},
    **{invalid: {Code.INVALID_ARGUMENT} for invalid in INVALID},
}


# -- through the stack --------------------------------------------------------------------------


async def test_no_state_is_left_after_many_mixed_requests_with_cancels(stack):
    stub, decode, text, model, before = stack
    rng = random.Random(20260130)
    slots, in_flight = asyncio.Semaphore(CONCURRENCY), 0
    peak = 0
    outcomes: collections.Counter[tuple[str, Code]] = collections.Counter()

    async def one(n: int, request, rpc: str, ending: str) -> None:
        nonlocal in_flight, peak
        async with slots:
            in_flight += 1
            code = await run(stub, request, rpc, ending, random.Random(n))
            in_flight -= 1
        assert code in EXPECTED[ending] | {Code.RESOURCE_EXHAUSTED}, (n, ending, rpc, code, request)
        outcomes[ending if ending in ("full", "cancel", "deadline") else "invalid", code] += 1
        if n % 50 == 0:  # bounded by what is in flight, not by how many requests ran
            gc.collect()
            alive = sum(isinstance(o, TextStream) for o in live_state(before))
            peak = max(peak, alive)
            # a cancelled call's server side may outlive the client's call for a moment
            assert alive <= 2 * CONCURRENCY, (alive, in_flight)

    await asyncio.gather(*(one(n, *mixed_request(rng)) for n in range(REQUESTS)))
    # Then 4 requests at once that each run to the context (4 pages of 16 positions, 16 in all
    # against the pool's 8): whatever the mix's timing left to chance, the pool runs short and
    # requests are preempted, recomputed and freed.
    pressure = tpb.GenerateRequest(prompt="ab")
    pressure.stopping.ignore_eos = True
    codes = await asyncio.gather(*(run(stub, pressure, "Complete", "full", random.Random(n)) for n in range(4)))
    assert codes == [Code.OK] * 4
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["cancel", Code.CANCELLED] > REQUESTS // 20 and outcomes["deadline", Code.DEADLINE_EXCEEDED] > REQUESTS // 50, outcomes  # of 20% and 10% drawn
    assert outcomes["full", Code.RESOURCE_EXHAUSTED] < REQUESTS // 10, outcomes  # most requests did run
    assert peak > 0, "sampling never saw a live TextStream: it would not see a leak either"

    await until_nothing_held(decode, text, model)
    await until(lambda: decode.engine.stats().pages.used == 0, "every KV page free")
    assert decode.engine.stats().preemptions > 0  # the pool was short (the 4 long ones): preempted requests were freed too
    gc.collect()
    assert by_class(live_state(before)) == {}, "per-request state still alive after every request ended"


async def test_every_ending_frees_the_state_as_it_ends_not_at_the_next_gc(stack):
    """With the cycle collector off, each way of ending leaves nothing behind once it has ended."""
    stub, decode, text, model, before = stack
    rng = random.Random(7)
    seen, left_by_ending = weakref.WeakSet(before), {}
    gc.collect()
    gc.disable()
    try:
        for ending in ENDINGS:
            cut_short = ending in ("cancel", "deadline")
            # A cancel or deadline must end the decoder's request too. A mixed request (1 ms steps,
            # at most 63 tokens) would end on its own well inside until_idle's 3 s, cancelled or
            # not, so these run long: "hello" (2 ids) to the 64-token context, 61 steps of 50 ms
            # (3 s), and must be freed within 15 steps (about 1-3 when the cancel works).
            model.step_delay_s = 0.05 if cut_short else 0.001
            for n in range(6):
                request, _, _ = mixed_request(rng, ending)
                rpc = ("Generate", "Complete")[n % 2]
                if cut_short:
                    request.prompt = "hello"
                    request.stopping.ClearField("max_output_tokens")
                    request.stopping.ignore_eos = True
                steps = model.decode_steps
                code = await run(stub, request, rpc, ending, rng)
                assert code in EXPECTED[ending], (ending, rpc, code)
                if cut_short:
                    await until_nothing_held(decode, text, model)
                    assert model.decode_steps - steps <= 15, (ending, rpc, model.decode_steps - steps)
            model.step_delay_s = 0.001
            await until_nothing_held(decode, text, model)
            if left := live_state(seen):
                left_by_ending[ending] = by_class(left)
                seen.update(left)
            del left
    finally:
        gc.enable()
        gc.collect()
    assert left_by_ending == {}, f"state kept alive by reference cycles, by how the request ended: {left_by_ending}"


# -- the bounds, directly -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["tiny-llama", "tokenizers/sp-bpe", "tokenizers/gpt2"])
def test_detokenizer_holds_a_window_plus_the_current_byte_run(family):
    tokenizer = TextTokenizer.from_dir(ASSETS / family)
    rng = random.Random(family)
    ids = range(min(tokenizer.vocab_size, 5000))
    vocabulary = tokenizer.vocabulary
    byte_ids = [i for i in ids if vocabulary.is_byte_token(i)]  # <0xHH> tokens (sp-bpe only)
    other_ids = [i for i in ids if not vocabulary.is_byte_token(i)]
    prompt = rng.choices(other_ids, k=40)
    detokenizer = IncrementalDetokenizer(vocabulary, prompt, keep_special_tokens=rng.random() < 0.5)
    run = peak = 0  # run: byte-fallback tokens pushed since the last other token
    for _ in range(3000):
        if byte_ids and rng.random() < 0.1:  # now and then a short run of byte tokens
            chunk = rng.choices(byte_ids, k=rng.randint(1, 4))
            run += len(chunk)
        else:
            chunk = rng.choices(other_ids, k=rng.randint(1, 3))
            run = 0
        detokenizer.push(chunk)
        peak = max(peak, detokenizer.held_token_count)
        assert detokenizer.held_token_count <= CONTEXT_TOKENS + run
    detokenizer.finish()
    assert detokenizer.held_token_count == 0 and peak >= 1


@settings(max_examples=examples(200), deadline=None)
@given(
    ids=st.lists(st.integers(3, VOCAB - 1), max_size=200),
    stops=st.lists(st.text("abcdefghijklmnopqrstuvwxyz !()_\n", min_size=1, max_size=12), min_size=1, max_size=4),
)
def test_a_text_stream_holds_less_text_than_its_longest_stop_string(ids, stops):
    stream = TextStream(IncrementalDetokenizer(tiny_tokenizer().vocabulary, [300]), StopStringMatcher(stops))
    longest = max(map(len, stops))
    for token_id in ids:
        if stream.push([token_id]).stop_string is not None:
            return  # matched: the stream ends here
        assert len(stream.matcher.held_text) < longest
        assert stream.detokenizer.held_token_count <= CONTEXT_TOKENS  # byte-level: every token end is a boundary
    stream.finish()
    assert stream.matcher.held_text == "" and stream.detokenizer.held_token_count == 0
