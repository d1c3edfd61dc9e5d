"""Structured outputs through the OpenAI front: `response_format` json_object / json_schema held
token by token by the decoder, on the real stack (tests/support/openai_stack.py: the scripted
model, which takes its scripted id when the constraint allows it and the lowest allowed id when
not, with tiny-llama's real tokenizer) through the official `openai` SDK.

The scripted model is no language model, so whatever it writes under a constraint is valid only
because the decoder held it to the schema: every parse below would fail on its free output.
Strings and integers in the schemas are bounded (maxLength, minimum/maximum) so that its
outputs end within max_tokens; the one unbounded string shows the `length` cut.
"""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Literal, Optional

import httpx2 as httpx
import openai
import pytest
from pydantic import BaseModel, Field

from engine.constraints import Constraint, Vocabulary
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from services.openai_api import completions, tools
from services.openai_api.metrics import ApiMetrics
from services.openai_api.streaming import DONE
from services.openai_api.tool_formats import FORMATS, Call
from tests.support.openai_stack import MODEL_NAME, TINY, Stack
from tokenizer_svc.tokenizer import TextTokenizer

TOKENIZER = TextTokenizer.from_dir(TINY)


@pytest.fixture(scope="module")
def stack():
    with Stack(constrained=True) as s:
        yield s


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url, api_key="unused", _strict_response_validation=True, timeout=30)


def ask(text: str) -> list[dict]:
    return [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": text}]


def post(stack: Stack, body: dict) -> httpx.Response:
    return httpx.post(stack.url + "/chat/completions", json=body, timeout=30)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip: int = Field(ge=0, le=99)


class Person(BaseModel):
    """Nested objects, an enum (through $defs/$ref), arrays with minItems, an optional field."""

    name: str = Field(max_length=8)
    color: Color
    tags: list[Literal["a", "b"]] = Field(min_length=2, max_length=3)
    home: Address
    nickname: Optional[str] = Field(default=None, max_length=4)  # noqa: UP045 (what users write)
    previous: list[Address] = Field(min_length=1, max_length=2)
    active: bool


class Free(BaseModel):
    note: str  # unbounded: the scripted model's string runs until max_tokens


@pytest.mark.parametrize("prompt", ["hello", "tell me about a person", "x" * 30])
def test_parse_returns_the_pydantic_model(stack, prompt):
    completion = client(stack).chat.completions.parse(model=MODEL_NAME, messages=ask(prompt), response_format=Person, max_tokens=400)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    assert len(choice.message.parsed.tags) >= 2 and len(choice.message.parsed.previous) >= 1


def test_every_choice_and_the_stream_are_held_to_the_schema(stack):
    sdk = client(stack)
    completion = sdk.chat.completions.parse(model=MODEL_NAME, messages=ask("two"), response_format=Person, n=2, max_tokens=400)
    assert [c.finish_reason for c in completion.choices] == ["stop", "stop"]
    assert all(isinstance(c.message.parsed, Person) for c in completion.choices)
    with sdk.chat.completions.stream(model=MODEL_NAME, messages=ask("two"), response_format=Person, max_tokens=400) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == completion.choices[0].message.parsed  # greedy-free scripted: same text


def test_json_object_is_held_to_a_json_object(stack, vocabulary):
    """The scripted model never closes an unbounded key (its lowest allowed id after a backslash
    is a quote: an escape), so the answer is cut; every token of it was one a JSON object allows."""
    completion = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("anything"), response_format={"type": "json_object"}, max_tokens=40, logprobs=True
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"'), choice
    matcher = vocabulary.compile(Constraint("json_object")).matcher()
    for entry in choice.logprobs.content:
        [token] = TOKENIZER.encode(entry.token)
        assert not matcher.banned()[token], entry.token
        matcher.advance(token)


def test_a_raw_schema_with_an_optional_property_and_no_strict(stack):
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "label": {"type": "string", "maxLength": 3},
            "kind": {"enum": ["x", "y"]},
        },
        "required": ["id", "kind"],
    }
    completion = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("raw"), max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "raw", "schema": schema}},
    )
    value = json.loads(completion.choices[0].message.content)
    assert set(value) <= {"id", "label", "kind"} and {"id", "kind"} <= set(value)  # closed: no other key
    assert 1 <= value["id"] <= 9 and value["kind"] in ("x", "y")


