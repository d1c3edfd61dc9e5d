"""Fuzzing both services over real loopback servers: random, extreme and malformed requests.

One decode server (scripted model: after token t comes t + 1; vocabulary 512, EOS {0, 2}, a
32-token context so that every stream is short, a 2-deep queue so that bursts overflow it) and one
text server in front of it (tiny-llama's real tokenizer) are started once for the module.
Hypothesis then sends over 2,000 requests (the thorough profile; a quarter of that under "ci",
tests/conftest.py) to every RPC of both: fields in and out of range, extremes (uint32 max, NaN,
inf, huge caps, long, unicode and control-character request ids, empty, huge and many stop
strings, empty chat roles), arbitrary bytes as the request message, short deadlines, early
cancels, and concurrent bursts. Half the Decode requests, half the Generate requests and a third
of the Tokenize chats are in range by construction; a quarter of the Generate requests have one
field put out of range; the rest are anything at all.

What must hold for every request:
  * its status is OK or a deliberate refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE),
    or DEADLINE_EXCEEDED / CANCELLED where the client set a deadline / cancelled; never INTERNAL
    or UNKNOWN, and no details string carries a traceback;
  * bytes that do not parse as the request message are INVALID_ARGUMENT;
  * a Decode, Generate or Complete request, or a chat to Tokenize, is refused exactly when a field
    is out of range, naming such a field (`decode_problems`, `generate_problems`, `chat_problems`
    work out which by hand, from the documented limits, not from the services' own checks); one
    in range and sent without a deadline or cancel, alone, must be served (OK);
  * every stream obeys the stream invariants (tokens, then one Finished, last; usage equals the
    token count; no control id among the tokens) and, the model being scripted, carries exactly
    the tokens worked out by hand (a stream cut short: a prefix of them);
and at the end the servers still answer, the engine holds no slot and no queued request, the
model holds no slot, neither server counts a request in flight, and nothing of ours was logged at
ERROR (grpc's own notes aside: see the last test).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import operator
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
import pytest_asyncio
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2 as dpb
from protos.decode.v1 import decode_pb2_grpc
from protos.text.v1 import text_pb2 as tpb
from protos.text.v1 import text_pb2_grpc
from services.decode_server import DecodeServer, start_decode_server
from services.text_server import TextServer, start_text_server
from services.validation import MAX_REQUEST_ID_LENGTH
from support.examples import examples
from support.idle import until_nothing_held
from tokenizer_svc.chat import ChatMessage, ChatTemplateError
from tokenizer_svc.generation import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS
from tokenizer_svc.tokenizer import TextTokenizer

# pytest-asyncio runs each hypothesis example of an async test on the module's event loop, where
# the servers live.
pytestmark = pytest.mark.asyncio(loop_scope="module")

TINY = Path(__file__).parent / "assets" / "tiny-llama"
VOCAB, EOS, CONTEXT = 512, frozenset({0, 2}), 32
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
STOP, LENGTH = dpb.FINISH_REASON_STOP, dpb.FINISH_REASON_LENGTH
Code = grpc.StatusCode
REFUSALS = {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE}
CALL_LIMIT_S = 10.0  # no single call may take longer: a hang fails the example instead of the run
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SERVICES = {  # which server serves each service
    dpb.DESCRIPTOR.services_by_name["Decoder"]: "decode",
    tpb.DESCRIPTOR.services_by_name["Tokenizer"]: "text",
    tpb.DESCRIPTOR.services_by_name["TextGeneration"]: "text",
}
# Unary-request methods (DecodeStream's malformed messages: tests/test_transport.py)
METHODS = sorted(f"/{service.full_name}/{m.name}" for service in SERVICES for m in service.methods if not m.client_streaming)


def fuzz_examples(full: int) -> settings:
    """FUZZ, with `full` examples under the thorough profile and fewer under "ci" (conftest)."""
    return settings(FUZZ, max_examples=examples(full))


@functools.cache
def tiny_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(TINY)


# -- the stack --------------------------------------------------------------------------------


@dataclass(repr=False)
class Stack:
    decode: DecodeServer
    text: TextServer
    model: ScriptedModel
    tokenizer: TextTokenizer
    decoder: decode_pb2_grpc.DecoderStub
    tokenizer_rpc: text_pb2_grpc.TokenizerStub
    generation: text_pb2_grpc.TextGenerationStub
    raw: dict[str, tuple[Callable, Any]]  # method path -> (bytes-in bytes-out callable, request type)
    errors_logged: list[str] = field(default_factory=list)


class _ErrorLog(logging.Handler):
    """Keeps ERROR records as text only (a kept record would keep its traceback's frames alive)."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        kind = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        self.into.append(f"{record.name}: {record.getMessage()} {kind}")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack():
    model = ScriptedModel(vocab_size=VOCAB, eos_token_ids=EOS, max_batch_size=4, max_context_length=CONTEXT)
    tokenizer = tiny_tokenizer()
    decode = await start_decode_server(model, EngineConfig(max_queue_size=2))
    text = await start_text_server(tokenizer, f"127.0.0.1:{decode.port}")
    channels = {name: grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") for name, server in
                [("decode", decode), ("text", text)]}
    raw = {}
    for service, server in SERVICES.items():
        for method in (m for m in service.methods if not m.client_streaming):
            path = f"/{service.full_name}/{method.name}"
            kind = channels[server].unary_stream if method.server_streaming else channels[server].unary_unary
            call = kind(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            raw[path] = (call, message_factory.GetMessageClass(method.input_type))
    s = Stack(
        decode, text, model, tokenizer, decode_pb2_grpc.DecoderStub(channels["decode"]),
        text_pb2_grpc.TokenizerStub(channels["text"]), text_pb2_grpc.TextGenerationStub(channels["text"]), raw,
    )
    handler = _ErrorLog(s.errors_logged)
    logging.getLogger().addHandler(handler)
    try:
        yield s
        # After every test of this module, in whatever order they ran: the servers still serve,
        # and nothing the fuzzed calls did is still held.
        await answers_and_holds_nothing(s)
    finally:
        logging.getLogger().removeHandler(handler)
        for channel in channels.values():
            await channel.close()
        await text.stop(None)
        await decode.stop(None)


# -- calls ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """How the client treats a call: wait for its end, give it a deadline, or cancel it early."""

    timeout: float | None = None
    cancel_after: int | None = None  # responses read (stream) or loop turns waited (unary) first


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list


async def send(stack: Stack, method: Callable, request: Any, plan: Plan) -> Outcome:
    """Make one call, drive it as the plan says, and check its status (see the module docstring)."""
    async with asyncio.timeout(CALL_LIMIT_S):
        call = method(request, timeout=plan.timeout)
        responses = []
        if isinstance(call, grpc.aio.UnaryStreamCall):
            if plan.cancel_after == 0:
                call.cancel()
            else:
                try:
                    async for response in call:
                        responses.append(response)
                        if len(responses) == plan.cancel_after:
                            call.cancel()
                            break
                except grpc.aio.AioRpcError:
                    pass
        elif plan.cancel_after is not None:
            for _ in range(plan.cancel_after):
                await asyncio.sleep(0)
            call.cancel()
        code, details = await call.code(), await call.details() or ""
        if code == Code.OK and isinstance(call, grpc.aio.UnaryUnaryCall):
            responses.append(await call)
    allowed = {Code.OK, *REFUSALS}
    allowed |= {Code.DEADLINE_EXCEEDED} if plan.timeout is not None else set()
    allowed |= {Code.CANCELLED} if plan.cancel_after is not None else set()
    assert code in allowed, (code, details)
    assert "Traceback" not in details, details
    event(code.name)  # --hypothesis-show-statistics shows the mix of outcomes
    return Outcome(code, details, responses)


# -- what the contract says, worked out by hand --------------------------------------------------


def control_ids(stopping: dpb.StoppingCriteria) -> set[int]:
    return set(stopping.stop_token_ids) | (set() if stopping.ignore_eos else set(EOS))


def scripted_output(prompt: list[int], stopping: dpb.StoppingCriteria) -> tuple[list[int], int, int | None]:
    """(tokens, reason, stop_token_id) of a valid request: count up from the prompt's last id,
    skipping control ids while fewer than min_output_tokens were sent (engine/core/stopping.py)."""
    control = control_ids(stopping)
    room = CONTEXT - len(prompt)
    cap = min(stopping.max_output_tokens, room) if stopping.HasField("max_output_tokens") else room
    tokens, last = [], prompt[-1]
    while True:
        token = (last + 1) % VOCAB
        while len(tokens) < stopping.min_output_tokens and token in control:
            token = (token + 1) % VOCAB
        if token in control:
            return tokens, STOP, token
        tokens.append(token)
        last = token
        if len(tokens) >= cap:
            return tokens, LENGTH, None


def request_id_problems(request_id: str) -> set[str]:
    return {"request_id"} if len(request_id) > MAX_REQUEST_ID_LENGTH or not request_id.isprintable() else set()


def sampling_problems(sampling: dpb.SamplingParams) -> set[str]:
    problems = set()
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        problems.add("sampling.temperature")
    for name in ("top_p", "min_p"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and 0 <= value <= 1):
            problems.add(f"sampling.{name}")
    return problems


def stopping_problems(stopping: dpb.StoppingCriteria, prompt_length: int) -> set[str]:
    problems = set()
    room = CONTEXT - prompt_length
    if stopping.HasField("max_output_tokens") and not 1 <= stopping.max_output_tokens <= room:
        problems.add("stopping.max_output_tokens")
    problems |= {f"stopping.stop_token_ids[{i}]" for i, t in enumerate(stopping.stop_token_ids) if t >= VOCAB}
    cap = stopping.max_output_tokens if stopping.HasField("max_output_tokens") else room
    if stopping.min_output_tokens > cap:
        problems.add("stopping.min_output_tokens")
    return problems


def decode_problems(request: dpb.DecodeRequest) -> set[str]:
    """The fields of a DecodeRequest that are out of range (any one may be the one named)."""
    prompt = list(request.prompt_token_ids)
    problems = request_id_problems(request.request_id)
    if not prompt or len(prompt) >= CONTEXT:
        problems.add("prompt_token_ids")
    problems |= {f"prompt_token_ids[{i}]" for i, t in enumerate(prompt) if t >= VOCAB}
    return problems | sampling_problems(request.sampling) | stopping_problems(request.stopping, len(prompt))


def chat_messages(chat: tpb.Chat) -> tuple[tuple[ChatMessage, ...], bool]:
    """A Chat message as the tokenizer takes it: its messages, and add_generation_prompt (unset: True)."""
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return tuple(ChatMessage(m.role, m.content) for m in chat.messages), add


def _nesting(value) -> int:
    return 1 + max(map(_nesting, value.values() if isinstance(value, dict) else value), default=0) if isinstance(value, (dict, list)) else 0


def _tool_problems(chat: tpb.Chat) -> set[str]:
    """A tool with no name or parameters that are not a JSON object's text; any tool at all, since
    the fuzzed model's ChatML template shows none (the text service refuses `chat.tools` then)."""
    problems = set()
    for i, tool in enumerate(chat.tools):
        problems |= {"chat.tools"} | ({f"chat.tools[{i}].name"} if not tool.name else set())
        try:
            value = json.loads(tool.parameters) if tool.parameters else {}
            if not isinstance(value, dict) or _nesting(value) > 128:  # text.proto's limit
                raise ValueError
        except (ValueError, RecursionError):
            problems.add(f"chat.tools[{i}].parameters")
    return problems


def chat_problems(tokenizer: TextTokenizer, chat: tpb.Chat) -> set[str]:
    """The fields of a chat that are out of range: no messages, an empty role, a tool (see
    `_tool_problems`), or a message the tokenizer itself cannot encode as plain text
    (ChatTemplateError: tests/test_chat_forgery.py)."""
    tools = _tool_problems(chat)
    if not chat.messages:
        return {"chat.messages"} | tools
    problems = {f"chat.messages[{i}].role" for i, m in enumerate(chat.messages) if not m.role} | tools
    if not problems:
        try:
            tokenizer.encode_chat(*chat_messages(chat))
        except ChatTemplateError:
            problems.add("chat")
    return problems


def prompt_ids(tokenizer: TextTokenizer, request: tpb.GenerateRequest) -> list[int]:
    """The ids the text service makes of a request's input ([] for a chat with problems)."""
    if request.WhichOneof("input") != "chat":
        return tokenizer.encode(request.prompt)
    return [] if chat_problems(tokenizer, request.chat) else tokenizer.encode_chat(*chat_messages(request.chat))


def generate_problems(tokenizer: TextTokenizer, request: tpb.GenerateRequest) -> set[str]:
    """The fields of a GenerateRequest that are out of range (any one may be the one named): the
    input (no prompt, an empty one, a chat with problems, or too many ids for the context), the
    stop strings, and what the decoder checks of the request it is sent."""
    field = "chat" if request.WhichOneof("input") == "chat" else "prompt"
    problems = request_id_problems(request.request_id)
    if field == "chat":
        problems |= chat_problems(tokenizer, request.chat)
    prompt = prompt_ids(tokenizer, request)
    if not prompt or len(prompt) >= CONTEXT:
        problems.add(field)
    stops = request.stop_strings
    if len(stops) > MAX_STOP_STRINGS:
        problems.add("stop_strings")
    problems |= {f"stop_strings[{i}]" for i, s in enumerate(stops) if not 1 <= len(s) <= MAX_STOP_STRING_LENGTH}
    return problems | sampling_problems(request.sampling) | stopping_problems(request.stopping, len(prompt))


def check_refusal(outcome: Outcome, problems: set[str], plan: Plan, crowded: bool, request: Any) -> bool:
    """The oracle for refusals: INVALID_ARGUMENT names a field out of range; a request with one
    gets no response; one without, sent plainly and alone, is served. -> whether it is in range."""
    event("out of range" if problems else "in range")
    if outcome.code == Code.INVALID_ARGUMENT:
        assert outcome.details.split(":")[0] in problems, (
            f"refused for a field in range: {outcome.details!r} (out of range: {sorted(problems)})\n{request}")
    if problems:
        assert outcome.code != Code.OK and not outcome.responses, (sorted(problems), request)
        if plan == Plan() and not crowded:
            assert outcome.code == Code.INVALID_ARGUMENT, (outcome.code, outcome.details, sorted(problems))
        return False
    if plan == Plan() and not crowded:
        assert outcome.code == Code.OK, f"a request in range was not served: {outcome.code.name} {outcome.details!r}\n{request}"
    return True


def check_decode(outcome: Outcome, request: dpb.DecodeRequest, plan: Plan, crowded: bool = False) -> None:
    """A Decode call's status against the request's problems, and its stream against the invariants."""
    if not check_refusal(outcome, decode_problems(request), plan, crowded, request):
        return
    assert all(r.events for r in outcome.responses), "an empty DecodeResponse"
    events = [e for r in outcome.responses for e in r.events]
    kinds = [e.WhichOneof("event") for e in events]
    assert "finished" not in kinds[:-1], kinds
    complete = kinds[-1:] == ["finished"]  # a cancel may still land after the last response
    assert complete or outcome.code != Code.OK, kinds
    tokens = [e.token for e in events if e.HasField("token")]
    assert all(t.HasField("logprob") == request.return_logprobs for t in tokens)
    expected, reason, stop_id = scripted_output(list(request.prompt_token_ids), request.stopping)
    assert [t.id for t in tokens] == expected[: len(tokens)]
    assert not {t.id for t in tokens} & control_ids(request.stopping)
    if complete:
        finished = events[-1].finished
        assert [t.id for t in tokens] == expected
        assert (finished.reason, finished.stop_token_id if finished.HasField("stop_token_id") else None) == (
            reason, stop_id)
        assert finished.usage.completion_tokens == len(tokens)
        assert finished.usage.prompt_tokens == len(request.prompt_token_ids)


def check_text(text: str, ids: list[int], end, request: tpb.GenerateRequest, prompt: list[int]) -> None:
    """A whole generation (Generate's stream joined, or a Completion) against the text contract.
    `end` is its TextFinished or Completion: both carry reason, usage, stop_token_id, stop_string."""
    assert end.reason in (STOP, LENGTH)
    assert end.usage.completion_tokens == len(ids) and end.usage.prompt_tokens == len(prompt)
    expected, reason, stop_id = scripted_output(prompt, request.stopping)
    stops = list(request.stop_strings)
    if end.HasField("stop_string"):
        event("stop string matched")
        assert end.reason == STOP and end.stop_string in stops and not end.HasField("stop_token_id")
        assert ids == expected[: len(ids)]
        if request.include_stop_string:
            assert text.endswith(end.stop_string)
        text = text[:-1] if request.include_stop_string else text
    else:
        assert ids == expected and end.reason == reason
        assert (end.stop_token_id if end.HasField("stop_token_id") else None) == stop_id
    assert not any(stop in text for stop in stops), (text, stops)  # it would have matched earlier


def check_generate(
    stack: Stack, outcome: Outcome, request: tpb.GenerateRequest, streamed: bool, plan: Plan, crowded: bool = False
) -> None:
    """A Generate or Complete call's status against the request's problems, and its text against the contract."""
    if not check_refusal(outcome, generate_problems(stack.tokenizer, request), plan, crowded, request):
        return
    if not outcome.responses:
        return
    prompt = prompt_ids(stack.tokenizer, request)
    if not streamed:
        completion = outcome.responses[0]
        check_text(completion.text, list(completion.token_ids), completion, request, prompt)
        return
    kinds = [r.WhichOneof("event") for r in outcome.responses]
    assert "finished" not in kinds[:-1], kinds
    assert kinds[-1] == "finished" or outcome.code != Code.OK, kinds
    deltas = [r.delta for r in outcome.responses if r.HasField("delta")]
    ids = [i for d in deltas for i in d.token_ids]
    if ids:  # then the request was valid, and a stream cut short is a prefix of the whole
        assert ids == scripted_output(prompt, request.stopping)[0][: len(ids)]
    if kinds[-1] == "finished":
        check_text("".join(d.text for d in deltas), ids, outcome.responses[-1].finished, request, prompt)


# -- strategies ---------------------------------------------------------------------------------

valid_ids = st.integers(0, VOCAB - 1)
any_ids = st.one_of(valid_ids, st.sampled_from([0, 2, VOCAB - 1, VOCAB, 2**31, UINT32_MAX]), st.integers(0, UINT32_MAX))
any_floats = st.one_of(
    st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38])
)
printable = st.characters(categories=["L", "N", "P", "S"])
any_text = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(categories=["Cc", "Cf", "Zl", "Zp"]), min_size=1, max_size=4),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "{{ messages }}", "{% raise %}", "\x00", "🙂" * 9]),
    st.builds(operator.mul, st.text(min_size=1, max_size=3), st.integers(40, 100)),  # long: 40 to 300 characters
)
plans = st.one_of(
    st.just(Plan()), st.builds(Plan, timeout=st.floats(0.0005, 0.01)), st.builds(Plan, cancel_after=st.integers(0, 4))
)


