"""The Tokenizer and TextGeneration servicers: protobuf in and out around tokenizer_svc.

Generate: GenerateRequest -> `tokenizer_svc.generation.prepare_request` (the prompt's ids,
validated) -> one decode of those ids (services.decode_stream_client: a request on the text
service's one `Decoder.DecodeStream`, whose entries become engine events; `engine_decode`: an
in-process engine's own events) ->
`generate_text` -> each TextDelta / TextFinished as a GenerateResponse. `Complete` collects the
very same stream, and `tokenwire generate --local` runs it too, so none of them can disagree.
Leaving the stream early (client cancel, deadline, error) closes `generate_text`, which closes
the decode: the upstream call or the engine request is cancelled.

Errors pass on to `grpc_errors` (services.errors maps them): InvalidArgument; the decoder
breaking its contract (DecoderFault) is INTERNAL; a decode stream that ends without Finished is
UNAVAILABLE.

Responsiveness: text input over `max_input_chars` (and a Detokenize over `max_detokenize_ids`)
is refused before any tokenizing; large inputs are tokenized and detokenized in a worker thread
with the GIL released (TextTokenizer.encode, `_decode_in_pieces`, `_work`), so one big request does not stall every
other stream on the event loop; the Admission caps the requests in flight (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence, TypeVar

from engine.core.async_engine import AsyncEngine
from engine.core.constrained import ConstraintCompiler
from engine.core.errors import InvalidArgument, check_token_ids
from engine.core.events import Event, Finished
from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2, text_pb2_grpc
from services import validation
from services.admission import Admission
from services.decode_events import event_to_pb
from services.errors import grpc_errors
from services.metrics import Metrics
from services.sent_together import sent_together
from tokenizer_svc import generation, tool_template
from tokenizer_svc.chat import ChatMessage
from tokenizer_svc.generation import (
    Chat,
    TextDelta,
    TextEvent,
    generate_text,
    prepare_request,
)
from tokenizer_svc.tokenizer import INLINE_CHARS, TextTokenizer

log = logging.getLogger("tokenwire.text")

T = TypeVar("T")


# --- tokenizer work, off the event loop when it is large ---------------------------------------

# Up to this many characters (Tokenize, Generate) or ids (Detokenize) the work runs inline on the
# event loop; above it, in a worker thread. Measured on tests/assets/tiny-llama (about one id per
# character, the costliest per character of the test tokenizers): below the threshold a hand-off
# to a thread (its latency and two event-loop wake-ups) would be a large share of the work, and the
# stall it would spare the other streams is short; above it the stall grows with the input
# (docs/benchmarks.md, 'Figures behind code comments'). The tokenizer encodes texts of this size
# holding the GIL (tokenizer_svc.tokenizer.INLINE_CHARS).
INLINE_MAX = INLINE_CHARS
# Above this many, the work goes to a pool of one thread fewer than the cores (at least one),
# whose threads run at a lower CPU priority (nice +10, Linux): the tokenizer's Rust work runs on
# the calling thread, and without these a few large requests take every core from the event loop.
# A small stream's worst gap with 3 large requests and 3 refused (benchmarks/text_responsiveness.py)
# shrank with each: one thread instead of the default executor's, then that thread at nice +10
# (docs/benchmarks.md, 'Figures behind code comments'). Work between INLINE_MAX and this has a pool
# of its own at the usual priority, so it never queues behind a large request.
LARGE_MIN = 64 * 1024
_LARGE_NICE = 10


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A chat's template adds markup to every message (~30 characters in common templates): counted
# when choosing where a chat's work runs, so thousands of short messages do not run inline.
_CHARS_PER_MESSAGE = 32

_POOL = ThreadPoolExecutor(min(32, _cores() + 4), thread_name_prefix="tokenize")
def _lower_priority() -> None:
    """Pool initializer: this thread at `_LARGE_NICE` more. Linux only, where the nice value is
    per thread (elsewhere PRIO_PROCESS would reach the whole process, or another one)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _LARGE_NICE)


_LARGE_POOL = ThreadPoolExecutor(
    max(1, _cores() - 1), thread_name_prefix="tokenize-large", initializer=_lower_priority
)

# Ids copied per call in a worker thread (into a TokenizeResponse, out of a DetokenizeRequest):
# each call holds the GIL; between calls it can pass to the event loop, which one call for the
# largest Detokenize kept waiting far longer (docs/benchmarks.md, 'Figures behind code comments').
_IDS_PER_PIECE = 64 * 1024


