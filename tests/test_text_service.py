"""The text service end to end: real Tokenizer/TextGeneration server -> real Decoder server
(scripted model) on loopback, with the tiny checkpoint's real tokenizer files.

The scripted model counts (after token t comes t + 1); its vocabulary (512) and EOS ids
({0, 2}: config.json says 0, generation_config.json says [2, 0], the tokenizer's eos is
<|im_end|> = 2) match tests/assets/tiny-llama, so the text service accepts it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine, EngineConfig
from engine.core.errors import InvalidArgument
from engine.core.events import Finished, FinishReason, Token, Usage
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.text.v1 import text_pb2 as pb
from protos.text.v1 import text_pb2_grpc
from services.client import generate_request
from services.decode_server import start_decode_server
from services.decode_events import event_from_pb, event_to_pb
from services.errors import status_for
from services.text_server import ModelMismatch, start_text_server
from services.text_service import TextGenerationServicer, collect, engine_decode
from support.waiting import LIMIT_S, steps_until_freed
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).parent / "assets" / "tiny-llama"
STOP, LENGTH = dpb.FINISH_REASON_STOP, dpb.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)


@pytest.fixture
def model() -> ScriptedModel:
    return ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=4, max_context_length=128)


@pytest.fixture
async def stack(model, tokenizer):
    decode = await start_decode_server(model, EngineConfig(max_queue_size=8))
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{text.port}")
    yield decode, text_pb2_grpc.TextGenerationStub(channel), text_pb2_grpc.TokenizerStub(channel)
    await channel.close()
    await text.stop(None)
    await decode.stop(None)


async def generate(stub, request) -> tuple[list[pb.TextDelta], pb.TextFinished]:
    """Run Generate and check the stream's structure: deltas, then exactly one TextFinished, last."""
    responses = [r async for r in stub.Generate(request)]
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds.count("finished") == 1 and kinds[-1] == "finished", kinds
    finished = responses[-1].finished
    deltas = [r.delta for r in responses[:-1]]
    ids = [i for d in deltas for i in d.token_ids]
    assert finished.reason in (STOP, LENGTH)
    assert finished.usage.completion_tokens == len(ids)
    return deltas, finished


def prompt_ending_in(tokenizer: TextTokenizer, last_id: int) -> str:
    """A prompt whose tokenization ends in `last_id`, so the scripted output starts at last_id + 1."""
    text = "hello " + tokenizer.decode([last_id], keep_special_tokens=True)
    assert tokenizer.encode(text)[-1] == last_id
    return text


# A cancel (the client's, or a stop string's) must end the decode long before it would end on its
# own, or the tests of it prove nothing (as in tests/test_decode_service.py). prompt_ending_in's
# prompts are 5 tokens, so a request with no cap runs to the 128-token context: the prefill and
# 122 decode steps, 2.4 s at SLOW_STEP_S. The slot must be free within FREED_WITHIN_STEPS decode
# steps (0.4 s) of the cancel, counted by the model: time for the cancel to cross the text
# service, the DecodeStream and the engine, far fewer than the 98 or more steps a cancel that
# does nothing leaves the request running.
SLOW_STEP_S = 0.02
FREED_WITHIN_STEPS = 20


async def slot_freed(engine, model: ScriptedModel, since: int, at_most: int) -> int:
    """support.waiting.steps_until_freed on the engine's and the model's slots, in the model's steps."""
    return await steps_until_freed(
        lambda: engine.stats().slots_in_use or model.slots_held, lambda: model.decode_steps, since, at_most
    )


@pytest.mark.parametrize("n", [1, 2, 3, 20])
async def test_exactly_n_tokens_and_text_equals_decode(stack, tokenizer, n):
    _, gen, _ = stack
    prompt = prompt_ending_in(tokenizer, 300)
    deltas, finished = await generate(gen, generate_request(prompt, max_output_tokens=n))
    ids = [i for d in deltas for i in d.token_ids]
    assert ids == list(range(301, 301 + n))
    assert finished.reason == LENGTH
    assert finished.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)


async def test_eos_at_prefill_gives_no_delta(stack, tokenizer):
    _, gen, _ = stack
    deltas, finished = await generate(gen, generate_request(prompt_ending_in(tokenizer, 1), max_output_tokens=5))
    assert deltas == []
    assert (finished.reason, finished.stop_token_id, finished.usage.completion_tokens) == (STOP, 2, 0)