@st.composite
def sampling_params(draw, wild: bool) -> dpb.SamplingParams:
    unit, floats = st.floats(0, 1, width=32), any_floats if wild else st.floats(0, 100, width=32)
    return dpb.SamplingParams(
        temperature=draw(floats), top_k=draw(st.integers(0, UINT32_MAX)), top_p=draw(any_floats if wild else unit),
        min_p=draw(any_floats if wild else unit), seed=draw(st.none() | st.integers(0, UINT64_MAX)),
    )


@st.composite
def stopping_criteria(draw, wild: bool, room: int = CONTEXT - 8) -> dpb.StoppingCriteria:
    """Anywhere (wild), or in range for a prompt that leaves `room` (at least 2) tokens of output."""
    if wild:
        caps = st.none() | st.integers(0, 10) | st.sampled_from([CONTEXT - 1, CONTEXT, 2**31, UINT32_MAX])
        max_output = draw(caps)
        return dpb.StoppingCriteria(
            max_output_tokens=max_output, stop_token_ids=draw(st.lists(any_ids, max_size=6)),
            ignore_eos=draw(st.booleans()), min_output_tokens=draw(st.integers(0, 4) | st.just(UINT32_MAX)),
        )
    max_output = draw(st.sampled_from([None, *range(1, min(8, room) + 1)]))
    return dpb.StoppingCriteria(
        max_output_tokens=max_output, stop_token_ids=draw(st.lists(valid_ids, max_size=3)),
        ignore_eos=draw(st.booleans()), min_output_tokens=draw(st.integers(0, min(max_output or 2, 2))),
    )