def _pieces(ids: Sequence[int]) -> Iterator[list[int]]:
    for start in range(0, len(ids), _IDS_PER_PIECE):
        yield list(ids[start : start + _IDS_PER_PIECE])


def _decode_in_pieces(tokenizer: TextTokenizer, token_ids: Sequence[int], keep_special_tokens: bool, field: str) -> str:
    """TextTokenizer.decode, an id outside the vocabulary refused as `field[i]`, for a worker
    thread: the ids are copied and checked in pieces (`_pieces`), so the event loop gets the GIL
    in between, and decoded with the GIL released (Vocabulary.decode_releasing_gil)."""
    ids: list[int] = []
    for piece in _pieces(token_ids):
        if max(piece) >= tokenizer.vocab_size:  # uint32: never negative
            check_token_ids(ids + piece, tokenizer.vocab_size, field)  # names the first one
        ids += piece
    return tokenizer.vocabulary.decode_releasing_gil(ids, keep_special_tokens)


async def _work(size: int, fn: Callable[..., T], *args) -> T:
    """fn(*args): inline when `size` (characters or ids) is at most INLINE_MAX, else in a worker
    thread (of _LARGE_POOL above LARGE_MIN). A running thread cannot be stopped: when the caller
    is cancelled (client cancel, deadline) this waits for it before re-raising, so the request's
    admission stays held while its work runs and cancelled requests cannot pile work up past the
    in-flight cap; work not yet started is dropped."""
    if size <= INLINE_MAX:
        return fn(*args)
    job = (_LARGE_POOL if size > LARGE_MIN else _POOL).submit(fn, *args)
    done = asyncio.wrap_future(job)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        if not job.cancel():
            await asyncio.wait([done])  # a second cancel (server stop) ends this wait
        raise


def _chat_work_size(chat: text_pb2.Chat, max_input_chars: int) -> int:
    """A chat's size for `_work`, once validation.chat_chars has checked it against the limits."""
    return validation.chat_chars(chat, max_input_chars) + _CHARS_PER_MESSAGE * len(chat.messages)


def _tokenize_response(ids: Sequence[int], in_pieces: bool) -> text_pb2.TokenizeResponse:
    if not in_pieces:
        return text_pb2.TokenizeResponse(token_ids=ids)
    response = text_pb2.TokenizeResponse()
    for piece in _pieces(ids):
        response.token_ids.extend(piece)
    return response


# --- protobuf <-> tokenizer_svc ----------------------------------------------------------------


NO_ARGUMENTS = {"type": "object", "properties": {}}
# As deep as a constraint's JSON Schema may nest (docs/constraints.md): the template writes the
# schema with `tojson`, and the shield walks it, both recursively.
MAX_TOOL_DEPTH = 128


def _depth(value: object) -> int:
    """How many levels of objects and arrays a JSON value nests ({}: 1, a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _tool_from_pb(tool: text_pb2.ChatTool, i: int) -> dict:
    """A ChatTool as chat templates take it: OpenAI's {"type": "function", "function": {...}}."""
    field = f"chat.tools[{i}].parameters"
    if not tool.name:
        raise InvalidArgument(f"chat.tools[{i}].name", "must not be empty")
    try:
        parameters = json.loads(tool.parameters) if tool.parameters else NO_ARGUMENTS
    except ValueError as error:
        raise InvalidArgument(field, f"is not JSON: {error}") from None
    except RecursionError:
        raise InvalidArgument(field, f"nests deeper than {MAX_TOOL_DEPTH} levels") from None
    if not isinstance(parameters, dict):
        raise InvalidArgument(field, "must be a JSON object (a JSON Schema)")
    if _depth(parameters) > MAX_TOOL_DEPTH:
        raise InvalidArgument(field, f"nests deeper than {MAX_TOOL_DEPTH} levels")
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": parameters}}


def chat_from_pb(chat: text_pb2.Chat) -> Chat:
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    tools = tuple(_tool_from_pb(t, i) for i, t in enumerate(chat.tools))
    return Chat(tuple(ChatMessage(m.role, m.content) for m in chat.messages), add_generation_prompt, tools)


_TOOL_FORMATS = {
    tool_template.QWEN: text_pb2.TOOL_FORMAT_QWEN,
    tool_template.SMOLLM2: text_pb2.TOOL_FORMAT_SMOLLM2,
    tool_template.LLAMA3: text_pb2.TOOL_FORMAT_LLAMA3,
}


