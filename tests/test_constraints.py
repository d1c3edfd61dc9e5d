"""engine/constraints: constraints compiled by llguidance against real tokenizers, walked token by
token through the banned rows, and the output decoded by the real tokenizer and validated.

The walks choose at random (seeded) among the allowed ids, preferring ids that close something
(a quote, a bracket, a brace, or the @ of an email) half the time so that strings and arrays end within a few hundred
tokens. Validity never depends on the choice: every path the mask allows must give valid output.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.constraints import Constraint, ConstraintError, Matcher, Vocabulary, lark_term
from engine.constraints import schema as schema_prep
from engine.model_store.model_files import eos_token_ids

ASSETS = Path(__file__).parent / "assets"
TINY = ASSETS / "tiny-llama" / "tokenizer.json"
EOS = frozenset({0, 2})  # <|endoftext|>, <|im_end|>
HEAD = 520  # a model head larger than the tokenizer's 512 ids, as padded heads are


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.from_tokenizer_json(TINY, HEAD, EOS)


@pytest.fixture(scope="module")
def hf() -> Tokenizer:
    return Tokenizer.from_file(str(TINY))


def walk(grammar, tokenizer: Tokenizer, seed: int, max_tokens: int = 400) -> tuple[str, Matcher]:
    """Sample a path through `grammar`; returns the decoded text and the matcher where it ended."""
    rng = np.random.default_rng(seed)
    closes = _closing_ids(tokenizer)
    m = grammar.matcher()
    ids: list[int] = []
    for _ in range(max_tokens):
        if m.complete():
            break
        banned = m.banned()  # [V]
        assert banned.shape == (HEAD,) and banned[512:].all()
        allowed = [int(i) for i in np.flatnonzero(~banned) if int(i) not in EOS]
        eos_allowed = not banned[list(EOS)].any()
        assert eos_allowed == m.accepting()
        if m.accepting() and (not allowed or rng.random() < 0.3):
            break  # a language with no end of its own (a number, a regex with +): stop at EOS
        assert allowed, f"a dead end after {tokenizer.decode(ids, skip_special_tokens=False)!r}"
        closing = [i for i in allowed if i in closes]
        pool = closing if closing and rng.random() < 0.5 else allowed
        token = int(rng.choice(pool))
        m.advance(token)
        ids.append(token)
    if m.complete():
        banned = m.banned()
        assert set(np.flatnonzero(~banned)) == set(EOS), "a complete output allows only EOS"
    return tokenizer.decode(ids, skip_special_tokens=False), m


_CLOSING: dict[int, set[int]] = {}


def _closing_ids(tokenizer: Tokenizer) -> set[int]:
    key = id(tokenizer)
    if key not in _CLOSING:
        _CLOSING[key] = {
            i for i in range(tokenizer.get_vocab_size())
            if any(c in tokenizer.decode([i], skip_special_tokens=False) for c in '"]}@')
        }
    return _CLOSING[key]


OBJ = {"type": "object"}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}}, "required": ["xs"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "string"}}, "required": ["a"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}, "required": ["inner"]},
    {"type": "object", "properties": {"l1": {"type": "object", "properties": {"l2": {"type": "object", "properties": {"l3": {"type": "string", "maxLength": 3}}, "required": ["l3"]}}, "required": ["l2"]}}, "required": ["l1"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}, "required": ["from", "to"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}}, "required": ["id"]},
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["p"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}, "required": ["n"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}, "n": {"const": 3}}, "required": ["k", "n"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer"}], "items": False}}, "required": ["pair"]},
    {"type": "object", "properties": {"grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["grid"]},
    {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}, "minItems": 1}}, "required": ["people"]},
    {"type": "object", "properties": {"meta": OBJ}, "required": ["meta"]},
    {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}}}, "required": ["m"]},
    {"type": "object", "properties": {"a": {"type": ["string", "null"], "maxLength": 3}}, "required": ["a"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}, "required": ["e"]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 3},
    {"type": "array", "items": {"enum": [1, "two", None, True]}, "minItems": 1, "maxItems": 4},
    {"type": "string", "maxLength": 10},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "done": {"type": "boolean"}, "prio": {"enum": [1, 2, 3]},
                                      "sub": {"type": "array", "items": {"$ref": "#/$defs/step"}, "maxItems": 2}},
     "required": ["title", "done", "prio", "sub"], "$defs": {"step": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}}},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_every_walk_through_a_schema_is_valid_json_of_it(vocab, hf, schema):
    grammar = vocab.compile(Constraint("json_schema", json.dumps(schema)))
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for seed in range(3):
        text, m = walk(grammar, hf, seed)
        assert m.accepting(), f"seed {seed}: the walk did not finish: {text!r}"
        # an object, array or string ends with its closing bracket or quote: nothing may follow
        assert m.complete() or text[0] not in '{["', text
        value = json.loads(text)
        validator.validate(value)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), f"whitespace outside strings: {text!r}"


def test_objects_listing_properties_are_closed(vocab, hf):
    """No additionalProperties said: the output has only the listed keys (closed as OpenAI's strict
    mode does); a schema that opens the object explicitly keeps it open."""
    closed = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    grammar = vocab.compile(Constraint("json_schema", json.dumps(closed)))
    for seed in range(20):
        text, m = walk(grammar, hf, seed)
        assert set(json.loads(text)) <= {"a", "b"}, text
    prepared = schema_prep.prepare(json.dumps({**closed, "properties": {"a": closed}, "$defs": {"d": closed}}))
    assert prepared["additionalProperties"] is False
    assert prepared["properties"]["a"]["additionalProperties"] is False
    assert prepared["$defs"]["d"]["additionalProperties"] is False
    opened = schema_prep.prepare(json.dumps({**closed, "additionalProperties": True}))
    assert opened["additionalProperties"] is True
    parts = schema_prep.prepare(json.dumps({"allOf": [{"$ref": "#/$defs/base"}, closed], "$defs": {"base": closed}}))
    assert "additionalProperties" not in parts["allOf"][1] and "additionalProperties" not in parts["$defs"]["base"]


def test_json_object_gives_any_object(vocab, hf):
    grammar = vocab.compile(Constraint("json_object"))
    for seed in range(10):
        text, m = walk(grammar, hf, seed)
        assert m.accepting() and isinstance(json.loads(text), dict), text
    with pytest.raises(ConstraintError, match=r"^constraint\.json_object: takes no text"):
        vocab.compile(Constraint("json_object", "{}"))


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)", r"[A-Z][a-z]+( [A-Z][a-z]+)?", r"\d+\.\d\d", r"\w{3}/\w{2}"])
def test_regex_walks_match_the_whole_output(vocab, hf, regex):
    grammar = vocab.compile(Constraint("regex", regex))
    for seed in range(5):
        text, m = walk(grammar, hf, seed)
        assert m.accepting() and re.fullmatch(regex, text), (seed, text)


def test_lark_walks_parse(vocab, hf):
    lark = r'''
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
'''
    grammar = vocab.compile(Constraint("lark", lark))
    for seed in range(8):
        text, m = walk(grammar, hf, seed)
        assert m.accepting() and re.fullmatch(r"[0-9()+\-]+", text), text
        assert text.count("(") == text.count(")")
        eval(compile(text, "<walk>", "eval"))  # a well-formed arithmetic expression


def test_lark_embeds_a_schema_with_the_json_schema_defaults(vocab, hf):
    """A tool-call-like format: tags around a JSON object held to the schema, compact and closed."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city"]}
    lark = f'start: "<call>" args "</call>"\nargs: {lark_term(json.dumps(schema))}\n'
    grammar = vocab.compile(Constraint("lark", lark))
    for seed in range(8):
        text, m = walk(grammar, hf, seed)
        assert m.accepting() and text.startswith("<call>{") and text.endswith("}</call>"), text
        args = text.removeprefix("<call>").removesuffix("</call>")
        jsonschema.validate(json.loads(args), {**schema, "additionalProperties": False})
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", args)), args
    with pytest.raises(ConstraintError, match=r"^constraint\.json_schema: not valid JSON"):
        lark_term("{")