@st.composite
def decode_requests(draw) -> dpb.DecodeRequest:
    """Half in range (a stream is expected), half anywhere (mostly refused)."""
    wild = draw(st.booleans())
    prompt = st.lists(any_ids, max_size=CONTEXT + 4) if wild else st.lists(valid_ids, min_size=1, max_size=8)
    return dpb.DecodeRequest(
        request_id=draw(any_text if wild else st.text(printable, max_size=32)),
        prompt_token_ids=draw(prompt),
        sampling=draw(sampling_params(wild)),
        stopping=draw(stopping_criteria(wild)),
        return_logprobs=draw(st.booleans()),
    )


@st.composite
def chats(draw, wild: bool, max_messages: int = 1) -> tpb.Chat:
    """Anywhere (wild), or in range: 1 to `max_messages` messages with a role the template knows."""
    roles = st.one_of(st.sampled_from(["user", "assistant", "system", "", "tool"]), st.text(max_size=8))
    messages = st.lists(
        st.builds(tpb.ChatMessage, role=roles if wild else st.sampled_from(["user", "assistant", "system"]),
                  content=any_text if wild else st.text(printable, max_size=4)),
        min_size=0 if wild else 1, max_size=4 if wild else max_messages,
    )
    return tpb.Chat(messages=draw(messages), add_generation_prompt=draw(st.none() | st.booleans()))