def chat_description(tokenizer: TextTokenizer) -> text_pb2.ChatDescription:
    """What the tokenizer's chat template does with tools (read once, when it was loaded)."""
    tools = tokenizer.tool_template
    return text_pb2.ChatDescription(
        has_template=tokenizer.chat_template is not None,
        tool_format=_TOOL_FORMATS.get(tools.format, text_pb2.TOOL_FORMAT_UNSPECIFIED),
        renders_tools=tools.renders_tools,
    )


def encode_chat(tokenizer: TextTokenizer, chat: text_pb2.Chat) -> list[int]:
    """A Chat message's prompt ids, as Tokenize and Generate make them (InvalidArgument if refused)."""
    return generation.encode_chat(tokenizer, chat_from_pb(chat))


def prompt_from_pb(request: text_pb2.GenerateRequest) -> str | Chat | tuple[int, ...]:
    kind = request.WhichOneof("input")
    if kind == "chat":
        return chat_from_pb(request.chat)
    return tuple(request.prompt_token_ids.ids) if kind == "prompt_token_ids" else request.prompt


def logprob_to_pb(entry: generation.TokenLogprob) -> text_pb2.TokenLogprob:
    return text_pb2.TokenLogprob(
        text=entry.text,
        bytes=entry.bytes,
        logprob=entry.logprob,
        top_logprobs=[
            text_pb2.TopLogprob(id=a.id, text=a.text, bytes=a.bytes, logprob=a.logprob) for a in entry.top_logprobs
        ],
    )


def response_to_pb(event: TextEvent) -> text_pb2.GenerateResponse:
    if isinstance(event, TextDelta):
        delta = text_pb2.TextDelta(text=event.text, token_ids=event.token_ids)
        if event.logprobs:
            delta.logprobs.extend(map(logprob_to_pb, event.logprobs))
        return text_pb2.GenerateResponse(delta=delta)
    decoded = event_to_pb(Finished(event.reason, event.usage)).finished  # the decode proto's reason and usage
    return text_pb2.GenerateResponse(
        finished=text_pb2.TextFinished(
            reason=decoded.reason,
            usage=decoded.usage,
            stop_token_id=event.stop_token_id,
            stop_string=event.stop_string,
        )
    )


class TokenizerServicer(text_pb2_grpc.TokenizerServicer):
    def __init__(
        self,
        tokenizer: TextTokenizer,
        admission: Admission | None = None,
        *,
        max_input_chars: int = validation.DEFAULT_MAX_INPUT_CHARS,
        max_detokenize_ids: int = validation.DEFAULT_MAX_DETOKENIZE_IDS,
    ) -> None:
        self.tokenizer = tokenizer
        self.admission = admission or Admission()
        self.max_input_chars = max_input_chars
        self.max_detokenize_ids = max_detokenize_ids

    def _tokenize(self, request: text_pb2.TokenizeRequest, in_pieces: bool) -> text_pb2.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            ids = generation.encode_chat(self.tokenizer, chat_from_pb(request.chat))
        else:
            ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return _tokenize_response(ids, in_pieces)

    @grpc_errors
    async def Tokenize(self, request: text_pb2.TokenizeRequest, context):
        with self.admission.admit():
            if request.WhichOneof("input") == "chat":
                size = _chat_work_size(request.chat, self.max_input_chars)
            else:
                size = validation.text_chars("text", request.text, self.max_input_chars)
            return await _work(size, self._tokenize, request, size > INLINE_MAX)

    @grpc_errors
    async def Detokenize(self, request: text_pb2.DetokenizeRequest, context):
        with self.admission.admit():
            size = validation.id_count("token_ids", request.token_ids, self.max_detokenize_ids)
            text = await _work(size, _decode_in_pieces, self.tokenizer, request.token_ids, request.keep_special_tokens, "token_ids")
            return text_pb2.DetokenizeResponse(text=text)

    @grpc_errors
    async def DescribeChat(self, request: text_pb2.DescribeChatRequest, context):
        return chat_description(self.tokenizer)  # read at load: nothing to admit or wait for


# --- where the decode runs ---------------------------------------------------------------------

# A DecodeRequest (and the caller's remaining time) -> the engine's events, one list per decoder
# step: from the remote Decoder (gRPC) or, for `generate --local`, an in-process engine. Closing
# the iterator early must cancel the decode.
DecodeFn = Callable[[decode_pb2.DecodeRequest, "float | None"], AsyncGenerator[Sequence[Event], None]]