@pytest.mark.parametrize(("kind", "text", "reason"), [
    ("json_schema", '{"type": "object", "not": {}}', r'unsupported keyword "not"'),
    ("json_schema", '{"type": "object", "if": {}, "then": {}}', r'unsupported keywords "if", "then"'),
    ("json_schema", '{"type": "array", "uniqueItems": true}', r'unsupported keyword "uniqueItems"'),
    ("json_schema", '{"type": "string", "format": "colour"}', r'unsupported "format": "colour"'),
    ("json_schema", '{"type": "strin"}', r"Invalid type: strin"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', r'"\$ref": .*/\$defs/missing'),
    ("json_schema", '{"$ref": "https://example.com/s.json"}', r'"\$ref": .*example\.com'),
    ("json_schema", '{"type": "string", "pattern": "a(b"}', r'^a regular expression in the schema "a\(b": unclosed group at position 1$'),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}', r"[Uu]nsatisfiable"),
    ("json_schema", '{"type": "object",', r"not valid JSON: .*line 1, column 19"),
    ("json_schema", "[1, 2]", r"must be a JSON object, not list"),
    ("json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": true}}', r'unsupported keyword "x-guidance"'),
    ("json_schema", "  ", r"is empty"),
    ("regex", "a(b", r"^unclosed group at position 1$"),
    ("regex", "", r"is empty"),
    ("regex", r"\d(", r'^the regular expression "\[0-9\]\(": unclosed group at position 5$'),
    ("lark", 'start: foo\nfoo: "a" bar', r'^line 2, column 6: unknown name: "bar"'),
    ("lark", 'start: ("a"', r"^line 1, column \d+: "),
])
def test_a_constraint_that_cannot_compile_is_named(vocab, kind, text, reason):
    with pytest.raises(ConstraintError) as info:
        vocab.compile(Constraint(kind, text))
    e = info.value
    assert e.field == f"constraint.{kind}"
    assert re.search(reason, e.reason), e.reason
    assert str(e) == f"{e.field}: {e.reason}" and "\n" not in str(e)


