"""The OpenAI HTTP front against the real stack (tests/support/openai_stack.py: decode server with
the scripted model, text server with tiny-llama's tokenizer, the app on uvicorn), through the
official `openai` SDK with `_strict_response_validation=True`: every response is validated
against the SDK's own models, so a field of the wrong shape fails the test.

One known gap, not ours: the SDK types a legacy completion choice's `finish_reason` as
non-null, while the API streams `finish_reason: null` until a choice's last chunk (as OpenAI's
own server does; openai/openai-openapi#100). Streamed completions are therefore read with the
SDK's plain parsing and each chunk is validated here with that one field made nullable
(`strict_completion_chunk`); everything else is the SDK's strict validation.
"""

from __future__ import annotations

import json
from typing import Optional

import httpx2 as httpx
import openai
import pytest
from openai._models import validate_type
from openai.types import Completion, CompletionChoice

from tests.support.openai_stack import MODEL_NAME, Stack
from tests.support.waiting import steps_until_freed_sync

SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


def client(stack: Stack, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url, api_key="unused", _strict_response_validation=True, timeout=30, **kwargs)


class _StreamedChoice(CompletionChoice):
    finish_reason: Optional[str] = None  # noqa: UP007 (the SDK's own style)


class _StreamedCompletion(Completion):
    choices: list[_StreamedChoice]


def strict_completion_chunk(chunk: Completion) -> Completion:
    """A streamed completion chunk validated strictly, finish_reason allowed null (see above)."""
    data = chunk.model_dump(mode="json", exclude_unset=True)
    validate_type(type_=_StreamedCompletion, value=data)
    reasons = [c["finish_reason"] for c in data["choices"] if c.get("finish_reason") is not None]
    if reasons:
        validate_type(type_=Completion, value=data)  # a last chunk passes the SDK's own model
    return chunk


def stream_chat(stack: Stack, **kwargs) -> tuple[list, dict[int, str], dict[int, str], object]:
    """A streamed chat completion checked against the streaming rules; -> (chunks, text per
    choice, finish reason per choice, usage or None)."""
    chunks = list(client(stack).chat.completions.create(model=MODEL_NAME, stream=True, **kwargs))
    return chunks, *check_stream(chunks, chat=True)


def stream_completion(stack: Stack, **kwargs):
    plain = openai.OpenAI(base_url=stack.url, api_key="unused", timeout=30)
    chunks = [strict_completion_chunk(c) for c in plain.completions.create(model=MODEL_NAME, stream=True, **kwargs)]
    return chunks, *check_stream(chunks, chat=False)


def check_stream(chunks, chat: bool):
    assert len({(c.id, c.created, c.model, c.object) for c in chunks}) == 1, "the same id, created, model, object"
    assert chunks[0].object == ("chat.completion.chunk" if chat else "text_completion")
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for i, c in enumerate(chunks):
        if not c.choices:
            assert c.usage is not None and i == len(chunks) - 1, "the usage chunk is last, with choices: []"
            usage = c.usage
            continue
        [choice] = c.choices
        k = choice.index
        assert k not in reasons, "nothing follows a choice's finish_reason"
        if chat:
            first = k not in texts
            assert (choice.delta.role == "assistant") == first, "delta.role on a choice's first chunk only"
            texts[k] = texts.get(k, "") + (choice.delta.content or "")
        else:
            texts[k] = texts.get(k, "") + choice.text
        if choice.finish_reason is not None:
            assert choice.finish_reason in ("stop", "length")
            reasons[k] = choice.finish_reason
    assert set(reasons) == set(texts), "exactly one non-null finish_reason per choice"
    return texts, reasons, usage


def test_models_chat_and_completions_streamed_and_not_pass_strict_validation(stack):
    sdk = client(stack)
    assert [m.id for m in sdk.models.list()] == [MODEL_NAME]
    assert sdk.models.retrieve(MODEL_NAME).id == MODEL_NAME
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    completion = sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=6, temperature=0)
    assert completion.object == "text_completion"
    _, texts, reasons, usage = stream_chat(stack, messages=CHAT, max_tokens=6, stream_options={"include_usage": True})
    assert texts[0] == chat.choices[0].message.content and reasons == {0: "length"} and usage == chat.usage
    _, texts, reasons, usage = stream_completion(stack, prompt="hello", max_tokens=6, stream_options={"include_usage": True})
    assert texts[0] == completion.choices[0].text and reasons == {0: "length"} and usage == completion.usage