def engine_decode(engine: AsyncEngine, info: ModelInfo, constraints: ConstraintCompiler | None = None) -> DecodeFn:
    """The engine's events without a socket, validated as the Decoder validates them (constraints
    compiled by `constraints`; None: refused). The engine has no deadline of its own: `timeout`
    is not applied here."""

    def decode(request: decode_pb2.DecodeRequest, timeout: float | None):
        return engine.stream(validation.decode_request(request, info, constraints))

    return decode


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    def __init__(
        self,
        tokenizer: TextTokenizer,
        decode: DecodeFn,
        info: ModelInfo,
        admission: Admission | None = None,
        metrics: Metrics | None = None,
        *,
        max_input_chars: int = validation.DEFAULT_MAX_INPUT_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self.info = info
        self.admission = admission or Admission()
        self.metrics = metrics or Metrics()
        self.max_input_chars = max_input_chars
        # a request's constraint is compiled here first, against this service's own tokenizer
        # file (none: constraints are refused), so one that does not compile never reaches the decoder
        self.constraints = ConstraintCompiler(getattr(tokenizer, "tokenizer_json", None), info.vocab_size, info.eos_token_ids)

    def _prepare(self, request: text_pb2.GenerateRequest) -> generation.TextRequest:
        return prepare_request(
            self.tokenizer,
            self.info,
            prompt_from_pb(request),
            stop_strings=request.stop_strings,
            include_stop_string=request.include_stop_string,
            keep_special_tokens=request.keep_special_tokens,
            logprobs=request.logprobs,
        )

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        """The one generation path: Generate streams it, Complete collects it, `--local` runs it."""
        request_id = validation.request_id_of(request.request_id)
        kind = request.WhichOneof("input")
        if kind == "chat":  # the size, before any tokenizing
            size = _chat_work_size(request.chat, self.max_input_chars)
        elif kind == "prompt_token_ids":  # (counted as Detokenize counts ids; the context bounds them)
            size = len(request.prompt_token_ids.ids)
        else:
            size = validation.text_chars("prompt", request.prompt, self.max_input_chars)
        validation.top_logprobs(request.top_logprobs, request.logprobs, needs="logprobs")
        if request.HasField("constraint"):  # in a thread: the first one builds the vocabulary
            await asyncio.to_thread(validation.constraint, request, self.constraints)
        text_request = await _work(size, self._prepare, request)
        upstream = decode_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=text_request.prompt_token_ids,
            sampling=request.sampling,
            stopping=request.stopping,
            return_logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            constraint=request.constraint if request.HasField("constraint") else None,
        )
        # A DecoderFault (INTERNAL) or StreamEndedWithoutFinished (UNAVAILABLE) propagates to
        # services.errors, which maps it; the request log line carries the request id and code.
        steps = self.decode(upstream, timeout)
        async with contextlib.aclosing(generate_text(self.tokenizer.vocabulary, text_request, steps)) as events:
            async for event in events:
                yield response_to_pb(event)

    async def _served(self, request: text_pb2.GenerateRequest, context) -> AsyncIterator[text_pb2.GenerateResponse]:
        """`generate`, admitted (or UNAVAILABLE), timed and counted, with the client's deadline."""
        with self.admission.admit(), self.metrics.track(request.request_id) as tracker:
            request.request_id = tracker.request_id = validation.request_id_of(request.request_id)
            async with contextlib.aclosing(self.generate(request, context.time_remaining())) as responses:
                async for response in responses:
                    tracker.generate_response(response)
                    yield response

    @grpc_errors
    async def Generate(self, request, context):
        async with contextlib.aclosing(sent_together(self._served(request, context))) as responses:
            async for response in responses:
                yield response

    @grpc_errors
    async def Complete(self, request, context):
        return await collect(self._served(request, context))


async def collect(responses: AsyncIterator[text_pb2.GenerateResponse]) -> text_pb2.Completion:
    """A Generate stream collected into a Completion."""
    completion = text_pb2.Completion()
    async with contextlib.aclosing(responses):
        async for response in responses:
            if response.HasField("delta"):
                completion.text += response.delta.text
                completion.token_ids.extend(response.delta.token_ids)
                completion.logprobs.extend(response.delta.logprobs)
            else:
                f = response.finished
                completion.reason = f.reason
                completion.usage.CopyFrom(f.usage)
                if f.HasField("stop_token_id"):
                    completion.stop_token_id = f.stop_token_id
                if f.HasField("stop_string"):
                    completion.stop_string = f.stop_string
        return completion
