"""The text-generation use case (tokenizer_svc/generation.py) on plain engine events: no protobuf,
no gRPC, no servers.

The decoder is a `ScriptedDecode`: an async generator of event lists (one list per decoder step,
as `AsyncEngine.stream` yields them) that records how many steps were read and whether it was
closed before its end, which is how a decode gets cancelled. One test runs the real engine loop
(scripted model) instead. The tokenizer is tiny-llama's real one (byte-level BPE, vocabulary 512):
after a prompt ending in id 300, the ids 301, 302, ... read " b", " if", " p", "ion", "ct", ...
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.engine import Engine
from engine.core.errors import InvalidArgument
from engine.core.events import Event, Finished, FinishReason, Token, Usage
from engine.core.model import ModelInfo
from engine.core.request import Request, StoppingCriteria
from engine.core.scripted_model import ScriptedModel
from support.tokenizer_assets import load_tokenizer
from support.waiting import steps_until_freed
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.generation import (
    AccountingMismatch,
    Chat,
    DecoderFault,
    StreamEndedWithoutFinished,
    TextDelta,
    TextFinished,
    TextRequest,
    UnknownTokenId,
    generate_text,
    prepare_request,
)
from tokenizer_svc.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
INFO = ModelInfo("tiny-llama", vocab_size=512, max_context_length=64, max_batch_size=1, eos_token_ids=frozenset({0, 2}))
PROMPT = (284, 78, 338, 300)  # "hello" then id 300
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


@functools.cache
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)


class ScriptedDecode:
    """Hands out `steps` in order; `read` counts the steps handed out, `cancelled` says whether
    it was closed while steps remained (as `AsyncEngine.stream` aborts the engine request then)."""

    def __init__(self, steps: list[list[Event]]) -> None:
        self.steps = steps
        self.read = 0
        self.cancelled = False

    async def stream(self):
        try:
            for events in self.steps:
                self.read += 1
                yield events
        except GeneratorExit:
            self.cancelled = self.read < len(self.steps)
            raise


def tokens(ids) -> list[Event]:
    return [Token(i) for i in ids]


def script(ids: list[int], per_step: int, finished: Finished) -> list[list[Event]]:
    """`ids` in steps of `per_step`, Finished at the end of the last one."""
    steps = [tokens(ids[i : i + per_step]) for i in range(0, len(ids), per_step)] or [[]]
    steps[-1].append(finished)
    return steps


def reference(prompt, output) -> str:
    whole, before = tokenizer().decode([*prompt, *output]), tokenizer().decode(list(prompt))
    assert whole.startswith(before)  # the prompt ends on a whole character
    return whole[len(before) :]


async def run(request: TextRequest, steps) -> tuple[list[TextDelta], TextFinished]:
    """The whole generation; checks its shape: deltas, then exactly one TextFinished, last."""
    *deltas, finish = [event async for event in generate_text(tokenizer().vocabulary, request, steps)]
    assert all(isinstance(d, TextDelta) for d in deltas) and isinstance(finish, TextFinished)
    return deltas, finish


def joined(deltas: list[TextDelta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids]


# -- the stream ---------------------------------------------------------------------------------


@pytest.mark.parametrize("per_step", [1, 2, 5])
async def test_deltas_join_to_the_reference_text_and_usage_counts_every_id(per_step):
    output = tokenizer().encode(" Grüße 😀 ok") + list(range(301, 311))  # characters split across ids
    decode = ScriptedDecode(script(output, per_step, Finished(LENGTH, Usage(len(PROMPT), len(output)))))
    deltas, finish = await run(TextRequest(PROMPT), decode.stream())
    assert joined(deltas) == (reference(PROMPT, output), output)
    assert finish == TextFinished(LENGTH, Usage(len(PROMPT), len(output)))
    assert decode.read == len(decode.steps) and not decode.cancelled
    if per_step == 1:  # a partial character is held: its ids go out with no text yet
        assert any(d.token_ids and not d.text for d in deltas)


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_ends_with_stop_counts_ids_up_to_it_and_cancels_the_decode(include):
    # " b if pionct...": "pionc" is completed by the 5th id, 305 ("ct"), in the third step (305, 306)
    decode = ScriptedDecode(script(list(range(301, 341)), 2, Finished(LENGTH, Usage(len(PROMPT), 40))))
    request = TextRequest(PROMPT, stop_strings=("zzz", "pionc"), include_stop_string=include)
    deltas, finish = await run(request, decode.stream())
    assert joined(deltas) == (" b if pionc" if include else " b if ", [301, 302, 303, 304, 305])
    assert finish == TextFinished(STOP, Usage(len(PROMPT), 5), stop_token_id=None, stop_string="pionc")
    assert decode.cancelled and decode.read == 3


async def test_the_decoders_stop_token_passes_through_and_held_text_is_released_at_the_end():
    # " b if": "if" might begin "ifx", so it is held until the decoder finishes
    decode = ScriptedDecode([tokens([301]), tokens([302]), [Finished(STOP, Usage(len(PROMPT), 2), stop_token_id=2)]])
    deltas, finish = await run(TextRequest(PROMPT, stop_strings=("ifx",)), decode.stream())
    assert deltas == [TextDelta(" b", (301,)), TextDelta(" ", (302,)), TextDelta("if", ())]
    assert finish == TextFinished(STOP, Usage(len(PROMPT), 2), stop_token_id=2, stop_string=None)


async def test_a_stop_string_in_the_decoders_last_step_wins_over_its_finish():
    last = [Token(304), Token(305), Finished(STOP, Usage(len(PROMPT), 5), stop_token_id=2)]
    decode = ScriptedDecode([tokens([301, 302, 303]), last])
    deltas, finish = await run(TextRequest(PROMPT, stop_strings=("pionc",)), decode.stream())
    assert joined(deltas) == (" b if ", [301, 302, 303, 304, 305])
    assert finish == TextFinished(STOP, Usage(len(PROMPT), 5), stop_token_id=None, stop_string="pionc")


async def test_a_stop_string_completed_by_the_final_flush_still_counts_every_id():
    # id 130 is the lead byte of "ü" alone: held while it may complete, U+FFFD once the stream ends
    decode = ScriptedDecode([[Token(130), Finished(LENGTH, Usage(len(PROMPT), 1))]])
    deltas, finish = await run(TextRequest(PROMPT, stop_strings=("\ufffd",), include_stop_string=True), decode.stream())
    assert joined(deltas) == ("\ufffd", [130])
    assert finish == TextFinished(STOP, Usage(len(PROMPT), 1), stop_string="\ufffd")


# -- the decoder breaking its contract, and leaving early -------------------------------------------


async def test_a_finish_that_miscounts_the_tokens_is_an_accounting_mismatch():
    decode = ScriptedDecode([tokens([301, 302]), [Token(303), Finished(LENGTH, Usage(len(PROMPT), 4))]])
    with pytest.raises(AccountingMismatch, match="it counted 4 tokens, 3 were received") as error:
        await run(TextRequest(PROMPT), decode.stream())
    assert (error.value.counted, error.value.received) == (4, 3) and isinstance(error.value, DecoderFault)


async def test_an_id_the_tokenizer_does_not_have_is_the_decoders_fault_not_the_callers():
    with pytest.raises(UnknownTokenId, match=r"token_ids\[1\]: 512 is not in the vocabulary \[0, 512\)") as error:
        await run(TextRequest(PROMPT), ScriptedDecode([tokens([301, 512])]).stream())
    assert isinstance(error.value, DecoderFault) and not isinstance(error.value, InvalidArgument)


async def test_an_upstream_that_ends_without_finished_raises_after_delivering_its_text():
    decode = ScriptedDecode([tokens([301]), tokens([302])])
    received = []
    with pytest.raises(StreamEndedWithoutFinished, match="without Finished"):
        async for event in generate_text(tokenizer().vocabulary, TextRequest(PROMPT), decode.stream()):
            received.append(event)
    assert received == [TextDelta(" b", (301,)), TextDelta(" if", (302,))]


async def test_leaving_early_closes_the_upstream():
    decode = ScriptedDecode([tokens([i]) for i in range(301, 340)])
    events = generate_text(tokenizer().vocabulary, TextRequest(PROMPT), decode.stream())
    async with contextlib.aclosing(events):
        first = await anext(events)
    assert first == TextDelta(" b", (301,))
    assert decode.cancelled and decode.read == 1


async def test_over_the_real_engine_loop_a_stop_string_frees_the_slot():
    # With no cap the request runs to the 256-token context: the prefill and 251 decode steps,
    # 5 s at 20 ms a step. "pionc" is complete at the 5th token (the 4th decode step); closing the
    # decode aborts the request, so the slot must be free within a few steps of that, counted by
    # the model: 20 steps (0.4 s) for the loop to read the steps and close, far fewer
    # than the 247 an abort that does nothing leaves the request running.
    step_s, freed_within, limit_s = 0.02, 4 + 20, 10.0
    model = ScriptedModel(
        vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=1, max_context_length=256, step_delay_s=step_s
    )
    engine = Engine(model)
    engine.start()
    try:
        decode = AsyncEngine(engine).stream(Request("r1", PROMPT, stopping=StoppingCriteria(ignore_eos=True)))
        deltas, finish = await asyncio.wait_for(run(TextRequest(PROMPT, stop_strings=("pionc",)), decode), limit_s)
        assert joined(deltas) == (" b if ", [301, 302, 303, 304, 305])
        assert finish == TextFinished(STOP, Usage(len(PROMPT), 5), stop_string="pionc")
        await steps_until_freed(lambda: engine.stats().slots_in_use or model.slots_held, lambda: model.decode_steps,
                                0, freed_within, limit_s)
    finally:
        engine.stop()


# -- the prompt ---------------------------------------------------------------------------------


def test_prompt_text_and_chat_become_the_tokenizers_ids():
    tok = tokenizer()
    assert prepare_request(tok, INFO, "hello") == TextRequest(tuple(tok.encode("hello")))
    conversation = (ChatMessage("user", "hi"),)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    request = prepare_request(tok, INFO, Chat(conversation), stop_strings=["a", "b"], keep_special_tokens=True)
    assert request == TextRequest(tuple(tok.encode(rendered)), ("a", "b"), False, True)
    without = prepare_request(tok, INFO, Chat(conversation, add_generation_prompt=False))
    assert without.prompt_token_ids == tuple(tok.encode("<|im_start|>user\nhi<|im_end|>\n"))


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ("", {}, "prompt: must not be empty (or give chat instead)"),
        (Chat(()), {}, "chat.messages: must not be empty"),
        (Chat((ChatMessage("user", "hi"), ChatMessage("", "x"))), {}, "chat.messages[1].role: must not be empty"),
        ("hello " * 16, {}, "prompt: 64 tokens leave no room for output in a context of 64"),
        ("hi", {"stop_strings": ["a"] * 17}, "stop_strings: at most 16 (got 17)"),
        ("hi", {"stop_strings": ["ok", ""]}, "stop_strings[1]: must be 1 to 256 characters"),
        ("hi", {"stop_strings": ["x" * 257]}, "stop_strings[0]: must be 1 to 256 characters"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(prompt, options, message):
    with pytest.raises(InvalidArgument) as error:
        prepare_request(tokenizer(), INFO, prompt, **options)
    assert str(error.value) == message and error.value.field == message.split(":")[0]


def test_prompt_ids_the_model_does_not_have_and_a_missing_template_are_refused():
    small = ModelInfo("small", vocab_size=100, max_context_length=64, max_batch_size=1, eos_token_ids=frozenset())
    with pytest.raises(InvalidArgument, match=r"^prompt\[0\]: 284 is not in the vocabulary \[0, 100\)$"):
        prepare_request(tokenizer(), small, "hello")
    with pytest.raises(InvalidArgument, match="^chat: this tokenizer has no chat template") as error:
        prepare_request(load_tokenizer("gpt2"), INFO, Chat((ChatMessage("user", "hi"),)))
    assert error.value.field == "chat"


def test_the_use_case_imports_no_transport_and_no_jax():
    code = (
        "import sys, tokenizer_svc, tokenizer_svc.generation; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google', 'protos', 'services', 'jax')"
        " or m.startswith('engine.jax_backend')))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