def test_without_response_format_the_same_prompt_is_free_text(stack):
    """The control: the scripted model's own output is no JSON, so the tests above show the constraint."""
    text = client(stack).chat.completions.create(model=MODEL_NAME, messages=ask("hello"), max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)


def test_max_tokens_cutting_the_json_is_length_never_stop(stack):
    sdk = client(stack)
    with pytest.raises(openai.LengthFinishReasonError):
        sdk.chat.completions.parse(model=MODEL_NAME, messages=ask("cut"), response_format=Free, max_tokens=6)
    cut = sdk.chat.completions.create(
        model=MODEL_NAME, messages=ask("cut"), max_tokens=12, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "free", "schema": Free.model_json_schema(), "strict": True}},
    )
    chunks = list(cut)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasons == ["length"] and text.startswith('{"note":"')
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize(
    "response_format, param",
    [
        ("json", "response_format"),
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {"type": "object"}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
    ],
)
def test_a_malformed_response_format_is_400_naming_the_field(stack, response_format, param):
    prefills = stack.model.prefills
    answer = post(stack, {"model": MODEL_NAME, "messages": ask("x"), "response_format": response_format})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert stack.model.prefills == prefills  # nothing reached the decoder


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}, "format"),
        ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "x-guidance"),
    ],
)
def test_a_schema_the_compiler_refuses_is_400_naming_the_keyword_and_never_decoded(stack, schema, keyword):
    prefills = stack.model.prefills
    answer = post(stack, {
        "model": MODEL_NAME, "messages": ask("x"), "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}},
    })
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"].startswith("response_format.json_schema.schema:") and keyword in error["message"], error
    assert stack.model.prefills == prefills


# --- tools ------------------------------------------------------------------------------------


class Add(BaseModel):
    """Add two small numbers."""

    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=5)
    unit: Literal["c", "f"]


TOOLS = [openai.pydantic_function_tool(Add, name="add"), openai.pydantic_function_tool(Weather, name="weather")]


def test_the_tool_format_is_detected_from_the_tokenizer(stack):
    """tiny-llama's tokenizer has neither <tool_call> nor <|python_tag|> as one token: SmolLM2's format."""
    cut = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=ask("add"), tools=TOOLS, tool_choice="required", max_tokens=20
    )
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.startswith("<tool_call>[{")  # a cut call stays text


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


# --- each family's format, without a stack ----------------------------------------------------


def _events(pieces: list[str]):
    """A text-service stream of one choice: the pieces as deltas, then STOP."""

    async def gen():
        for piece in pieces:
            yield 0, text_pb2.GenerateResponse(delta=text_pb2.TextDelta(text=piece, token_ids=[5]))
        finished = text_pb2.TextFinished(reason=decode_pb2.FINISH_REASON_STOP)
        yield 0, text_pb2.GenerateResponse(finished=finished)

    return gen()


def _sse(events: list[bytes]) -> list[dict]:
    return [json.loads(e[len(b"data: "):]) for e in events if e != DONE]


def _plan(**kwargs) -> tools.ToolPlan:
    plan = tools.plan_of(TOOLS, kwargs.pop("tool_choice", "auto"), kwargs.pop("parallel_tool_calls", None))
    assert plan is not None
    return plan