@st.composite
def valid_generate_requests(draw) -> tpb.GenerateRequest:
    """In range by construction (generate_problems finds nothing; test_the_strategies_say_what_they_make
    checks it), so the service must serve it: a short prompt or a one-message chat, an output cap
    that fits the room the prompt leaves, and 1 to 3 short printable stop strings, often one cut
    from the request's own (scripted) output text, so that stop strings match, across token
    boundaries too."""
    request = tpb.GenerateRequest(
        request_id=draw(st.text(printable, max_size=32)),
        sampling=draw(sampling_params(wild=False)),
        keep_special_tokens=draw(st.booleans()),
        include_stop_string=draw(st.booleans()),
    )
    if draw(st.booleans()):
        request.prompt = draw(st.text(printable, min_size=1, max_size=6))
    else:
        request.chat.CopyFrom(draw(chats(wild=False)))
    prompt = prompt_ids(tiny_tokenizer(), request)
    assume(len(prompt) <= CONTEXT - 2)  # rare: a chat of characters that take several ids each
    request.stopping.CopyFrom(draw(stopping_criteria(wild=False, room=CONTEXT - len(prompt))))
    request.stop_strings.extend(draw(st.lists(st.text(string.printable, min_size=1, max_size=2), max_size=3)))
    if draw(st.booleans()):
        output = tiny_tokenizer().decode(scripted_output(prompt, request.stopping)[0], request.keep_special_tokens)
        start = draw(st.integers(0, max(len(output) - 1, 0)))
        request.stop_strings.append(output[start : start + draw(st.integers(1, 4))] or "x")
    return request