async def test_eos_text_never_reaches_a_delta_even_keeping_special_tokens(stack, tokenizer):
    _, gen, _ = stack
    # output: 1 (<|im_start|>, special but not a control token), then 2 = <|im_end|> = EOS
    request = generate_request(prompt_ending_in(tokenizer, 0), max_output_tokens=5, keep_special_tokens=True)
    deltas, finished = await generate(gen, request)
    text = "".join(d.text for d in deltas)
    assert [i for d in deltas for i in d.token_ids] == [1]
    assert text == "<|im_start|>" and "<|im_end|>" not in text
    assert (finished.reason, finished.stop_token_id) == (STOP, 2)
    request.keep_special_tokens = False
    deltas, _ = await generate(gen, request)
    assert "".join(d.text for d in deltas) == ""


async def test_wrapping_into_eos_zero_stops(stack, tokenizer):
    _, gen, _ = stack
    deltas, finished = await generate(gen, generate_request(prompt_ending_in(tokenizer, 507), max_output_tokens=10))
    assert [i for d in deltas for i in d.token_ids] == [508, 509, 510, 511]
    assert (finished.reason, finished.stop_token_id) == (STOP, 0)


async def test_stop_token_ids_and_ignore_eos_pass_through(stack, tokenizer):
    _, gen, _ = stack
    prompt = prompt_ending_in(tokenizer, 507)
    deltas, finished = await generate(gen, generate_request(prompt, max_output_tokens=7, ignore_eos=True))
    assert [i for d in deltas for i in d.token_ids] == [508, 509, 510, 511, 0, 1, 2]
    assert finished.reason == LENGTH
    deltas, finished = await generate(gen, generate_request(prompt, max_output_tokens=6, stop_token_ids=[510]))
    assert [i for d in deltas for i in d.token_ids] == [508, 509]
    assert (finished.reason, finished.stop_token_id) == (STOP, 510)


async def test_complete_equals_generate_collected(stack, tokenizer):
    _, gen, _ = stack
    for last, n in [(300, 7), (507, 10), (1, 3), (0, 4)]:
        request = generate_request(prompt_ending_in(tokenizer, last), max_output_tokens=n)
        deltas, finished = await generate(gen, request)
        completion = await gen.Complete(request)
        assert completion.text == "".join(d.text for d in deltas)
        assert list(completion.token_ids) == [i for d in deltas for i in d.token_ids]
        assert completion.reason == finished.reason and completion.usage == finished.usage
        assert completion.HasField("stop_token_id") == finished.HasField("stop_token_id")
        assert completion.stop_token_id == finished.stop_token_id


async def test_a_prompt_of_ids_is_sent_as_it_is_and_a_text_prompt_as_its_ids_gives_the_same(stack, tokenizer):
    _, gen, _ = stack
    text = prompt_ending_in(tokenizer, 300)
    as_text = generate_request(text, max_output_tokens=5)
    as_ids = generate_request(tokenizer.encode(text), max_output_tokens=5)  # (the client's prompt of ids)
    assert await gen.Complete(as_ids) == await gen.Complete(as_text)
    # ids no text tokenizes to (special tokens, one id repeated) reach the decoder as they are
    ids = pb.GenerateRequest(stopping=as_text.stopping, prompt_token_ids=pb.TokenIds(ids=[1, 2, 1, 305, 305]))
    completion = await gen.Complete(ids)
    assert list(completion.token_ids) == [306, 307, 308, 309, 310] and completion.usage.prompt_tokens == 5
    assert completion.text == tokenizer.decode([306, 307, 308, 309, 310])
    for bad, field in ([5, 512], "prompt_token_ids[1]"), ([], "prompt_token_ids"), ([7] * 128, "prompt_token_ids"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gen.Complete(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=bad)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()


async def test_tokenize_and_detokenize(stack, tokenizer):
    _, _, tok = stack
    text = "<|im_start|>user\nhello world<|im_end|>"
    ids = (await tok.Tokenize(pb.TokenizeRequest(text=text))).token_ids
    assert list(ids) == tokenizer.encode(text) and ids[0] == 1 and ids[-1] == 2
    assert (await tok.Detokenize(pb.DetokenizeRequest(token_ids=ids))).text == "user\nhello world"
    kept = await tok.Detokenize(pb.DetokenizeRequest(token_ids=ids, keep_special_tokens=True))
    assert kept.text == text


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda s: s[2].Detokenize(pb.DetokenizeRequest(token_ids=[5, 512])), "token_ids[1]"),
        (lambda s: s[1].Complete(generate_request("")), "prompt"),
        (lambda s: s[1].Complete(generate_request("hi", max_output_tokens=0)), "stopping.max_output_tokens"),
        (lambda s: s[1].Complete(generate_request("hi", temperature=float("nan"))), "sampling.temperature"),
        (lambda s: s[1].Complete(generate_request("hi " * 200)), "prompt"),
    ],
    ids=["detokenize id", "empty prompt", "max 0", "nan temperature", "prompt too long"],
)
async def test_invalid_argument_names_the_field(stack, call, field):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(stack)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


