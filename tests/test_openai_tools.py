"""Tool calling through the OpenAI front: `tools`, `tool_choice`, `parallel_tool_calls`, tool
turns, calls read back (services.openai_api.tools, .tool_formats), on the real stack
(tests/support/openai_stack.py: the scripted model, which takes its scripted id when the
constraint allows it and the lowest allowed id when not, with tiny-llama's real tokenizer) through
the official `openai` SDK. Its ChatML template writes no tool calls, so the front uses its
fallback format, SmolLM2's; one test swaps in Qwen2.5's template to get Qwen's. Each family's
format without a stack is in tests/test_openai_tool_formats.py.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.chat_templates import QWEN25, tiny_with_template
from tests.support.openai_stack import MODEL_NAME, Stack
from tests.support.openai_stack import json_ask as ask
from tests.support.openai_stack import post_chat as post
from tests.support.openai_stack import sdk_client as client
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def stack():
    with Stack(constrained=True, max_context_length=2048) as s:  # four tools' descriptions take 1,500 tokens
        yield s


class Add(BaseModel):
    """Add two small numbers."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=5)
    unit: Literal["c", "f"]


TOOLS = [openai.pydantic_function_tool(Add, name="add"), openai.pydantic_function_tool(Weather, name="weather")]


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}[0-9]$")
    count: int = Field(ge=1, le=5)


class Order(BaseModel):
    """Order items: a nested object, an array with minItems, an enum and an optional field."""

    items: list[Item] = Field(min_length=1, max_length=2)
    speed: Literal["slow", "fast"]
    note: str | None = Field(max_length=4)


class Ping(BaseModel):
    """No arguments."""


MODELS = {"add": Add, "weather": Weather, "order": Order, "ping": Ping}
TOOL_SETS = {
    "add+weather": TOOLS,
    "four": [openai.pydantic_function_tool(m, name=n) for n, m in MODELS.items()],
    "order": [openai.pydantic_function_tool(Order, name="order")],
}
# each tool set with "required" and each of its tools named
FORCED = [(k, "required") for k in TOOL_SETS] + [
    (k, {"type": "function", "function": {"name": t["function"]["name"]}}) for k, ts in TOOL_SETS.items() for t in ts
]
FORCED_IDS = [f"{k}-{c if isinstance(c, str) else c['function']['name']}" for k, c in FORCED]


def assert_allowed_and_valid(name: str, arguments: str, tool_set: list[dict], choice) -> None:
    """A call to one of the offered tools (the named one, if named), its arguments valid against
    the schema the request sent and against the Pydantic model."""
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in tool_set}
    assert name in offered, name
    assert choice == "required" or name == choice["function"]["name"]
    jsonschema.validate(json.loads(arguments), offered[name])
    MODELS[name].model_validate_json(arguments)


def test_a_template_without_a_tool_section_gets_smollm2_s_format(stack):
    """tiny-llama's ChatML template writes no tool calls: the front falls back to SmolLM2's format."""
    cut = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("add"), tools=TOOLS, tool_choice="required", max_tokens=20
    )
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("<tool_call>[{")  # a cut call stays text


def test_a_forced_call_on_qwen_s_template_comes_out_in_qwen_s_format(tmp_path):
    """tiny-llama's tokenizer with Qwen2.5's chat template: the text service reads Qwen's format
    from it, the template shows the tools in its own words, and a forced call is Qwen's block."""
    model_dir = tiny_with_template(QWEN25, tmp_path)
    request = {"model": MODEL_NAME, "messages": ask("call"), "tools": TOOLS, "tool_choice": "required"}
    with Stack(constrained=True, tokenizer_dir=model_dir, max_context_length=2048) as qwen:
        cut = client(qwen).chat.completions.create(**request, max_tokens=20).choices[0]
        whole = client(qwen).chat.completions.create(**request, parallel_tool_calls=False, max_tokens=200)
    assert cut.finish_reason == "length" and cut.message.content.startswith('<tool_call>\n{"name":"'), cut
    assert whole.choices[0].finish_reason == "tool_calls"
    [call] = whole.choices[0].message.tool_calls
    assert_allowed_and_valid(call.function.name, call.function.arguments, TOOLS, "required")
    shown = [{"type": "function", "function": {k: t["function"][k] for k in ("name", "description", "parameters")}} for t in TOOLS]
    conversation = [ChatMessage(m["role"], m["content"]) for m in ask("call")]
    prompt = TextTokenizer.from_dir(model_dir).encode_chat(conversation, tools=shown)  # Qwen's "# Tools" section
    assert whole.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "function": {"name": "weather"}}, "weather")])
def test_a_forced_call_is_a_call_whose_arguments_match_the_schema(stack, choice, name):
    completion = client(stack).chat.completions.parse(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=200
    )
    choice0 = completion.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    [call] = choice0.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert name is None or call.function.name == name
    model = {"add": Add, "weather": Weather}[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)
    assert model.model_validate_json(call.function.arguments) == call.function.parsed_arguments


@pytest.mark.parametrize("tool_set, choice", FORCED, ids=FORCED_IDS)
def test_every_forced_call_is_an_allowed_tool_with_valid_arguments(stack, tool_set, choice):
    """Over tool sets, "required" and each tool named, sampled at temperature 1 with several seeds.
    (The scripted model ignores sampling parameters: the spread of samples a real model would
    draw is covered by the seeded temperature-1 walks of each format's grammar in
    tests/test_openai_tool_formats.py.)"""
    for seed in (1, 2, 3):
        completion = client(stack).chat.completions.create(
            model=MODEL_NAME, messages=ask(f"call {seed}"), tools=TOOL_SETS[tool_set], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=200, temperature=1, seed=seed,
        )
        message = completion.choices[0]
        assert message.finish_reason == "tool_calls" and message.message.content is None, message
        [call] = message.message.tool_calls
        assert_allowed_and_valid(call.function.name, call.function.arguments, TOOL_SETS[tool_set], choice)