def _out_of_range(request: tpb.GenerateRequest, field: str, value) -> tpb.GenerateRequest:
    """A copy of `request` with `field` (a path of message fields) set to `value`."""
    broken = tpb.GenerateRequest()
    broken.CopyFrom(request)
    *path, name = field.split(".")
    target = functools.reduce(getattr, path, broken)
    if isinstance(value, list):
        target.ClearField(name)
        getattr(target, name).extend(value)
    else:
        setattr(target, name, value)
    return broken


@st.composite
def invalid_generate_requests(draw) -> tuple[str, tpb.GenerateRequest]:
    """A request in range with one field put out of range: -> (that field, the request)."""
    request = draw(valid_generate_requests())
    stops = list(request.stop_strings)
    defects = {
        "request_id": st.sampled_from(["x" * (MAX_REQUEST_ID_LENGTH + 1), "a\nb", "\x00"]),
        "prompt": st.sampled_from(["", "word " * CONTEXT]),
        "stop_strings": st.just(["s"] * (MAX_STOP_STRINGS + 1)),
        "stop_strings[i]": st.sampled_from(["", "x" * (MAX_STOP_STRING_LENGTH + 1)]),
        "sampling.temperature": st.sampled_from([-1.0, math.nan, math.inf]),
        "sampling.top_p": st.sampled_from([1.5, -0.5, math.nan]),
        "sampling.min_p": st.sampled_from([2.0, -1.0, math.inf]),
        "stopping.max_output_tokens": st.sampled_from([0, CONTEXT, UINT32_MAX]),
        "stopping.stop_token_ids[i]": st.sampled_from([VOCAB, UINT32_MAX]),
        "stopping.min_output_tokens": st.just(CONTEXT),
        "chat.messages": st.just([]),
        "chat.messages[i].role": st.just(""),
    }
    field = draw(st.sampled_from(sorted(defects)))
    value = draw(defects[field])
    match field:
        case "stop_strings[i]":
            at = draw(st.integers(0, len(stops)))
            field, value = f"stop_strings[{at}]", [*stops[:at], value, *stops[at:]]
            return field, _out_of_range(request, "stop_strings", value)
        case "stopping.stop_token_ids[i]":
            ids = list(request.stopping.stop_token_ids)
            field = f"stopping.stop_token_ids[{len(ids)}]"
            return field, _out_of_range(request, "stopping.stop_token_ids", [*ids, value])
        case "chat.messages" | "chat.messages[i].role":
            chat = draw(chats(wild=False))
            if value == []:
                del chat.messages[:]
            else:
                chat.messages[0].role = value
                field = "chat.messages[0].role"
            broken = _out_of_range(request, "prompt", "")
            broken.chat.CopyFrom(chat)
            return field, broken
    return field, _out_of_range(request, field, value)