@pytest.mark.parametrize("max_tokens", [None, 40])
def test_streamed_text_equals_collected_text_with_the_same_usage_and_finish_reason(stack, max_tokens):
    sdk = client(stack)
    options = dict(temperature=0, max_tokens=max_tokens, n=2, seed=7)
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, **options)
    _, texts, reasons, usage = stream_chat(stack, messages=CHAT, stream_options={"include_usage": True}, **options)
    assert texts == {c.index: c.message.content for c in chat.choices}
    assert reasons == {c.index: c.finish_reason for c in chat.choices}
    assert usage == chat.usage
    assert reasons[0] == ("length" if max_tokens else "stop")  # no cap: the scripted model reaches EOS
    completion = sdk.completions.create(model=MODEL_NAME, prompt="hello", **options)
    _, texts, reasons, usage = stream_completion(stack, prompt="hello", stream_options={"include_usage": True}, **options)
    assert texts == {c.index: c.text for c in completion.choices}
    assert reasons == {c.index: c.finish_reason for c in completion.choices}
    assert usage == completion.usage
    assert usage.completion_tokens == 2 * (max_tokens or usage.completion_tokens // 2)


@pytest.mark.parametrize("n", [1, 2, 9])
def test_max_tokens_gives_exactly_that_many_tokens_and_length(stack, n):
    sdk = client(stack)
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=n, logprobs=True)
    assert chat.usage.completion_tokens == n == len(chat.choices[0].logprobs.content)
    assert chat.choices[0].finish_reason == "length"
    # max_completion_tokens wins over max_tokens
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=50, max_completion_tokens=n)
    assert chat.usage.completion_tokens == n and chat.choices[0].finish_reason == "length"
    completion = sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=n, logprobs=0)
    assert completion.usage.completion_tokens == n == len(completion.choices[0].logprobs.tokens)
    assert completion.choices[0].finish_reason == "length"


def test_logprob_tokens_joined_equal_the_content_and_no_control_token_appears(stack):
    """No cap: the scripted model counts up through every id of the vocabulary (byte tokens,
    special tokens, merges) to EOS, so the output has split characters, skipped specials and
    the end-of-sequence stop."""
    sdk = client(stack)
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=3)
    [choice] = chat.choices
    entries = choice.logprobs.content
    assert choice.finish_reason == "stop" and len(entries) == chat.usage.completion_tokens > 100
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob  # scripted: the chosen id is the best
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks, texts, _, _ = stream_chat(stack, messages=CHAT, logprobs=True, top_logprobs=1)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(e.token for e in streamed) == texts[0] == choice.message.content
    completion = sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=None, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for content in (choice.message.content, texts[0], completion.choices[0].text):
        assert not any(s in content for s in SPECIAL)