def _reassembled(stack: Stack, request: dict) -> None:
    """The streamed deltas, joined per index, are exactly the non-streamed calls (names and
    arguments, in order), with the same finish reason."""
    collected = client(stack).chat.completions.create(**request).choices[0]
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in client(stack).chat.completions.create(**request, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, arguments = calls.setdefault(delta.index, ["", ""])
            calls[delta.index] = [name + (delta.function.name or ""), arguments + (delta.function.arguments or "")]
        reasons += [chunk.choices[0].finish_reason] if chunk.choices and chunk.choices[0].finish_reason else []
    assert reasons == [collected.finish_reason] == ["tool_calls"]
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments] for c in collected.message.tool_calls]
    assert sorted(calls) == list(range(len(calls)))


def _request(tool_set: str, choice) -> dict:
    return {
        "model": MODEL_NAME, "messages": ask("call"), "tools": TOOL_SETS[tool_set], "tool_choice": choice,
        "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0,
    }


@pytest.mark.parametrize("tool_set, choice", FORCED, ids=FORCED_IDS)
def test_streamed_calls_reassemble_to_exactly_the_collected_ones(stack, tool_set, choice):
    _reassembled(stack, _request(tool_set, choice))


@pytest.mark.parametrize("fmt", ["qwen", "llama3"])
def test_streamed_calls_reassemble_in_the_other_formats_too(fmt):
    """The same through a front told to use Qwen's or Llama 3's format (the detected one is SmolLM2's)."""
    with Stack(constrained=True, tool_format=fmt, max_context_length=2048) as other:
        for choice in ("required", {"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "weather"}}):
            _reassembled(other, _request("add+weather", choice))


def test_parallel_calls_are_allowed_unless_turned_off(stack):
    """The scripted model always takes the lowest allowed id, which after a call in SmolLM2's list
    is ',' (another call): with parallel calls allowed it calls until max_tokens."""
    many = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS[:1], tool_choice="required", max_tokens=120
    )
    assert many.choices[0].finish_reason == "length"
    assert many.choices[0].message.content.count('"name":"add"') >= 2


def test_streamed_tool_calls_have_id_and_name_in_their_first_delta_only(stack):
    chunks = list(client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, max_tokens=200, stream=True,
    ))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 0]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].function.name == "add"
    assert deltas[1].id is None and deltas[1].function.name is None
    Add.model_validate_json(deltas[0].function.arguments + deltas[1].function.arguments)
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)  # no content: the call was held back
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    collected = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, max_tokens=200, logprobs=True,
    )
    streamed = list(client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False, max_tokens=200, logprobs=True, stream=True,
    ))
    entries = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert entries == [e.token for e in collected.choices[0].logprobs.content] and entries  # the held tokens' logprobs, once
    with client(stack).chat.completions.stream(
        model=MODEL_NAME, messages=ask("call"), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, (Add, Weather))


def test_a_stop_string_that_cuts_a_forced_call_leaves_text(stack):
    """As docs/constraints.md says: the stop string is matched inside the call too; what is left
    is no whole call (here even a whole call's closing tag is cut), so it is content, "stop"."""
    request = {"model": MODEL_NAME, "messages": ask("call"), "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, "max_tokens": 200}
    whole = client(stack).chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    for stop in ('"b"', "</tool_call>"):
        cut = client(stack).chat.completions.create(**request, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.tool_calls is None, cut
        assert cut.message.content.startswith("<tool_call>[{") and stop not in cut.message.content
    never = client(stack).chat.completions.create(**request, stop=["zzz"]).choices[0]
    assert never.finish_reason == "tool_calls" and never.message.tool_calls[0].function == whole.message.tool_calls[0].function


def test_auto_may_answer_in_text(stack):
    sdk = client(stack)
    answer = sdk.chat.completions.create(model=MODEL_NAME, messages=ask("hello"), tools=TOOLS, max_tokens=20)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
    chunks = list(sdk.chat.completions.create(model=MODEL_NAME, messages=ask("hello"), tools=TOOLS, max_tokens=20, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    none = sdk.chat.completions.create(model=MODEL_NAME, messages=ask("hello"), tools=TOOLS, tool_choice="none", max_tokens=20)
    assert none.usage.prompt_tokens < answer.usage.prompt_tokens  # "none" does not show the tools


def test_earlier_calls_and_tool_results_are_written_in_the_format(stack):
    """The prompt the conversation becomes is the one written by hand in SmolLM2's format."""
    arguments = '{"a": 1, "b": 2}'
    history = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    completion = client(stack).chat.completions.create(model=MODEL_NAME, messages=history, tool_choice="none", tools=TOOLS, max_tokens=1)
    by_hand = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>'},
        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"},
    ]
    tokens = httpx.post(stack.root + "/tokenize", json={"messages": by_hand}, timeout=30).json()["tokens"]
    assert completion.usage.prompt_tokens == len(tokens)
    assert httpx.post(stack.root + "/tokenize", json={"messages": history}, timeout=30).json()["tokens"] == tokens


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x-guidance": {}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}],
          "tool_choice": "required"}, "tools"),  # refused by the text service, compiling the forced call's grammar
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(stack, fields, param):
    prefills = stack.model.prefills
    answer = post(stack, {"model": MODEL_NAME, "messages": ask("x"), **fields})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()
    assert stack.model.prefills == prefills