@st.composite
def wild_generate_requests(draw) -> tpb.GenerateRequest:
    """Anything at all: extremes and odd text in every field (mostly refused)."""
    request = tpb.GenerateRequest(
        request_id=draw(any_text),
        sampling=draw(sampling_params(wild=True)),
        stopping=draw(stopping_criteria(wild=True)),
        keep_special_tokens=draw(st.booleans()),
        include_stop_string=draw(st.booleans()),
    )
    match draw(st.sampled_from(["prompt", "chat", "none"])):
        case "prompt":
            request.prompt = draw(any_text)
        case "chat":
            request.chat.CopyFrom(draw(chats(wild=True)))
    odd = st.sampled_from(["", "x" * 256, "y" * 257, "🙂" * 257])
    request.stop_strings.extend(draw(st.lists(st.text(max_size=4) | odd, max_size=20)))
    return request


generate_requests = st.one_of(  # half in range, a quarter with one field out of range, a quarter anything
    valid_generate_requests(), valid_generate_requests(),
    invalid_generate_requests().map(operator.itemgetter(1)), wild_generate_requests(),
)
valid_chats = chats(wild=False, max_messages=4)
tokenize_requests = st.one_of(
    st.builds(tpb.TokenizeRequest, text=any_text, add_special_tokens=st.booleans()),
    st.builds(tpb.TokenizeRequest, chat=valid_chats, add_special_tokens=st.booleans()),
    st.builds(tpb.TokenizeRequest, chat=chats(wild=True), add_special_tokens=st.booleans()),
)
detokenize_requests = st.builds(
    tpb.DetokenizeRequest, token_ids=st.lists(st.one_of(valid_ids, any_ids), max_size=20),
    keep_special_tokens=st.booleans(),
)
REQUESTS = {  # request type -> well-formed messages of it, for corrupting
    dpb.DecodeRequest: decode_requests(),
    dpb.GetModelInfoRequest: st.just(dpb.GetModelInfoRequest()),
    tpb.DescribeChatRequest: st.just(tpb.DescribeChatRequest()),
    tpb.TokenizeRequest: tokenize_requests,
    tpb.DetokenizeRequest: detokenize_requests,
    tpb.GenerateRequest: generate_requests,
}