async def test_cancelling_generate_cancels_the_decode_and_frees_the_slot(stack, model, tokenizer):
    decode, gen, _ = stack
    model.step_delay_s = SLOW_STEP_S
    call = gen.Generate(generate_request(prompt_ending_in(tokenizer, 300), ignore_eos=True))  # 122 steps
    first = await asyncio.wait_for(call.read(), LIMIT_S)
    assert first.delta.token_ids[:1] == [301]  # the prefill's token: the decode is running
    assert decode.engine.stats().slots_in_use == 1
    cancelled_at = model.decode_steps
    call.cancel()
    await slot_freed(decode.engine, model, cancelled_at, FREED_WITHIN_STEPS)
    assert decode.engine.stats().queue_depth == 0


async def test_refuses_a_decoder_serving_another_model(tokenizer):
    for other in (
        ScriptedModel(vocab_size=100, eos_token_ids=frozenset({0, 2})),  # vocabulary too small
        ScriptedModel(vocab_size=512, eos_token_ids=frozenset({2})),  # different EOS ids
    ):
        decode = await start_decode_server(other)
        try:
            with pytest.raises(ModelMismatch, match="another model"):
                await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
        finally:
            await decode.stop(None)


# -- stop strings -----------------------------------------------------------------------
# From a prompt ending in 300 the scripted output is 301, 302, ... whose text is
# " b", " if", " p", "ion", "ct", " s", "__", " in", ...: " b if pionct s__ in"


@pytest.mark.parametrize("include", [False, True])
async def test_stop_string_across_token_boundaries(stack, model, tokenizer, include):
    decode, gen, _ = stack
    model.step_delay_s = SLOW_STEP_S
    request = generate_request(prompt_ending_in(tokenizer, 300), ignore_eos=True)  # no cap: 122 decode steps
    request.stop_strings.extend(["zzz", "pionc"])  # "pionc" = " p" + "ion" + "c" of "ct": completed by the 5th token
    request.include_stop_string = include
    started_at = model.decode_steps
    deltas, finished = await asyncio.wait_for(generate(gen, request), LIMIT_S)
    assert "".join(d.text for d in deltas) == (" b if pionc" if include else " b if ")
    assert [i for d in deltas for i in d.token_ids] == [301, 302, 303, 304, 305]
    assert (finished.reason, finished.stop_string, finished.usage.completion_tokens) == (STOP, "pionc", 5)
    assert not finished.HasField("stop_token_id")
    # the upstream decode was cancelled: its slot is free within a few steps of the 4th (305's)
    await slot_freed(decode.engine, model, started_at, 4 + FREED_WITHIN_STEPS)
    started_at = model.decode_steps
    completion = await gen.Complete(request, timeout=LIMIT_S)
    assert completion.text == "".join(d.text for d in deltas) and completion.stop_string == "pionc"
    assert completion.usage == finished.usage
    await slot_freed(decode.engine, model, started_at, 4 + FREED_WITHIN_STEPS)


async def test_stop_string_never_matching_holds_nothing_back_at_the_end(stack, tokenizer):
    _, gen, _ = stack
    request = generate_request(prompt_ending_in(tokenizer, 300), max_output_tokens=4)
    request.stop_strings.append("ion!")  # "ion" arrives last-but-one and is held until it cannot match
    deltas, finished = await generate(gen, request)
    assert "".join(d.text for d in deltas) == tokenizer.decode([301, 302, 303, 304])
    assert finished.reason == LENGTH and not finished.HasField("stop_string")