def post(stack: Stack, path: str, body, **kwargs) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.root + path, content=data, headers={"content-type": "application/json"}, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": MODEL_NAME}, 400, "messages"),
        ({"model": MODEL_NAME, "messages": CHAT, "temperature": 9}, 400, "temperature"),
        ({"model": MODEL_NAME, "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "messages": CHAT, "max_tokens": 10_000}, 400, "max_tokens"),  # past the context
        ({"model": MODEL_NAME, "messages": CHAT, "n": 50}, 400, "n"),
        ({"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL_NAME, "messages": CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
        ({"model": MODEL_NAME, "messages": CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0].type"),
        ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content"),
        ({"model": "gpt-4o", "messages": CHAT}, 404, "model"),
        # known and not supported: refused rather than ignored, which would change the answer unsaid
        ({"model": MODEL_NAME, "messages": CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": MODEL_NAME, "messages": CHAT, "logit_bias": {"5": 1}}, 400, "logit_bias"),
        ({"model": MODEL_NAME, "messages": CHAT, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
        ({"model": MODEL_NAME, "messages": CHAT, "use_beam_search": True}, 400, "use_beam_search"),
        ({"model": MODEL_NAME, "messages": CHAT, "guided_json": {"type": "object"}}, 400, "guided_json"),
        # the extensions honoured, out of range: refused by the front, or by the decode service
        ({"model": MODEL_NAME, "messages": CHAT, "top_k": -2}, 400, "top_k"),
        ({"model": MODEL_NAME, "messages": CHAT, "min_p": 1.5}, 400, "min_p"),
        ({"model": MODEL_NAME, "messages": CHAT, "stop_token_ids": [7, 10_000]}, 400, "stop_token_ids"),
        ({"model": MODEL_NAME, "messages": CHAT, "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ],
)
def test_bad_requests_get_the_openai_error_shape_and_never_422_or_500(stack, body, status, param):
    error = error_of(post(stack, "/v1/chat/completions", body), status)
    if param is not None:
        assert error["param"] == param, error


def test_unknown_fields_are_ignored_and_streamed_or_not_the_choices_are_n(stack):
    chat = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, n=3, extra_body={"no_such_field": {"x": 1}}, user="u"
    )
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage.completion_tokens == 9


def test_the_refused_extensions_pass_at_their_neutral_values_and_a_guided_one_says_what_to_use(stack):
    chat = client(stack).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"repetition_penalty": 1, "presence_penalty": 0, "length_penalty": 1},
    )
    assert chat.usage.completion_tokens == 2
    error = error_of(post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "guided_regex": "a+"}), 400)
    assert error["param"] == "guided_regex" and "response_format" in error["message"], error


def test_the_extensions_other_servers_take_are_honoured(stack):
    """vLLM's and SGLang's extra sampling fields (sent through the SDK's extra_body): the sampling
    cuts reach the model (the scripted one records them); the stopping fields end the stream as
    they say. The scripted model counts up from the prompt's last id t to 511, then EOS (id 0),
    so the distance to EOS is known."""
    sdk = client(stack)
    seen = len(stack.model.samplings)
    sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"top_k": 7, "min_p": 0.25})
    sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"top_k": -1})
    sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert [(s.top_k, s.min_p) for s in stack.model.samplings[seen:]] == [(7, 0.25), (0, 0.0), (0, 0.0)]

    [t] = post(stack, "/tokenize", {"prompt": "hello"}).json()["tokens"][-1:]
    to_eos = 511 - t  # tokens before EOS

    def complete(**extra):
        [choice] = (c := sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=to_eos + 3, extra_body=extra)).choices
        return choice.text, choice.finish_reason, c.usage.completion_tokens

    plain, reason, tokens = complete()
    assert (reason, tokens) == ("stop", to_eos)
    assert complete(stop_token_ids=[t + 4])[1:] == ("stop", 3)
    assert complete(min_tokens=to_eos + 3)[1:] == ("length", to_eos + 3)  # EOS held back, skipped past
    text, reason, tokens = complete(ignore_eos=True)
    assert (text, reason, tokens) == (plain, "length", to_eos + 3)  # EOS, <|im_start|>, <|im_end|>: counted, not shown
    shown = complete(ignore_eos=True, skip_special_tokens=False)[0]
    assert shown == plain + "<|endoftext|><|im_start|><|im_end|>"
    stop = plain[5:8]
    kept = complete(stop=[stop], include_stop_str_in_output=True)
    assert kept[:2] == (plain[: plain.index(stop) + len(stop)], "stop")


def test_a_list_of_prompts_is_a_batch_with_n_choices_each_as_each_prompt_alone_gives_them(stack):
    sdk = client(stack)
    prompts, options = ["hello", "hello there", "a third one"], dict(max_tokens=4, n=2, seed=5, temperature=0.7, logprobs=1)
    seen = len(stack.model.samplings)
    alone = [sdk.completions.create(model=MODEL_NAME, prompt=p, **options) for p in prompts]
    batched = len(stack.model.samplings)
    batch = sdk.completions.create(model=MODEL_NAME, prompt=prompts, **options)
    seeds = [s.seed for s in stack.model.samplings[seen:]]  # prompt p's choice j with seed + j, alone or batched
    assert sorted(seeds[: batched - seen]) == sorted(seeds[batched - seen :]) == [5, 5, 5, 6, 6, 6]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [(c.text, c.finish_reason) for c in batch.choices] == [(c.text, c.finish_reason) for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once, not per choice
    assert batch.usage.completion_tokens == 6 * 4
    _, texts, reasons, usage = stream_completion(stack, prompt=prompts, stream_options={"include_usage": True}, **options)
    assert texts == {c.index: c.text for c in batch.choices} and set(reasons.values()) == {"length"}
    assert usage == batch.usage
    error = error_of(post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": ["x"] * 9, "n": 8}), 400)
    assert error["param"] == "prompt" and "64" in error["message"], error
    error_of(post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": []}), 400)


def test_a_prompt_of_token_ids_answers_as_its_text_does_alone_or_in_a_batch(stack):
    sdk = client(stack)
    ids = post(stack, "/tokenize", {"prompt": "hello there"}).json()["tokens"]
    text = sdk.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=5)
    by_ids = sdk.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5)
    assert (by_ids.choices[0].text, by_ids.usage) == (text.choices[0].text, text.usage)
    batch = sdk.completions.create(model=MODEL_NAME, prompt=[ids, [1, 305]], max_tokens=5)
    assert batch.choices[0].text == text.choices[0].text and batch.usage.prompt_tokens == len(ids) + 2
    error = error_of(post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, 512]}), 400)
    assert error["param"] == "prompt" and "prompt_token_ids[1]" in error["message"], error
    error_of(post(stack, "/v1/completions", {"model": MODEL_NAME, "prompt": [5, "a"]}), 400)


