"""Serving one generation request of either endpoint: its n choices, collected or streamed.

Data flow: the app turns the body into n GenerateRequests (services.openai_api.conversion), opens
one text-service `Generate` stream per choice and hands them here, merged (streaming.merged) into
(choice, GenerateResponse) pairs:
  * `collect`: every choice's deltas joined into one chat.completion / text_completion object;
  * `chunks`: one chunk per delta, in the shape of the endpoint (`Endpoint`), as SSE events.

What a stream holds (the issue's list, and the OpenAI reference):
  * every chunk has the same `id`, `created`, `model` and `object`;
  * chat: each choice's first chunk carries `delta.role` (and empty content);
  * each choice gets exactly one non-null `finish_reason`, `stop`, `length` or `tool_calls`, on
    its last chunk, and none before;
  * with tools in play (`Calls`), an answer that may still be calls is held back; once it has
    finished, its calls go out as `delta.tool_calls` (per call an integer `index`; `id`, `type`
    and the function's `name` only in its first delta, the `arguments` in the next; the held
    tokens' logprobs on the very first), or, when it was text after all, the held text as content;
  * with `stream_options.include_usage`, a last chunk with `choices: []` and the usage, the same
    usage a non-streamed request reports;
  * an error after the 200 is sent as `data: {"error": ...}`; `data: [DONE]` always ends it.
Text and usage come straight from the text service, so streamed and collected answers are equal
for the same generation.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from protos.text.v1 import text_pb2
from services.openai_api import conversion, tools
from services.openai_api.errors import ApiError, from_grpc
from services.openai_api.metrics import ApiMetrics, ChoiceTimer
from services.openai_api.streaming import DONE, sse
from services.openai_api.tool_formats import ToolFormat

log = logging.getLogger("tokenwire.api")


@dataclass(frozen=True)
class Endpoint:
    """What differs between /v1/chat/completions and /v1/completions."""

    chat: bool
    prompt_field: str  # the request field a prompt error names
    max_tokens_field: str

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


CHAT = Endpoint(True, "messages", "max_tokens")
COMPLETIONS = Endpoint(False, "prompt", "max_tokens")


@dataclass(frozen=True)
class Header:
    """What every object (or chunk) of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(frozen=True)
class Calls:
    """A chat request's tools (services.openai_api.tools) and the model's format; plan None: no tools."""

    plan: tools.ToolPlan | None = None
    fmt: ToolFormat | None = None

    def read(self, text: str, reason: str | None) -> list | None:
        return tools.read_calls(text, reason or "", self.plan, self.fmt)


NO_CALLS = Calls()


@dataclass
class _Choice:
    timer: ChoiceTimer
    text: str = ""
    logprobs: list = field(default_factory=list)
    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, response: text_pb2.GenerateResponse) -> None:
        if response.HasField("delta"):
            self.text += response.delta.text
            self.logprobs.extend(response.delta.logprobs)
            self.timer.tokens(len(response.delta.token_ids))
        else:
            finished = response.finished
            self.reason = conversion.finish_reason(finished.reason)
            self.prompt_tokens = finished.usage.prompt_tokens
            self.completion_tokens = finished.usage.completion_tokens


def _usage(choices: list[_Choice], metrics: ApiMetrics, per_prompt: int) -> dict:
    prompt = sum(c.prompt_tokens for c in choices[::per_prompt])  # each prompt counted once, not per choice
    completion = sum(c.completion_tokens for c in choices)
    metrics.prompt_tokens.inc(prompt)
    return conversion.usage_json(prompt, completion)


def _error(error: BaseException, endpoint: Endpoint) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, grpc.aio.AioRpcError):
        return from_grpc(error, endpoint.prompt_field, endpoint.max_tokens_field)
    log.error("unexpected error in a generation", exc_info=error)
    return ApiError(500, "internal error; see the server log", "server_error", code="internal_error")