@pytest.mark.parametrize(
    "stops,field", [(["a"] * 17, "stop_strings"), (["ok", ""], "stop_strings[1]"), (["x" * 257], "stop_strings[0]")]
)
async def test_bad_stop_strings_are_invalid_argument(stack, stops, field):
    _, gen, _ = stack
    request = generate_request("hello", max_output_tokens=3)
    request.stop_strings.extend(stops)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gen.Complete(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")


# -- chat ---------------------------------------------------------------------------------


def chat(*turns, add_generation_prompt=None) -> pb.Chat:
    c = pb.Chat(messages=[pb.ChatMessage(role=r, content=t) for r, t in turns])
    if add_generation_prompt is not None:
        c.add_generation_prompt = add_generation_prompt
    return c


async def test_chat_input_is_rendered_with_the_models_template(stack, tokenizer):
    _, gen, tok = stack
    conversation = chat(("user", "hi"))
    ids = list((await tok.Tokenize(pb.TokenizeRequest(chat=conversation))).token_ids)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tokenizer.encode(rendered)
    no_prompt = (await tok.Tokenize(pb.TokenizeRequest(chat=chat(("user", "hi"), add_generation_prompt=False)))).token_ids
    assert list(no_prompt) == tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    request = pb.GenerateRequest(chat=conversation, stopping=dpb.StoppingCriteria(max_output_tokens=3))
    deltas, finished = await generate(gen, request)
    assert finished.usage.prompt_tokens == len(ids)
    assert [i for d in deltas for i in d.token_ids] == [ids[-1] + 1, ids[-1] + 2, ids[-1] + 3]


@pytest.mark.parametrize(
    "conversation,field", [(chat(), "chat.messages"), (chat(("", "x")), "chat.messages[0].role")]
)
async def test_bad_chat_is_invalid_argument(stack, conversation, field):
    _, gen, tok = stack
    for call in (gen.Complete(pb.GenerateRequest(chat=conversation)), tok.Tokenize(pb.TokenizeRequest(chat=conversation))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:")


async def test_chat_without_a_template_is_invalid_argument(model, tmp_path):
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((TINY / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    decode = await start_decode_server(model)
    text = await start_text_server(TextTokenizer.from_dir(tmp_path), f"127.0.0.1:{decode.port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await text_pb2_grpc.TextGenerationStub(channel).Complete(pb.GenerateRequest(chat=chat(("user", "hi"))))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("chat:") and "template" in err.value.details()
    finally:
        await text.stop(None)
        await decode.stop(None)


# -- the shell's conversions, and the in-process path -------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        Token(7),
        Token(7, -0.5),
        Finished(FinishReason.LENGTH, Usage(3, 4)),
        Finished(FinishReason.STOP, Usage(3, 0), stop_token_id=2),
    ],
)
def test_engine_events_round_trip_through_the_decode_proto(event):
    assert event_from_pb(event_to_pb(event)) == event


def test_a_decode_event_outside_the_stream_contract_is_refused():
    with pytest.raises(ValueError, match="neither a token nor a finish"):
        event_from_pb(dpb.DecodeEvent())
    with pytest.raises(ValueError, match="finish reason 0"):
        event_from_pb(dpb.DecodeEvent(finished=dpb.Finished(usage=dpb.Usage())))


async def test_generate_over_an_in_process_engine_equals_complete_over_grpc(stack, model, tokenizer):
    """What `tokenwire generate --local` runs: the same servicer over the engine's own events."""
    _, gen, _ = stack
    local_model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_context_length=128)
    info = local_model.info
    engine = Engine(local_model)
    engine.start()
    try:
        local = TextGenerationServicer(tokenizer, engine_decode(AsyncEngine(engine), info), info)
        for request in (
            generate_request(prompt_ending_in(tokenizer, 300), max_output_tokens=7),
            generate_request(prompt_ending_in(tokenizer, 507), max_output_tokens=10),
        ):
            assert await collect(local.generate(request)) == await gen.Complete(request)
        with pytest.raises(InvalidArgument, match="^sampling.temperature:"):
            await collect(local.generate(generate_request("hi", temperature=float("nan"))))
        stopped = generate_request(prompt_ending_in(tokenizer, 300), ignore_eos=True)  # no cap: 122 decode steps
        stopped.stop_strings.append("pionc")  # completed by the 5th token, at the 4th decode step
        local_model.step_delay_s = SLOW_STEP_S
        started_at = local_model.decode_steps
        completion = await asyncio.wait_for(collect(local.generate(stopped)), LIMIT_S)
        # the stop string's cancel reaches the engine within a few steps
        await slot_freed(engine, local_model, started_at, 4 + FREED_WITHIN_STEPS)
        assert completion == await gen.Complete(stopped, timeout=LIMIT_S) and completion.stop_string == "pionc"
    finally:
        engine.stop()


def scripted_decode(steps):
    """A DecodeFn that sends `steps` (lists of engine events) whatever it is asked."""

    def decode(request, timeout):
        async def events():
            for step in steps:
                yield step

        return events()

    return decode


@pytest.mark.parametrize(
    "steps, code",
    [
        ([[Token(301), Finished(FinishReason.LENGTH, Usage(4, 2))]], grpc.StatusCode.INTERNAL),  # counts 2, sent 1
        ([[Token(301), Token(512)]], grpc.StatusCode.INTERNAL),  # an id the tokenizer does not have
        ([[Token(301)], [Token(302)]], grpc.StatusCode.UNAVAILABLE),  # ends without Finished
    ],
    ids=["accounting mismatch", "unknown id", "no Finished"],
)
async def test_a_decoder_breaking_the_stream_contract_gets_a_status(tokenizer, model, steps, code):
    servicer = TextGenerationServicer(tokenizer, scripted_decode(steps), model.info)
    with pytest.raises(Exception) as error:
        await collect(servicer.generate(generate_request("hello", max_output_tokens=5)))
    assert status_for(error.value)[0] == code  # as services.errors maps it at the gRPC boundary