@st.composite
def corrupted(draw, messages) -> bytes:
    """A serialized message cut short, with a byte flipped, or with bytes spliced in."""
    raw = bytearray(draw(messages).SerializeToString())
    at = draw(st.integers(0, len(raw)))
    how = draw(st.sampled_from(["cut", "flip", "splice"]))
    if how == "cut":
        return bytes(raw[:at])
    if how == "flip" and at < len(raw):
        raw[at] ^= draw(st.integers(1, 255))
        return bytes(raw)
    return bytes(raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:])


# -- the fuzz tests -------------------------------------------------------------------------------


@fuzz_examples(100)
@given(data=st.data())
async def test_the_strategies_say_what_they_make(data):
    """The oracle's own check, without a server: what the strategies make in range has no problem
    by the hand-worked rules, and a request with one field put out of range has that problem."""
    tokenizer = tiny_tokenizer()
    request = data.draw(valid_generate_requests(), label="in range")
    assert generate_problems(tokenizer, request) == set(), request
    chat = data.draw(valid_chats, label="chat in range")
    assert chat_problems(tokenizer, chat) == set(), chat
    field, broken = data.draw(invalid_generate_requests(), label="out of range")
    assert field in generate_problems(tokenizer, broken), (field, broken)


@fuzz_examples(750)
@given(request=decode_requests(), plan=plans)
async def test_decode(stack, request, plan):
    check_decode(await send(stack, stack.decoder.Decode, request, plan), request, plan)


@fuzz_examples(750)
@given(request=generate_requests, plan=plans, streamed=st.booleans())
async def test_generate_and_complete(stack, request, plan, streamed):
    method = stack.generation.Generate if streamed else stack.generation.Complete
    check_generate(stack, await send(stack, method, request, plan), request, streamed, plan)


@fuzz_examples(300)
@given(request=st.one_of(tokenize_requests, detokenize_requests), plan=plans)
async def test_tokenize_and_detokenize(stack, request, plan):
    if isinstance(request, tpb.TokenizeRequest):
        outcome = await send(stack, stack.tokenizer_rpc.Tokenize, request, plan)
        if request.WhichOneof("input") == "text":  # any text tokenizes
            assert outcome.code != Code.INVALID_ARGUMENT, outcome.details
            if outcome.code == Code.OK:
                expected = stack.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
                assert list(outcome.responses[0].token_ids) == expected
        elif check_refusal(outcome, chat_problems(stack.tokenizer, request.chat), plan, False, request):
            if outcome.code == Code.OK:
                expected = stack.tokenizer.encode_chat(*chat_messages(request.chat))
                assert list(outcome.responses[0].token_ids) == expected
        return
    outcome = await send(stack, stack.tokenizer_rpc.Detokenize, request, plan)
    out_of_range = any(i >= VOCAB for i in request.token_ids)
    assert outcome.code in ({Code.INVALID_ARGUMENT} if out_of_range else {Code.OK}) | {
        Code.DEADLINE_EXCEEDED, Code.CANCELLED}, (outcome.code, outcome.details)
    if outcome.code == Code.OK:
        expected = stack.tokenizer.decode(list(request.token_ids), request.keep_special_tokens)
        assert outcome.responses[0].text == expected


