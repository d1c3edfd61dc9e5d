"""Validation at the edge: protobuf request -> the engine's own `Request`, or InvalidArgument.

Everything out of range is refused here, naming the field, before the engine sees it (JAX
silently clamps out-of-range ids and positions, so nothing downstream would notice). The text
service's size limits are here too: they are checked before any text is tokenized.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import TYPE_CHECKING

from engine.core.constrained import ConstraintCompiler
from engine.core.model import ModelInfo

if TYPE_CHECKING:
    from engine.constraints.matcher import Grammar
from engine.core.request import MAX_TOP_LOGPROBS, Request, SamplingParams, StoppingCriteria
from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2
from engine.core.errors import InvalidArgument, check_token_ids

MAX_REQUEST_ID_LENGTH = 128

# --- the text service's input limits, checked before any tokenizing ----------------------------

# Characters of text input (a prompt, Tokenize text, a chat's roles, contents and tools summed).
# 1 Mi characters: a 128 Ki-token context (the largest common one) at 8 characters per token
# (generous: English BPE averages about 4), which bounds the CPU one request's tokenizing takes
# (docs/benchmarks.md, 'Figures behind code comments').
DEFAULT_MAX_INPUT_CHARS = 1024 * 1024
# Ids in one Detokenize: enough for any context and for a Tokenize of the largest input above.
DEFAULT_MAX_DETOKENIZE_IDS = 1024 * 1024
# Messages in one chat, checked before they are even read: each costs a template turn (about 30
# tokens of markup in common templates), so 4096 of them alone fill a 128 Ki-token context.
MAX_CHAT_MESSAGES = 4096


def _over(count: int, what: str, limit: int) -> str:
    return f"{count} {what} is over the limit of {limit}"


def text_chars(field: str, text: str, limit: int) -> int:
    """len(text), or InvalidArgument naming `field` when it is over `limit` characters."""
    if len(text) > limit:
        raise InvalidArgument(field, _over(len(text), "characters", limit))
    return len(text)


def chat_chars(chat: text_pb2.Chat, limit: int, field: str = "chat.messages") -> int:
    """The characters of a chat's roles and contents and its tools' texts, summed (what its
    template renders besides its own markup); InvalidArgument naming `field` when there are more
    than MAX_CHAT_MESSAGES messages or more than `limit` characters."""
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument(field, _over(len(chat.messages), "messages", MAX_CHAT_MESSAGES))
    total = sum(len(m.role) + len(m.content) for m in chat.messages)
    total += sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    if total > limit:
        what = "roles, contents and tools" if chat.tools else "roles and contents"
        raise InvalidArgument(field, _over(total, f"characters ({what} summed)", limit))
    return total


def id_count(field: str, ids, limit: int) -> int:
    """len(ids), or InvalidArgument naming `field` when there are more than `limit`."""
    if len(ids) > limit:
        raise InvalidArgument(field, _over(len(ids), "ids", limit))
    return len(ids)


def request_id_of(given: str) -> str:
    """The request's id, checked, or a new one: 128 random bits in hex, from `random` (ids need to
    be unique, not secret; `uuid4` reads os.urandom, a call that releases the GIL, and on the text
    service's event loop it then waited to take it back, far longer than the call itself takes:
    docs/benchmarks.md, 'Figures behind code comments')."""
    if len(given) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_LENGTH} characters (got {len(given)})")
    if given and not given.isprintable():
        raise InvalidArgument("request_id", "must be printable text")
    return given or f"{random.getrandbits(128):032x}"


def _unit_interval(field: str, value: float, *, zero_ok: bool = True) -> None:
    if not math.isfinite(value) or value < 0 or value > 1 or (value == 0 and not zero_ok):
        raise InvalidArgument(field, f"must be in [0, 1] (got {value})")


def sampling_params(pb: decode_pb2.SamplingParams, info: ModelInfo) -> SamplingParams:
    if not math.isfinite(pb.temperature) or pb.temperature < 0:
        raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0 (got {pb.temperature})")
    _unit_interval("sampling.top_p", pb.top_p)
    _unit_interval("sampling.min_p", pb.min_p)
    return SamplingParams(
        temperature=pb.temperature,
        top_k=min(pb.top_k, info.vocab_size),
        top_p=pb.top_p or 1.0,  # 0 is proto3's "unset": no nucleus cut
        min_p=pb.min_p,
        seed=pb.seed if pb.HasField("seed") else None,
    )


def stopping_criteria(pb: decode_pb2.StoppingCriteria, prompt_len: int, info: ModelInfo) -> StoppingCriteria:
    room = info.max_context_length - prompt_len
    max_output: int | None = None
    if pb.HasField("max_output_tokens"):
        max_output = pb.max_output_tokens
        if max_output < 1:
            raise InvalidArgument("stopping.max_output_tokens", "must be >= 1 (unset it for no cap)")
        if max_output > room:
            raise InvalidArgument(
                "stopping.max_output_tokens",
                f"prompt ({prompt_len} tokens) + max_output_tokens ({max_output}) exceeds the "
                f"context length ({info.max_context_length})",
            )
    check_token_ids(pb.stop_token_ids, info.vocab_size, "stopping.stop_token_ids")
    cap = room if max_output is None else max_output
    if pb.min_output_tokens > cap:
        raise InvalidArgument(
            "stopping.min_output_tokens",
            f"{pb.min_output_tokens} is more than the most tokens this request can produce ({cap})",
        )
    return StoppingCriteria(max_output, frozenset(pb.stop_token_ids), pb.ignore_eos, pb.min_output_tokens)


def top_logprobs(count: int, logprobs: bool, field: str = "top_logprobs", needs: str = "return_logprobs") -> int:
    """How many alternatives each token reports: 0..MAX_TOP_LOGPROBS, and above 0 only with
    `needs` set; else InvalidArgument naming `field`."""
    if count > MAX_TOP_LOGPROBS:
        raise InvalidArgument(field, f"at most {MAX_TOP_LOGPROBS} (got {count})")
    if count and not logprobs:
        raise InvalidArgument(field, f"needs {needs}")
    return count


# Characters of a constraint's text (a schema, a regex, a grammar): the text input limit above.
MAX_CONSTRAINT_CHARS = DEFAULT_MAX_INPUT_CHARS


def constraint(pb: decode_pb2.DecodeRequest | text_pb2.GenerateRequest, compiler: ConstraintCompiler | None) -> Grammar | None:
    """The request's `constraint` compiled against the served vocabulary (None when unset), or
    InvalidArgument naming the field: one that does not compile, a json_object that is false,
    one over MAX_CONSTRAINT_CHARS, any constraint with stopping.ignore_eos (the constraint decides
    where EOS may come), and any constraint where nothing can compile one (`compiler` None or
    without a tokenizer)."""
    if not pb.HasField("constraint"):
        return None
    kind = pb.constraint.WhichOneof("kind")
    if kind is None:
        return None  # an empty Constraint message: as unset
    field = f"constraint.{kind}"
    if kind == "json_object":
        if not pb.constraint.json_object:
            raise InvalidArgument(field, "must be true when set (unset the constraint for free output)")
        text = ""
    else:
        text = getattr(pb.constraint, kind)
        text_chars(field, text, MAX_CONSTRAINT_CHARS)
    if pb.stopping.ignore_eos:
        raise InvalidArgument("stopping.ignore_eos", "cannot be set with a constraint, which decides where EOS may come")
    if compiler is None:
        compiler = ConstraintCompiler(None, 0, frozenset())
    from engine.constraints.spec import Constraint

    return compiler.compile(Constraint(kind, text), field)


def decode_request(pb: decode_pb2.DecodeRequest, info: ModelInfo, constraints: ConstraintCompiler | None = None) -> Request:
    """Validate a DecodeRequest against the served model and convert it; its constraint is
    compiled by `constraints` (None: the service has no tokenizer, and refuses one)."""
    request_id = request_id_of(pb.request_id)
    prompt = info.check_prompt(pb.prompt_token_ids, "prompt_token_ids")
    sampling = sampling_params(pb.sampling, info)
    top = top_logprobs(pb.top_logprobs, pb.return_logprobs)
    stopping = stopping_criteria(pb.stopping, len(prompt), info)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=dataclasses.replace(sampling, top_logprobs=min(top, info.vocab_size)),
        stopping=stopping,
        return_logprobs=pb.return_logprobs,
        constraint=constraint(pb, constraints),
    )