def test_stop_strings_end_the_text_before_them(stack):
    sdk = client(stack)
    full = sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=12).choices[0].text
    stop = full[5:8]
    cut = sdk.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=12, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    _, texts, reasons, _ = stream_completion(stack, prompt="hello", max_tokens=12, stop=stop)
    assert texts[0] == cut.choices[0].text and reasons == {0: "stop"}


def test_tokenize_detokenize_health_ready_and_metrics(stack):
    ids = post(stack, "/tokenize", {"prompt": "hello there"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert post(stack, "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "hello there"}
    chat_ids = post(stack, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert client(stack).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1).usage.prompt_tokens == len(chat_ids)
    error_of(post(stack, "/detokenize", {"tokens": [10**6]}), 400)
    assert httpx.get(stack.root + "/health").status_code == 200
    assert httpx.get(stack.root + "/ready").status_code == 200
    metrics = httpx.get(stack.root + "/metrics").text
    for name in ("tokenwire_api_requests_total", "tokenwire_api_ttft_seconds_count", "tokenwire_api_inter_token_seconds_count",
                 "tokenwire_api_prompt_tokens_total", "tokenwire_api_completion_tokens_total"):
        assert name in metrics


def test_the_sdk_retries_429_and_503_and_not_400():
    """The server counts what it saw: the SDK's 2 retries make 3 requests for a 429 (with
    Retry-After) and for a 503, and a 400 is sent once."""
    with Stack(step_delay_s=0.05, max_in_flight=1) as stack:
        sdk = client(stack, max_retries=2)
        path = "/v1/chat/completions"
        with httpx.stream("POST", stack.url + "/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "stream": True}, timeout=30) as held:
            lines = held.iter_lines()  # (kept: dropping it would close the stream)
            next(lines)  # the one admitted stream is running
            with pytest.raises(openai.RateLimitError) as refused:
                sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
        assert refused.value.response.headers["retry-after"] == "1"
        assert stack.requests_seen(path) == {"200": 1, "429": 3}
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=-1)
        assert stack.requests_seen(path)["400"] == 1
        stack.run(stack.decode.stop(None))  # the backend goes down
        with pytest.raises(openai.InternalServerError) as down:
            sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
        assert down.value.status_code == 503
        assert stack.requests_seen(path)["503"] == 3
        assert httpx.get(stack.root + "/ready").status_code == 503


def test_bearer_auth_guards_everything_but_the_probes():
    with Stack(auth_token="s3cret") as stack:
        assert httpx.get(stack.root + "/health").status_code == 200
        error_of(httpx.get(stack.url + "/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            client(stack).models.list()
        sdk = openai.OpenAI(base_url=stack.url, api_key="s3cret", _strict_response_validation=True)
        assert [m.id for m in sdk.models.list()] == [MODEL_NAME]


def test_a_deadline_is_504_before_the_200_and_an_error_event_then_done_after_it():
    with Stack(step_delay_s=0.05, request_timeout_s=0.5) as stack:
        sdk = client(stack, max_retries=0)
        with pytest.raises(openai.InternalServerError) as late:
            sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT)  # ~500 tokens at 50 ms a step
        assert late.value.status_code == 504
        error_of(late.value.response, 504)
        with httpx.stream("POST", stack.url + "/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "stream": True}, timeout=30) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "timeout"
        assert not any('"finish_reason":"' in e for e in events), "a choice cut by an error has no finish_reason"
        with pytest.raises(openai.APIError):  # the SDK raises on the error event
            list(sdk.chat.completions.create(model=MODEL_NAME, messages=CHAT, stream=True))
        # the deadline cancelled the decode: its slot is freed within a few steps (2-3 when the
        # cancel works; the answer would run ~500), counted by the model
        steps_until_freed_sync(lambda: stack.leftovers()["model_slots"], lambda: stack.model.decode_steps,
                               stack.model.decode_steps, at_most=20)