def test_an_unknown_kind_is_refused_on_construction():
    with pytest.raises(ConstraintError, match=r"^constraint: unknown kind 'yaml'"):
        Constraint("yaml", "a: 1")


def test_eos_only_where_the_language_accepts(vocab, hf):
    m = vocab.compile(Constraint("regex", "ab|abc")).matcher()
    for token in hf.encode("ab").ids:
        assert m.banned()[list(EOS)].all()
        m.advance(token)
    assert m.accepting() and not m.complete()  # "ab" is a sentence, "abc" may still come
    assert not m.banned()[list(EOS)].any()
    m.advance(hf.token_to_id("c"))
    assert m.complete()
    assert set(np.flatnonzero(~m.banned())) == set(EOS)


def test_a_refused_token_fails_the_matcher_naming_the_field(vocab, hf):
    grammar = vocab.compile(Constraint("json_schema", '{"type": "object"}'))
    m = grammar.matcher()
    with pytest.raises(ConstraintError, match=r"^constraint\.json_schema: token id 5 is not allowed here"):
        m.advance(5)  # "#" where only "{" may start
    with pytest.raises(ConstraintError, match=r"^constraint\.json_schema: "):
        m.banned()  # a failed state is never sampled from
    with pytest.raises(ConstraintError, match=r"token id 520 is outside the vocabulary"):
        grammar.matcher().advance(HEAD)


def test_compiles_are_cached_and_matchers_independent(vocab, hf):
    c = Constraint("regex", "[a-z]{4}")
    grammar = vocab.compile(c)
    assert vocab.compile(Constraint("regex", "[a-z]{4}")) is grammar
    first, second = grammar.matcher(), grammar.matcher()
    first.advance(hf.token_to_id("a"))
    assert not np.array_equal(first.banned(), second.banned())
    assert np.array_equal(second.banned(), grammar.matcher().banned())


_CHILD = """
import json, pickle, sys
import numpy as np
grammar, ids = pickle.load(sys.stdin.buffer)
m = grammar.matcher()
rows = []
for token in ids:
    rows.append(np.flatnonzero(~m.banned()).tolist())
    m.advance(token)
print(json.dumps({"rows": rows, "complete": m.complete()}))
"""


def test_a_grammar_crosses_to_a_spawned_process(vocab, hf):
    """engine_process pickles each Request to its child: the grammar is rebuilt there from its
    vocabulary's tokenizer file and gives the same rows."""
    grammar = vocab.compile(Constraint("json_schema", json.dumps(SCHEMAS[1])))
    ids = hf.encode('{"name":"ab","age":7}').ids
    m, rows = grammar.matcher(), []
    for token in ids:
        rows.append(np.flatnonzero(~m.banned()).tolist())
        m.advance(token)
    assert m.complete()
    child = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps((grammar, ids)), capture_output=True,
                           cwd=Path(__file__).parents[1], timeout=60, check=True)
    assert json.loads(child.stdout) == {"rows": rows, "complete": True}
    again = pickle.loads(pickle.dumps(grammar))  # in this process: the same vocabulary, from the cache
    assert np.array_equal(again.matcher().banned(), grammar.matcher().banned())
    unpicklable = Vocabulary(vocab._tokenizer, HEAD).compile(Constraint("regex", "a"))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(unpicklable)


def test_a_head_smaller_than_the_tokenizer_bans_nothing_past_itself():
    small = Vocabulary.from_tokenizer_json(TINY, 300, EOS)
    banned = small.compile(Constraint("json_object")).matcher().banned()
    assert banned.shape == (300,) and not banned[93]  # "{"


@pytest.mark.parametrize(("eos", "problem"), [(frozenset(), "is empty"), (frozenset({0, 9999}), r"must lie in \[0, 520\)")])
def test_bad_eos_ids_are_refused(eos, problem):
    with pytest.raises(ValueError, match=problem):
        Vocabulary.from_tokenizer_json(TINY, HEAD, eos)


def test_a_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer file at .*tokenizer\.json"):
        Vocabulary.from_tokenizer_json(tmp_path / "tokenizer.json", HEAD, EOS)


@pytest.mark.real_model
def test_smollm2_walks_give_valid_json(real_model):
    """The real 49,152-id tokenizer: multi-character JSON tokens, and only EOS once complete."""
    path = real_model / "tokenizer.json"
    eos = eos_token_ids(real_model)
    size = json.loads((real_model / "config.json").read_text())["vocab_size"]
    vocab = Vocabulary.from_tokenizer_json(path, size, eos)
    tokenizer = Tokenizer.from_file(str(path))
    schema = SCHEMAS[-1]
    grammar = vocab.compile(Constraint("json_schema", json.dumps(schema)))
    rng = np.random.default_rng(0)
    for _ in range(3):
        m, ids = grammar.matcher(), []
        while not m.complete() and len(ids) < 300:
            allowed = np.flatnonzero(~m.banned())
            ids.append(int(rng.choice(allowed)))
            m.advance(ids[-1])
        assert m.complete()
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
        assert set(np.flatnonzero(~m.banned())) == set(eos)
