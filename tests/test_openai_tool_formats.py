"""Each tool format without a stack (services.openai_api.tool_formats, .tools, .completions): calls
streamed and collected from a text-service stream written by hand, and each format's forced-call
grammar walked token by token against tiny-llama's real tokenizer, with the scripted model's
policy and with seeded temperature-1 samples from random logits: whatever is sampled under the
grammar is a call the front reads back, to an allowed tool, with valid arguments. The tools are
tests/test_openai_tools.py's.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from engine.constraints import Constraint, Vocabulary
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from services.openai_api import completions, tools
from services.openai_api.metrics import ApiMetrics
from services.openai_api.streaming import DONE
from services.openai_api.tool_formats import FORMATS, Call
from tests.support.openai_stack import MODEL_NAME, TINY
from tests.test_openai_tools import FORCED, TOOL_SETS, TOOLS, Add, Weather, assert_allowed_and_valid
from tokenizer_svc.tokenizer import TextTokenizer

TOKENIZER = TextTokenizer.from_dir(TINY)


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
        stream = completions.chunks(completions.CHAT, header, 1, 1, _events(pieces), ApiMetrics(), False, False, completions.Calls(_plan(), f))
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
        return await completions.collect(completions.CHAT, header, 1, 1, _events([text]), ApiMetrics(), False, calls)

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
        stream = completions.chunks(completions.CHAT, header, 1, 1, _events(pieces), ApiMetrics(), False, False, completions.Calls(_plan(), f))
        return _sse([e async for e in stream])

    chunks = asyncio.run(run(["<tool", "bar> is a tag", " and more"]))
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0]["delta"].get("content")]
    assert contents == ["<toolbar> is a tag", " and more"]  # held while it could open a call, then sent
    chunks = asyncio.run(run(['<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>']))  # no such tool: text
    assert chunks[-2]["choices"][0]["delta"]["content"].startswith("<tool_call>") and chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def vocabulary():
    return Vocabulary.from_tokenizer_json(TINY / "tokenizer.json", 512, frozenset({0, 2}))


def _generate(vocabulary, lark: str, pick) -> str:
    """The text of ids chosen one at a time under the grammar by `pick(banned [V], last id)`, up to
    EOS (0 or 2, allowed only where the grammar accepts) or a complete output, at most 400 ids."""
    matcher = vocabulary.compile(Constraint("lark", lark)).matcher()
    out, token = [], None
    for _ in range(400):
        token = pick(matcher.banned(), token)
        if token in (0, 2):
            break
        matcher.advance(token)
        out.append(token)
        if matcher.complete():
            break
    assert matcher.complete() or token in (0, 2), "the walk did not end within 400 tokens"
    return TOKENIZER.decode(out)


def _walk(vocabulary, lark: str, start: int) -> str:
    """The scripted model's policy under the grammar: id+1 where allowed, else the lowest allowed."""

    def pick(banned, last):
        nxt = (start if last is None else last) + 1
        return nxt if nxt < 512 and not banned[nxt] else int(np.argmin(banned))

    return _generate(vocabulary, lark, pick)


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


def _sample(vocabulary, lark: str, rng: np.random.Generator) -> str:
    """A temperature-1 sample from random logits under the grammar, as the decoder samples: the
    banned ids masked before the softmax, EOS allowed only where the grammar accepts."""

    def pick(banned, last):
        logits = np.where(banned, -np.inf, 3 * rng.standard_normal(512))  # [V]
        p = np.exp(logits - logits.max())  # [V]
        return int(rng.choice(512, p=p / p.sum()))

    return _generate(vocabulary, lark, pick)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_s_forced_call_sampled_at_random_is_always_an_allowed_valid_call(vocabulary, fmt):
    """Whatever a model samples under the forced grammar is a call the front reads back, to an
    allowed tool, with valid arguments: random logits, ten seeds, each tool set and choice."""
    f = FORMATS[fmt]
    for tool_set, choice in FORCED:
        plan = tools.plan_of(TOOL_SETS[tool_set], choice, False)
        lark = tools.constraint_of(plan, f).lark
        for seed in range(10):
            text = _sample(vocabulary, lark, np.random.default_rng(seed))
            made = f.calls(text, plan.names)
            assert made is not None and len(made) == 1, (fmt, tool_set, choice, seed, text)
            assert_allowed_and_valid(made[0].name, made[0].arguments, TOOL_SETS[tool_set], choice)