@fuzz_examples(40)
@given(calls=st.lists(st.tuples(st.one_of(decode_requests(), generate_requests), plans), min_size=5, max_size=14))
async def test_concurrent_bursts(stack, calls):
    """Up to 14 at once on 4 slots and a queue of 2, with slow steps so that they overlap: some are
    RESOURCE_EXHAUSTED, and the others still get exactly their own tokens."""

    async def one(request, plan):
        if isinstance(request, dpb.DecodeRequest):
            check_decode(await send(stack, stack.decoder.Decode, request, plan), request, plan, crowded=True)
        else:
            check_generate(stack, await send(stack, stack.generation.Generate, request, plan), request, True, plan, crowded=True)

    stack.model.step_delay_s = 0.003
    try:
        await asyncio.gather(*(one(request, plan) for request, plan in calls))
    finally:
        stack.model.step_delay_s = 0.0


@fuzz_examples(300)
@given(method=st.sampled_from(METHODS), data=st.data(), plan=plans)
async def test_arbitrary_bytes_as_the_request_message(stack, method, data, plan):
    """Malformed protobuf must be refused as INVALID_ARGUMENT; bytes that parse are served."""
    call, request_type = stack.raw[method]
    payload = data.draw(st.one_of(st.binary(max_size=48), corrupted(REQUESTS[request_type])), label="payload")
    outcome = await send(stack, call, payload, plan)
    try:
        request = request_type.FromString(payload)
    except DecodeError:
        assert outcome.code in {Code.INVALID_ARGUMENT, Code.DEADLINE_EXCEEDED, Code.CANCELLED}, (
            outcome.code, outcome.details)
        return
    if request_type is dpb.DecodeRequest:
        outcome.responses = [dpb.DecodeResponse.FromString(r) for r in outcome.responses]
        check_decode(outcome, request, plan)
    elif request_type is tpb.GenerateRequest:
        streamed = method.endswith("/Generate")
        response_type = tpb.GenerateResponse if streamed else tpb.Completion
        outcome.responses = [response_type.FromString(r) for r in outcome.responses]
        check_generate(stack, outcome, request, streamed, plan)


async def test_servers_still_answer_and_hold_nothing(stack):
    """Whatever ran before it (in any order), both servers serve and no request holds anything.
    The stack fixture makes the same check once more after every test of this module."""
    await answers_and_holds_nothing(stack)


async def answers_and_holds_nothing(stack: Stack) -> None:
    info = await stack.decoder.GetModelInfo(dpb.GetModelInfoRequest())
    assert (info.vocab_size, info.max_context_length, set(info.eos_token_ids)) == (VOCAB, CONTEXT, EOS)
    request = dpb.DecodeRequest(prompt_token_ids=[300], stopping=dpb.StoppingCriteria(max_output_tokens=3))
    responses = [r async for r in stack.decoder.Decode(request)]
    assert [e.token.id for r in responses for e in r.events if e.HasField("token")] == [301, 302, 303]
    completion = await stack.generation.Complete(tpb.GenerateRequest(
        prompt="hello", stopping=dpb.StoppingCriteria(max_output_tokens=2, ignore_eos=True)))
    assert completion.reason == LENGTH and completion.usage.completion_tokens == 2
    assert (await stack.tokenizer_rpc.Tokenize(tpb.TokenizeRequest(text="hello"))).token_ids
    await until_nothing_held(stack.decode, stack.text, stack.model)  # cancels reach the engine asynchronously
    assert stack.decode.engine.stats().alive
    # Logged by grpc itself, not errors of ours: a request message that does not parse (see
    # test_arbitrary_bytes_as_the_request_message), and a send that lost the race with the client's
    # cancel or deadline ("ExecuteBatchError raised in core", grpc/grpc#32551).
    benign = ("DecodeError", "ExecuteBatchError")
    assert [e for e in stack.errors_logged if not any(b in e for b in benign)] == []