async def collect(
    endpoint: Endpoint, header: Header, n: int, per_prompt: int, events: AsyncIterator[tuple[int, text_pb2.GenerateResponse]],
    metrics: ApiMetrics, logprobs: bool, calls: Calls = NO_CALLS,
) -> dict:
    """Every choice (n in all, `per_prompt` of each prompt, in the prompts' order) collected into
    one response object. Raises ApiError."""
    choices = [_Choice(metrics.timer()) for _ in range(n)]
    try:
        async with contextlib.aclosing(events):
            async for index, response in events:
                choices[index].add(response)
    except Exception as error:
        raise _error(error, endpoint) from None
    out = []
    for i, c in enumerate(choices):
        if c.reason is None:  # the text service's contract: a stream always ends with Finished
            raise ApiError(503, "the model service ended a generation early", "service_unavailable_error")
        reason = c.reason
        if endpoint.chat:
            entry = {"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None}}
            made = calls.read(c.text, c.reason)
            if made:
                entry["message"].update(content=None, tool_calls=[tools.call_json(call) for call in made])
                reason = "tool_calls"
            entry["logprobs"] = {"content": conversion.chat_logprobs(c.logprobs), "refusal": None} if logprobs else None
        else:
            entry = {"index": i, "text": c.text, "logprobs": conversion.completion_logprobs(c.logprobs, 0) if logprobs else None}
        entry["finish_reason"] = reason
        out.append(entry)
    return {
        "id": header.id, "object": endpoint.object, "created": header.created, "model": header.model,
        "choices": out, "usage": _usage(choices, metrics, per_prompt),
    }


async def chunks(
    endpoint: Endpoint, header: Header, n: int, per_prompt: int, events: AsyncIterator[tuple[int, text_pb2.GenerateResponse]],
    metrics: ApiMetrics, logprobs: bool, include_usage: bool, calls: Calls = NO_CALLS,
) -> AsyncIterator[bytes]:
    """The SSE events of a stream of n choices (`per_prompt` as for `collect`), [DONE] last (see
    the module docstring for what holds)."""
    choices = [_Choice(metrics.timer()) for _ in range(n)]
    held = [tools.ToolStream(calls.plan if endpoint.chat else None, calls.fmt) for _ in range(n)]

    def chunk(choice: dict | None) -> bytes:
        return sse({
            "id": header.id, "object": endpoint.chunk_object, "created": header.created, "model": header.model,
            "choices": [] if choice is None else [choice],
        })

    try:
        if endpoint.chat:
            for i in range(n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        async with contextlib.aclosing(events):
            async for index, response in events:
                c = choices[index]
                c.add(response)
                if response.HasField("delta"):
                    out = held[index].feed(response.delta.text, list(response.delta.logprobs))
                    if out is None or not (out[0] or (logprobs and out[1])):
                        continue
                    yield chunk(_delta(endpoint, index, *out, logprobs, len(c.text) - len(out[0])))
                else:
                    entries, reason = _finish_held(endpoint, index, held[index], c, calls, logprobs)
                    for entry in entries:
                        yield chunk(entry)
                    yield chunk(_last(endpoint, index, reason))
        if any(c.reason is None for c in choices):
            raise ApiError(503, "the model service ended a generation early", "service_unavailable_error")
        if include_usage:
            usage = _usage(choices, metrics, per_prompt)
            yield sse({
                "id": header.id, "object": endpoint.chunk_object, "created": header.created, "model": header.model,
                "choices": [], "usage": usage,
            })
    except Exception as error:  # after the 200: the error goes in the stream
        metrics.stream_errors.inc()
        yield sse(_error(error, endpoint).body())
    yield DONE


def _delta(endpoint: Endpoint, index: int, text: str, entries: list, logprobs: bool, offset: int) -> dict:
    """A content delta: `text` and its logprob `entries`, `offset` its place in the choice's text."""
    if endpoint.chat:
        entry = {"index": index, "delta": {"content": text}}
        entry["logprobs"] = {"content": conversion.chat_logprobs(entries), "refusal": None} if logprobs else None
    else:
        entry = {"index": index, "text": text}
        entry["logprobs"] = conversion.completion_logprobs(entries, offset) if logprobs else None
    entry["finish_reason"] = None
    return entry


def _finish_held(
    endpoint: Endpoint, index: int, held: tools.ToolStream, c: _Choice, calls: Calls, logprobs: bool,
) -> tuple[list[dict], str | None]:
    """A finished choice's held answer as chunk entries, and its finish reason: its calls (the held
    tokens' logprobs on the first call's first delta), or its text after all."""
    if not held.holding:
        return [], c.reason
    made = calls.read(held.held, c.reason)
    if not made:
        text = held.held
        sent = [_delta(endpoint, index, text, held.entries, logprobs, len(c.text) - len(text))] if text or held.entries else []
        return sent, c.reason
    out = []
    entries = {"content": conversion.chat_logprobs(held.entries), "refusal": None} if logprobs else None
    for j, call in enumerate(made):
        for part in _call_deltas(j, tools.call_json(call)):
            out.append({"index": index, "delta": {"tool_calls": [part]}, "logprobs": entries, "finish_reason": None})
            entries = None
    return out, "tool_calls"


def _call_deltas(index: int, call: dict) -> list[dict]:
    """One call as its two deltas: id, type and name first (arguments empty), then the arguments."""
    function = call["function"]
    return [
        {"index": index, "id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": ""}},
        {"index": index, "function": {"arguments": function["arguments"]}},
    ]


def _last(endpoint: Endpoint, index: int, reason: str | None) -> dict:
    if endpoint.chat:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
