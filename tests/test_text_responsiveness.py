"""The text service stays responsive: size limits before tokenizing, large tokenizer work off the
event loop, a cap on requests in flight. Real Tokenizer/TextGeneration and Decoder servers on
loopback (scripted model), the tiny checkpoint's real tokenizer (tests/assets/tiny-llama: about
one id per character, so its inputs are as costly per character as any).

The scripted model counts (after token t comes t + 1); see tests/test_text_service.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path

import grpc
import pytest

from engine.core.errors import InvalidArgument
from engine.core.scripted_model import ScriptedModel
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.client import generate_request
from services.decode_server import start_decode_server
from services.text_server import start_text_server
from services.text_service import LARGE_MIN
from support.tokenizer_assets import ASSETS as TOKENIZER_ASSETS
from support.waiting import until
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import INLINE_CHARS, TextTokenizer

ASSETS = Path(__file__).parent / "assets"
TINY = ASSETS / "tiny-llama"
MiB = 1024 * 1024
DEFAULT_LIMIT = 1024 * 1024  # the documented defaults of max_input_chars and max_detokenize_ids


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)


@pytest.fixture
def model() -> ScriptedModel:
    # tiny-llama's vocabulary and EOS ids; a context long enough for a stream of 2000 tokens
    return ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4, max_context_length=4096)


@contextlib.asynccontextmanager
async def serving(model, tokenizer, **limits):
    """(decode server, text server, TextGeneration stub, Tokenizer stub); `limits` go to start_text_server."""
    decode = await start_decode_server(model)
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}", **limits)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    try:
        yield decode, text, text_pb2_grpc.TextGenerationStub(channel), text_pb2_grpc.TokenizerStub(channel)
    finally:
        await channel.close()
        await text.stop(None)
        await decode.stop(None)


def prompt_ending_in(tokenizer: TextTokenizer, last_id: int) -> str:
    text = "hello " + tokenizer.decode([last_id], keep_special_tokens=True)
    assert tokenizer.encode(text)[-1] == last_id
    return text


async def still_serves(gen, tok, tokenizer) -> None:
    """A generation gets its tokens and a Tokenize its ids."""
    completion = await gen.Complete(generate_request(prompt_ending_in(tokenizer, 300), max_output_tokens=3))
    assert list(completion.token_ids) == [301, 302, 303]
    assert list((await tok.Tokenize(pb.TokenizeRequest(text="hello world"))).token_ids) == tokenizer.encode("hello world")


async def nothing_in_flight(text) -> None:
    """Wait (bounded) until the text server holds no request: a stream's handler leaves its
    admission just after the client has read its last message."""
    await until(lambda: text.admission.in_flight == 0, "the text server holds no request", interval_s=0.01)


async def read_to_end(call) -> list:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def chat(*turns: tuple[str, str]) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


# -- the off-GIL tokenizer path gives the same ids and text -------------------------------------


def test_the_gil_releasing_calls_equal_the_plain_ones():
    """TextTokenizer.encode goes through the batch entry point and Detokenize through
    `_decode_in_pieces` (Vocabulary.decode_releasing_gil): the same ids and text as HF's plain
    `encode` and TextTokenizer.decode."""
    from services.text_service import _decode_in_pieces

    texts = [
        "hello world",
        "  leading and   inner   spaces\n\ttabs\n\n",
        "ünïcödé 日本語 emoji 🙂 and a combining e\u0301",
        "<|im_start|>user\nhi<|im_end|>\n<s></s><|endoftext|>",
        "x" * 3000 + " word " * 500,
        "",
    ]
    dirs = [TINY, ASSETS / "tiny-qwen2", ASSETS / "tiny-qwen3", TOKENIZER_ASSETS / "gpt2", TOKENIZER_ASSETS / "sp-bpe"]
    for directory in dirs:
        plain = TextTokenizer.from_dir(directory)
        for text in texts:
            for special in (False, True):
                ids = plain._tokenizer.encode(text, add_special_tokens=special).ids  # HF's plain call: the reference
                assert plain.encode(text, add_special_tokens=special) == ids, (directory.name, text[:40], special)
                for keep in (False, True):
                    assert _decode_in_pieces(plain, ids, keep, "token_ids") == plain.decode(ids, keep_special_tokens=keep)
        with pytest.raises(InvalidArgument, match=rf"^token_ids\[1\]: {plain.vocab_size} is not in the vocabulary"):
            _decode_in_pieces(plain, [5, plain.vocab_size, 7], False, "token_ids")
    tiny = TextTokenizer.from_dir(TINY)  # ids copied in pieces of 64 Ki
    with pytest.raises(InvalidArgument, match=r"^token_ids\[70000\]: 512 is not in the vocabulary"):
        _decode_in_pieces(tiny, [5] * 70000 + [512], False, "token_ids")


async def test_large_inputs_off_the_loop_give_the_same_ids_and_text(model, tokenizer):
    async with serving(model, tokenizer) as (_, _, gen, tok):
        text = "hello world, ünïcödé 日本語 " * 3000  # 75 000 characters: the large pool, ids in pieces
        ids = list((await tok.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True))).token_ids)
        assert ids == tokenizer.encode(text, add_special_tokens=True) and len(ids) > 64 * 1024
        for keep in (False, True):
            detokenized = await tok.Detokenize(pb.DetokenizeRequest(token_ids=ids, keep_special_tokens=keep))
            assert detokenized.text == tokenizer.decode(ids, keep_special_tokens=keep)
        conversation = chat(("system", "be brief"), ("user", text[:5000]))  # the other pool
        ids = list((await tok.Tokenize(pb.TokenizeRequest(chat=conversation))).token_ids)
        assert ids == tokenizer.encode_chat([ChatMessage(m.role, m.content) for m in conversation.messages])
        completion = await gen.Complete(generate_request(text[:3000] + prompt_ending_in(tokenizer, 300), max_output_tokens=2))
        assert list(completion.token_ids) == [301, 302]
        assert completion.usage.prompt_tokens == len(tokenizer.encode(text[:3000] + prompt_ending_in(tokenizer, 300)))


# -- size limits, before any tokenizing ---------------------------------------------------------

LIMITS = dict(max_input_chars=1000, max_detokenize_ids=100)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda gen, tok: gen.Complete(generate_request("y" * 1001)),
         "prompt: 1001 characters is over the limit of 1000"),
        (lambda gen, tok: gen.Generate(generate_request("y" * 1001)).read(),
         "prompt: 1001 characters is over the limit of 1000"),
        (lambda gen, tok: gen.Complete(generate_request(chat=[("user", "a" * 500), ("assistant", "b" * 492)])),
         "chat.messages: 1005 characters (roles and contents summed) is over the limit of 1000"),
        (lambda gen, tok: tok.Tokenize(pb.TokenizeRequest(text="y" * 1001)),
         "text: 1001 characters is over the limit of 1000"),
        (lambda gen, tok: tok.Tokenize(pb.TokenizeRequest(chat=chat(("user", "a" * 997)))),
         "chat.messages: 1001 characters (roles and contents summed) is over the limit of 1000"),
        (lambda gen, tok: tok.Tokenize(pb.TokenizeRequest(chat=chat(*[("u", "")] * 4097))),
         "chat.messages: 4097 messages is over the limit of 4096"),
        (lambda gen, tok: tok.Detokenize(pb.DetokenizeRequest(token_ids=[5] * 101)),
         "token_ids: 101 ids is over the limit of 100"),
    ],
    ids=["complete prompt", "generate prompt", "generate chat", "tokenize text", "tokenize chat",
         "chat messages", "detokenize ids"],
)
async def test_over_the_limit_is_invalid_argument_naming_field_and_limit(model, tokenizer, call, message):
    async with serving(model, tokenizer, **LIMITS) as (_, text, gen, tok):
        error = await refused(call(gen, tok))
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        await still_serves(gen, tok, tokenizer)
        await nothing_in_flight(text)


async def test_at_the_limit_is_served(model, tokenizer):
    async with serving(model, tokenizer, **LIMITS) as (_, _, gen, tok):
        text = "hi " * 333 + "y"  # 1000 characters
        ids = list((await tok.Tokenize(pb.TokenizeRequest(text=text))).token_ids)
        assert ids == tokenizer.encode(text)
        conversation = chat(("user", "a" * 496), ("assistant", "b" * 491))  # 4 + 496 + 9 + 491 = 1000
        ids = list((await tok.Tokenize(pb.TokenizeRequest(chat=conversation))).token_ids)
        assert ids == tokenizer.encode_chat([ChatMessage(m.role, m.content) for m in conversation.messages])
        detokenized = await tok.Detokenize(pb.DetokenizeRequest(token_ids=[300] * 100))
        assert detokenized.text == tokenizer.decode([300] * 100)
        prompt = "hello " * 166 + "abcd"  # 1000 characters
        completion = await gen.Complete(generate_request(prompt, max_output_tokens=2))
        assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt)) and len(completion.token_ids) == 2


async def test_default_limits(model, tokenizer):
    """The defaults, without tokenizing: a prompt just under the 4 MiB message limit, and ids."""
    async with serving(model, tokenizer) as (_, _, gen, tok):
        huge = "y" * (4 * MiB - 1024)
        error = await refused(gen.Complete(generate_request(huge)))
        assert error.details() == f"prompt: {len(huge)} characters is over the limit of {DEFAULT_LIMIT}"
        error = await refused(tok.Tokenize(pb.TokenizeRequest(text="y" * (DEFAULT_LIMIT + 1))))
        assert error.details() == f"text: {DEFAULT_LIMIT + 1} characters is over the limit of {DEFAULT_LIMIT}"
        error = await refused(tok.Detokenize(pb.DetokenizeRequest(token_ids=[5] * (DEFAULT_LIMIT + 1))))
        assert error.details() == f"token_ids: {DEFAULT_LIMIT + 1} ids is over the limit of {DEFAULT_LIMIT}"
        await still_serves(gen, tok, tokenizer)


# -- requests in flight -------------------------------------------------------------------------


async def test_requests_over_the_in_flight_cap_are_resource_exhausted(model, tokenizer):
    model.step_delay_s = 0.01
    async with serving(model, tokenizer, max_in_flight=2) as (_, text, gen, tok):
        streams = [
            gen.Generate(generate_request(prompt_ending_in(tokenizer, last), max_output_tokens=60, ignore_eos=True))
            for last in (20, 300)  # 60 steps of 10 ms: in flight well past the refusals below
        ]
        for stream in streams:
            assert (await stream.read()).HasField("delta")  # admitted and producing
        assert text.admission.in_flight == 2
        for call in (
            gen.Complete(generate_request("hello", max_output_tokens=2)),
            gen.Generate(generate_request("hello", max_output_tokens=2)).read(),
            tok.Tokenize(pb.TokenizeRequest(text="hello")),
            tok.Detokenize(pb.DetokenizeRequest(token_ids=[5])),
        ):
            error = await refused(call)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error.details() == "the server already has 2 requests in flight, its limit; retry later"
        for stream, last in zip(streams, (20, 300)):  # the two admitted ones complete
            responses = await read_to_end(stream)
            ids = [i for r in responses if r.HasField("delta") for i in r.delta.token_ids]
            assert ids[-1] == last + 60 and responses[-1].finished.usage.completion_tokens == 60
        await nothing_in_flight(text)
        await still_serves(gen, tok, tokenizer)


async def test_a_cancelled_large_tokenize_holds_its_place_until_its_thread_is_done(model, tokenizer):
    """A worker thread cannot be stopped: its request counts as in flight until the thread ends,
    so clients that cancel cannot pile tokenizing up past the cap."""
    async with serving(model, tokenizer, max_in_flight=1) as (_, text, gen, tok):
        big = pb.TokenizeRequest(text=("hello world " * (DEFAULT_LIMIT // 12 + 1))[:DEFAULT_LIMIT])  # 0.4-2 s
        error = await refused(tok.Tokenize(big, timeout=0.05))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert text.admission.in_flight == 1  # its thread still tokenizes
        error = await refused(tok.Tokenize(pb.TokenizeRequest(text="hello")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await nothing_in_flight(text)
        await still_serves(gen, tok, tokenizer)


# -- large tokenizer work runs on the large pool's threads, off the event loop and off the GIL --
#
# What keeps a small stream at its pace while large requests are tokenized or refused, checked
# where it happens rather than timed (how long the gaps are is a benchmark's question, with the
# figures in services/text_service.py): a request over the limit is refused before any tokenizer
# call; work above LARGE_MIN runs on a `tokenize-large` thread at a lower priority, work above
# INLINE_MAX on a `tokenize` thread, smaller work inline on the loop; the event loop serves the
# stream while a large call runs; and the tokenizer's large-input calls release the GIL.


class TokenizerCalls:
    """Records each tokenizer call the servers make (`encode`, `encode_chat`, the vocabulary's
    `decode_releasing_gil`) with its input's size, the thread it ran on and that thread's nice
    value; `hold(size)`: a call on an input of that size waits until `release()` (bounded)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.calls: list[tuple[str, int, str, int]] = []  # (name, size, thread name, nice)
        self.held_size: int | None = None
        self.entered, self.released = threading.Event(), threading.Event()
        for owner, name in ((tokenizer, "encode"), (tokenizer, "encode_chat"), (tokenizer.vocabulary, "decode_releasing_gil")):
            setattr(owner, name, self._recording(name, getattr(owner, name)))

    def _recording(self, name: str, call):
        def recorded(content, *args, **kwargs):
            size = len(content)
            thread = threading.current_thread()
            self.calls.append((name, size, thread.name, os.getpriority(os.PRIO_PROCESS, thread.native_id)))
            if size == self.held_size:
                self.entered.set()
                assert self.released.wait(10), f"{name} held on {thread.name}: nothing released it"
            return call(content, *args, **kwargs)

        return recorded

    def hold(self, size: int) -> None:
        self.held_size = size

    def release(self) -> None:
        self.released.set()