@pytest.mark.parametrize("fmt", ["qwen", "smollm2"])
def test_several_streamed_calls_each_get_their_index(fmt):
    """Two calls written by the model (in pieces that split the opener) stream as two calls."""
    f = FORMATS[fmt]
    text = f.render([Call("add", '{"a": 1, "b": 2}'), Call("weather", '{"city": "Oslo", "unit": "c"}')])
    pieces = [" ", text[:3], text[3:20], text[20:]]
    header = completions.Header("chatcmpl-x", 0, MODEL_NAME)

    async def run():
        stream = completions.chunks(completions.CHAT, header, 1, _events(pieces), ApiMetrics(), False, False, completions.Calls(_plan(), f))
        return [e async for e in stream]

    chunks = _sse(asyncio.run(run()))
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert [("id" in d, "name" in d["function"]) for d in deltas] == [(True, True), (False, False)] * 2
    assert [json.loads(deltas[i]["function"]["arguments"] + deltas[i + 1]["function"]["arguments"]) for i in (0, 2)] == [
        {"a": 1, "b": 2}, {"city": "Oslo", "unit": "c"}]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_auto_answer_that_calls_is_collected_as_tool_calls(fmt):
    f = FORMATS[fmt]
    made = [Call("add", '{"a": 1, "b": 2}'), Call("weather", '{"city": "Oslo", "unit": "c"}')][: 2 if f.parallel else 1]
    header = completions.Header("chatcmpl-x", 0, MODEL_NAME)

    async def run(text: str):
        calls = completions.Calls(_plan(), f)
        return await completions.collect(completions.CHAT, header, 1, _events([text]), ApiMetrics(), False, calls)

    message = asyncio.run(run(f.render(made)))["choices"][0]
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["message"]["tool_calls"]] == [
        (c.name, json.loads(c.arguments)) for c in made]
    assert len({c["id"] for c in message["message"]["tool_calls"]}) == len(made)
    text = asyncio.run(run("Sure: " + f.render(made)))["choices"][0]  # calls only at the start of an answer
    assert text["finish_reason"] == "stop" and "tool_calls" not in text["message"]


def test_text_that_only_began_like_a_call_is_sent_as_text():
    f = FORMATS["qwen"]
    header = completions.Header("chatcmpl-x", 0, MODEL_NAME)

    async def run(pieces):
        stream = completions.chunks(completions.CHAT, header, 1, _events(pieces), ApiMetrics(), False, False, completions.Calls(_plan(), f))
        return _sse([e async for e in stream])

    chunks = asyncio.run(run(["<tool", "bar> is a tag", " and more"]))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
    assert contents == ["<toolbar> is a tag", " and more"]  # held while it could open a call, then sent
    chunks = asyncio.run(run(['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>']))  # no such tool: text
    assert chunks[-2]["choices"][0]["delta"]["content"].startswith("<tool_call>") and chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def vocabulary():
    return Vocabulary.from_tokenizer_json(TINY / "tokenizer.json", 512, frozenset({0, 2}))


def _walk(vocabulary, lark: str, start: int) -> str:
    """The scripted model's policy under the grammar: id+1 where allowed, else the lowest allowed."""
    matcher = vocabulary.compile(Constraint("lark", lark)).matcher()
    out, token = [], start
    for _ in range(400):
        allowed = ~matcher.banned()  # [V]
        token = token + 1 if token + 1 < 512 and allowed[token + 1] else int(allowed.argmax())
        if token in (0, 2):
            break
        matcher.advance(token)
        out.append(token)
        if matcher.complete():
            break
    return TOKENIZER.decode(out)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("forced", ["", "weather"])
def test_each_format_s_grammar_only_writes_calls_it_reads_back(vocabulary, fmt, forced):
    f = FORMATS[fmt]
    plan = _plan(tool_choice="required" if not forced else {"type": "function", "function": {"name": forced}}, parallel_tool_calls=False)
    lark = tools.constraint_of(plan, f).lark
    for start in (7, 60, 300):
        text = _walk(vocabulary, lark, start)
        made = f.calls(text, plan.names)
        assert made is not None and len(made) == 1, (fmt, text)
        assert not forced or made[0].name == forced
        {"add": Add, "weather": Weather}[made[0].name].model_validate_json(made[0].arguments)
