"""Tool calling through the OpenAI front: `tools`, `tool_choice`, `parallel_tool_calls`, tool
turns, calls read back (services.openai_api.tools, .tool_formats), on the real stack
(tests/support/openai_stack.py: the scripted model, which takes its scripted id when the
constraint allows it and the lowest allowed id when not, with tiny-llama's real tokenizer) through
the official `openai` SDK; then each family's format without a stack: its forced-call grammar
walked with the same policy, and its calls streamed and collected from text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

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