at_limit = ("hello world, " * (DEFAULT_LIMIT // 13 + 1))[:DEFAULT_LIMIT]
over_limit = "y" * (4 * MiB - 1024)  # just under the 4 MiB message limit


@pytest.fixture
def recorded_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)  # its own: the calls are recorded on the instance


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's nice value is per thread on Linux only")
async def test_large_work_runs_on_the_large_pool_and_over_the_limit_reaches_no_tokenizer(model, recorded_tokenizer):
    calls = TokenizerCalls(recorded_tokenizer)
    loop_thread = threading.current_thread()
    loop_nice = os.getpriority(os.PRIO_PROCESS, loop_thread.native_id)
    async with serving(model, recorded_tokenizer) as (_, text, gen, tok):
        ids = [3 + i % 500 for i in range(DEFAULT_LIMIT)]
        requests = {
            "tokenize at the limit": tok.Tokenize(pb.TokenizeRequest(text=at_limit)),
            "generate at the limit": gen.Complete(generate_request(at_limit, max_output_tokens=1)),
            "detokenize at the limit": tok.Detokenize(pb.DetokenizeRequest(token_ids=ids)),
            "tokenize over": tok.Tokenize(pb.TokenizeRequest(text=over_limit)),
            "complete over": gen.Complete(generate_request(over_limit, max_output_tokens=1)),
            "generate over": gen.Generate(generate_request(over_limit, max_output_tokens=1)).read(),
        }
        outcomes = dict(zip(requests, await asyncio.wait_for(asyncio.gather(*requests.values(), return_exceptions=True), 120)))
        assert len(outcomes["tokenize at the limit"].token_ids) > DEFAULT_LIMIT // 4
        error = outcomes["generate at the limit"]  # tokenized, then too long for the context
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "leave no room" in error.details(), error
        assert len(outcomes["detokenize at the limit"].text) > DEFAULT_LIMIT
        for name in ("tokenize over", "complete over", "generate over"):
            error = outcomes[name]
            assert isinstance(error, grpc.aio.AioRpcError), (name, error)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().endswith("over the limit of 1048576")
        large = sorted((name, size) for name, size, _, _ in calls.calls)
        # the three at the limit, each once; none of the three over it
        assert large == [("decode_releasing_gil", DEFAULT_LIMIT), ("encode", DEFAULT_LIMIT), ("encode", DEFAULT_LIMIT)]
        for name, size, thread, nice in calls.calls:
            assert thread.startswith("tokenize-large") and nice == loop_nice + 10, (name, thread, nice, loop_nice)

        # the tiers below: inline on the loop up to INLINE_MAX, then the other pool at the usual priority
        calls.calls.clear()
        medium = "hello world, " * (LARGE_MIN // 13)
        await tok.Tokenize(pb.TokenizeRequest(text=medium))
        await tok.Tokenize(pb.TokenizeRequest(text="hello world"))
        [(_, _, medium_thread, medium_nice), (_, _, small_thread, _)] = calls.calls
        assert medium_thread.startswith("tokenize_") and medium_nice == loop_nice
        assert small_thread == loop_thread.name
        await still_serves(gen, tok, recorded_tokenizer)
        await nothing_in_flight(text)


async def test_the_loop_serves_a_small_stream_while_a_large_tokenize_runs(model, recorded_tokenizer):
    """A large Tokenize is held inside its tokenizer call (on its worker thread) until the small
    stream has had more messages: were it on the event loop, the loop would be held with it and
    the stream would get none (and the held call would fail after its bound)."""
    model.step_delay_s = 0.005
    calls = TokenizerCalls(recorded_tokenizer)
    calls.hold(DEFAULT_LIMIT)
    async with serving(model, recorded_tokenizer) as (_, text, gen, tok):
        stream = gen.Generate(generate_request(prompt_ending_in(recorded_tokenizer, 20), max_output_tokens=2000, ignore_eos=True))
        assert (await asyncio.wait_for(stream.read(), 10)).HasField("delta")
        large = asyncio.ensure_future(tok.Tokenize(pb.TokenizeRequest(text=at_limit)))
        try:
            await until(calls.entered.is_set, "the large tokenize is in its tokenizer call")
            for _ in range(5):  # the stream goes on meanwhile
                assert (await asyncio.wait_for(stream.read(), 10)).HasField("delta")
            assert not large.done()
        finally:
            calls.release()
        assert len((await asyncio.wait_for(large, 60)).token_ids) > DEFAULT_LIMIT // 4
        stream.cancel()
        await nothing_in_flight(text)


def test_large_inputs_are_encoded_and_decoded_with_the_gil_released(tokenizer):
    """With the interpreter's switch interval raised far past the call, a thread that holds the
    GIL keeps it until it blocks: this thread runs during the other's tokenizer call only if the
    call released the GIL. (Up to INLINE_CHARS, `encode` holds it, by design: the control.)"""
    text = ("hello world, " * 20_000)[:200_000]
    ids = tokenizer.encode(text)
    cases = {
        "encode, large": (lambda: tokenizer.encode(text), True),
        "decode_releasing_gil": (lambda: tokenizer.vocabulary.decode_releasing_gil(ids), True),
        "encode, inline": (lambda: [tokenizer.encode(text[:INLINE_CHARS]) for _ in range(200)], False),
    }
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(30.0)
        for name, (call, releases) in cases.items():
            entered, done = threading.Event(), threading.Event()

            def work() -> None:
                entered.set()
                call()
                done.set()

            worker = threading.Thread(target=work)
            worker.start()
            assert entered.wait(10)
            ran_during_the_call = not done.is_set()  # this thread got the GIL while the call ran
            worker.join(60)
            assert not worker.is_alive()
            assert ran_during_the_call == releases, name
    finally:
        sys.setswitchinterval(interval)
