"""Serving one generation request of either endpoint: its n choices, collected or streamed.

Data flow: the app turns the body into n GenerateRequests (services.openai_api.conversion), opens
one text-service `Generate` stream per choice and hands them here, merged (streaming.merged) into
(choice, GenerateResponse) pairs:
  * `collect`: every choice's deltas joined into one chat.completion / text_completion object;
  * `chunks`: one chunk per delta, in the shape of the endpoint (`Endpoint`), as SSE events.

What a stream holds (the issue's list, and the OpenAI reference):
  * every chunk has the same `id`, `created`, `model` and `object`;
  * chat: each choice's first chunk carries `delta.role` (and empty content);
  * each choice gets exactly one non-null `finish_reason`, `stop` or `length`, on its last chunk,
    and none before;
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
from services.openai_api import conversion
from services.openai_api.errors import ApiError, from_grpc
from services.openai_api.metrics import ApiMetrics, ChoiceTimer
from services.openai_api.streaming import DONE, sse

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


def _usage(choices: list[_Choice], metrics: ApiMetrics) -> dict:
    prompt = choices[0].prompt_tokens  # every choice has the same prompt: counted once
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
    endpoint: Endpoint, header: Header, n: int, events: AsyncIterator[tuple[int, text_pb2.GenerateResponse]],
    metrics: ApiMetrics, logprobs: bool,
) -> dict:
    """Every choice collected into one response object. Raises ApiError."""
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
        if endpoint.chat:
            entry = {"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None}}
            entry["logprobs"] = {"content": conversion.chat_logprobs(c.logprobs), "refusal": None} if logprobs else None
        else:
            entry = {"index": i, "text": c.text, "logprobs": conversion.completion_logprobs(c.logprobs, 0) if logprobs else None}
        entry["finish_reason"] = c.reason
        out.append(entry)
    return {
        "id": header.id, "object": endpoint.object, "created": header.created, "model": header.model,
        "choices": out, "usage": _usage(choices, metrics),
    }


async def chunks(
    endpoint: Endpoint, header: Header, n: int, events: AsyncIterator[tuple[int, text_pb2.GenerateResponse]],
    metrics: ApiMetrics, logprobs: bool, include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE events of a stream, [DONE] last (see the module docstring for what holds)."""
    choices = [_Choice(metrics.timer()) for _ in range(n)]

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
                offset = len(c.text)
                c.add(response)
                if response.HasField("delta"):
                    delta = response.delta
                    if not delta.text and not (logprobs and delta.logprobs):
                        continue
                    yield chunk(_delta(endpoint, index, delta, logprobs, offset))
                else:
                    yield chunk(_last(endpoint, index, c.reason))
        if any(c.reason is None for c in choices):
            raise ApiError(503, "the model service ended a generation early", "service_unavailable_error")
        if include_usage:
            usage = _usage(choices, metrics)
            yield sse({
                "id": header.id, "object": endpoint.chunk_object, "created": header.created, "model": header.model,
                "choices": [], "usage": usage,
            })
    except Exception as error:  # after the 200: the error goes in the stream
        metrics.stream_errors.inc()
        yield sse(_error(error, endpoint).body())
    yield DONE


def _delta(endpoint: Endpoint, index: int, delta: text_pb2.TextDelta, logprobs: bool, offset: int) -> dict:
    if endpoint.chat:
        entry = {"index": index, "delta": {"content": delta.text}}
        entry["logprobs"] = {"content": conversion.chat_logprobs(delta.logprobs), "refusal": None} if logprobs else None
    else:
        entry = {"index": index, "text": delta.text}
        entry["logprobs"] = conversion.completion_logprobs(delta.logprobs, offset) if logprobs else None
    entry["finish_reason"] = None
    return entry


def _last(endpoint: Endpoint, index: int, reason: str | None) -> dict:
    if endpoint.chat:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}
