"""Structured outputs through the OpenAI front: `response_format` json_object / json_schema held
token by token by the decoder, on the real stack (tests/support/openai_stack.py: the scripted
model, which takes its scripted id when the constraint allows it and the lowest allowed id when
not, with tiny-llama's real tokenizer) through the official `openai` SDK.

The scripted model is no language model, so whatever it writes under a constraint is valid only
because the decoder held it to the schema: every parse below would fail on its free output.
Strings and integers in the schemas are bounded (maxLength, minimum/maximum) so that its
outputs end within max_tokens; the one unbounded string shows the `length` cut. At the end, a
suite of 31 Pydantic models all parse, and the Pydantic types whose schemas the compiler refuses
get a 400 naming the keyword.
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from engine.constraints import Constraint, Vocabulary
from tests.support.openai_stack import MODEL_NAME, TINY, Stack
from tests.support.openai_stack import json_ask as ask
from tests.support.openai_stack import post_chat as post
from tests.support.openai_stack import sdk_client as client
from tests.support.schema_suite import SUITE, Digit, Person
from tokenizer_svc.tokenizer import TextTokenizer

TOKENIZER = TextTokenizer.from_dir(TINY)


@pytest.fixture(scope="module")
def stack():
    with Stack(constrained=True) as s:
        yield s


@pytest.fixture(scope="module")
def vocabulary():
    return Vocabulary.from_tokenizer_json(TINY / "tokenizer.json", 512, frozenset({0, 2}))


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


def test_stop_strings_and_max_tokens_with_a_schema(stack):
    """As docs/constraints.md says: a stop string is matched inside the JSON too and ends the
    content there with finish_reason "stop" (so parse() fails validation: the caller cut it); a
    stop string that never occurs changes nothing; a max_tokens cut is "length" whatever the stop
    strings."""
    sdk = client(stack)
    request = {"model": MODEL_NAME, "messages": ask("stop"), "response_format": Person, "max_tokens": 400}
    whole = sdk.chat.completions.parse(**request).choices[0]
    assert whole.finish_reason == "stop" and isinstance(whole.message.parsed, Person)
    never = sdk.chat.completions.parse(**request, stop=["zzz", "}}"]).choices[0]
    assert (never.message.content, never.message.parsed) == (whole.message.content, whole.message.parsed)
    raw = {**request, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": to_strict_json_schema(Person), "strict": True}}, "stop": ['"color"']}
    cut = sdk.chat.completions.create(**raw)
    content = whole.message.content
    assert (cut.choices[0].finish_reason, cut.choices[0].message.content) == ("stop", content[:content.index('"color"')])
    with pytest.raises(pydantic.ValidationError):
        sdk.chat.completions.parse(**request, stop=['"color"'])
    chunks = list(sdk.chat.completions.create(**raw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    with pytest.raises(openai.LengthFinishReasonError):
        sdk.chat.completions.parse(**{**request, "max_tokens": 9}, stop=["zzz"])
    assert sdk.chat.completions.create(**{**request, "max_tokens": 9, "response_format": {"type": "json_object"}},
                                       stop=["zzz"]).choices[0].finish_reason == "length"


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


# --- a suite of schemas (tests/support/schema_suite.py), and the Pydantic types refused ---------------


@pytest.mark.parametrize("model", SUITE, ids=[m.__name__ for m in SUITE])
def test_a_suite_of_pydantic_models_all_parse(stack, model):
    completion = client(stack).chat.completions.parse(model=MODEL_NAME, messages=ask(model.__name__), response_format=model, max_tokens=400)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed
    jsonschema.validate(json.loads(choice.message.content), to_strict_json_schema(model))  # the schema the SDK sent


def test_the_suite_is_at_least_thirty_distinct_schemas():
    assert len({json.dumps(to_strict_json_schema(m), sort_keys=True) for m in SUITE}) == len(SUITE) >= 30


class Unique(BaseModel):
    s: set[Digit]


class ByName(BaseModel):
    d: dict[Literal["a", "b"], Digit]


class Raw(BaseModel):
    b: bytes


class Where(BaseModel):
    p: pathlib.Path


class Lookaround(BaseModel):
    s: str = Field(json_schema_extra={"pattern": r"^(?=.*\d)[a-z0-9]{3,5}$"})


@pytest.mark.parametrize(
    "model, keyword",
    [(Unique, '"uniqueItems"'), (ByName, '"propertyNames"'), (Raw, '"format": "binary"'), (Where, '"format": "path"'),
     (Lookaround, "look-around")],
    ids=["set", "dict-by-literal", "bytes", "path", "look-around"],
)
def test_pydantic_types_the_compiler_refuses_are_400_naming_the_keyword(stack, model, keyword):
    prefills = stack.model.prefills
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack).chat.completions.parse(model=MODEL_NAME, messages=ask("x"), response_format=model)
    error = refused.value.body
    assert error["param"] == "response_format.json_schema.schema" and keyword in error["message"], error
    assert stack.model.prefills == prefills
