"""The text-generation use case: a prompt in, text deltas and one finish out, over any decoder.

Data flow, per request:
  1. `prepare_request`: prompt text or a `Chat` -> prompt ids (a chat through the model's
     template), checked against the served model (`ModelInfo`), and the stop strings checked
     against their limits. Anything wrong is InvalidArgument naming the request field.
  2. The caller starts a decode of those ids (a remote Decoder or an in-process engine) and gives
     its stream to `generate_text`: lists of engine events, one list per decoder step, Tokens
     and, last in the last list, Finished -- what `AsyncEngine.stream` yields.
  3. `generate_text`: each step's ids go through the request's `TextStream` (the incremental
     detokenizer, then the stop-string matcher, one id at a time) -> a `TextDelta` whenever there
     are ids or text -> one `TextFinished` at the decoder's Finished or at a stop string, and the
     stream ends there.

What holds:
  * Usage: completion_tokens is the number of ids delivered in deltas -- every id the decoder
    sent, or after a stop string exactly the ids up to and including the one that completed it;
    prompt_tokens is the number of prompt ids.
  * Accounting: the decoder's Finished counts the ids it sent, else AccountingMismatch; an id
    the tokenizer does not have is UnknownTokenId. Both are DecoderFault: the decoder broke its
    contract, not the caller.
  * Finish: a stop string gives reason STOP with `stop_string` set and no `stop_token_id`;
    otherwise the decoder's reason and `stop_token_id` pass through.
  * Cancellation: leaving `generate_text` (a stop string, the caller closing it early, an error)
    closes the upstream iterator, which is how the decode is cancelled. An upstream that ends
    without Finished raises StreamEndedWithoutFinished.
  * Logprobs (TextRequest.logprobs): each delivered id comes with a TokenLogprob: its logprob and
    alternatives as the decoder sent them, its own bytes, and the text the detokenizer produced
    for it (a flushed tail goes to the last id), so the texts of all ids joined equal the output
    unless a stop string cut it. A token without a logprob is MissingLogprob (a DecoderFault).
  * State: the request's TextStream, bounded, dropped when the generator ends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Sequence

from engine.core.errors import DecoderFault, InvalidArgument, StreamEndedWithoutFinished
from engine.core.events import Event, Finished, FinishReason, Token, Usage
from engine.core.model import ModelInfo
from tokenizer_svc.chat import ChatMessage, ChatTemplateError
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.stop_strings import StopStringMatcher
from tokenizer_svc.text_stream import TextChunk, TextStream
from tokenizer_svc.tokenizer import TextTokenizer
from tokenizer_svc.vocabulary import Vocabulary

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256


# --- what goes in and out ----------------------------------------------------------------------


@dataclass(frozen=True)
class Chat:
    """A conversation, rendered with the model's chat template."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    # functions the model may call, as the template's `tools` variable (JSON values: OpenAI's
    # {"type": "function", "function": {...}}); only for a template that shows them itself
    tools: tuple[dict, ...] = ()


@dataclass(frozen=True)
class TextRequest:
    """One generation's text side, already validated: all `generate_text` needs but the decode."""

    prompt_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...] = ()
    include_stop_string: bool = False  # keep the matched stop string at the end of the text
    keep_special_tokens: bool = False  # show special tokens' text (control tokens never arrive)
    logprobs: bool = False  # each delivered id with its logprob (the decode must carry them)


@dataclass(frozen=True)
class Alternative:
    """One of a step's most likely ids, named by its own text and bytes."""

    id: int
    text: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's logprob. `text` is what this token added to the output (the
    detokenizer's piece), so the texts joined equal the output unless a stop string cut it."""

    text: str
    bytes: bytes  # the token's own bytes (Vocabulary.raw_bytes)
    logprob: float
    top_logprobs: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    text: str  # final text; "" when the ids gave none yet (part of a character, skipped specials)
    token_ids: tuple[int, ...]  # the ids delivered with it; () when only the end flush had text
    logprobs: tuple[TokenLogprob, ...] = ()  # with TextRequest.logprobs: one per id of token_ids


@dataclass(frozen=True)
class TextFinished:
    reason: FinishReason
    usage: Usage
    stop_token_id: int | None = None  # the decoder's control token, when one ended generation
    stop_string: str | None = None  # the stop string, when one ended it (reason STOP)


TextEvent = TextDelta | TextFinished


class AccountingMismatch(DecoderFault):
    """The decoder's Finished counts a different number of tokens than it sent."""

    def __init__(self, counted: int, received: int) -> None:
        super().__init__(
            f"token accounting mismatch with the decoder: it counted {counted} tokens, {received} were received"
        )
        self.counted, self.received = counted, received


class UnknownTokenId(DecoderFault):
    """The decoder sent an id this tokenizer does not have (e.g. from a padded model vocabulary)."""


class MissingLogprob(DecoderFault):
    """Logprobs were asked for, and the decoder sent a token without one."""


# --- the prompt --------------------------------------------------------------------------------


def encode_chat(tokenizer: TextTokenizer, chat: Chat) -> list[int]:
    """The chat's prompt ids (`TextTokenizer.encode_chat`: special-token text in a message is plain
    text). InvalidArgument for no messages, an empty role, no template, a template that raised
    (its message is kept), a message the tokenizer cannot encode without a special token, or
    tools for a template that does not show them (they would vanish from the prompt unseen)."""
    if not chat.messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
    if chat.tools and not tokenizer.tool_template.renders_tools:
        raise InvalidArgument("chat.tools", "this model's chat template does not show tools: write them into a message")
    try:
        return tokenizer.encode_chat(chat.messages, add_generation_prompt=chat.add_generation_prompt, tools=chat.tools)
    except ChatTemplateError as error:
        problem = str(error)
    raise InvalidArgument("chat", problem)


def check_stop_strings(stop_strings: Sequence[str]) -> tuple[str, ...]:
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidArgument("stop_strings", f"at most {MAX_STOP_STRINGS} (got {len(stop_strings)})")
    for i, stop in enumerate(stop_strings):
        if not 1 <= len(stop) <= MAX_STOP_STRING_LENGTH:
            raise InvalidArgument(f"stop_strings[{i}]", f"must be 1 to {MAX_STOP_STRING_LENGTH} characters")
    return tuple(stop_strings)


def prepare_request(
    tokenizer: TextTokenizer,
    info: ModelInfo,
    prompt: str | Chat | tuple[int, ...],
    *,
    stop_strings: Sequence[str] = (),
    include_stop_string: bool = False,
    keep_special_tokens: bool = False,
    logprobs: bool = False,
) -> TextRequest:
    """Prompt text (encoded without the post-processor), a Chat, or the prompt's ids (a tuple,
    taken as they are: each in the tokenizer's vocabulary) -> a validated TextRequest. Checks
    run in request order: the prompt, then the stop strings."""
    if isinstance(prompt, Chat):
        ids, field = encode_chat(tokenizer, prompt), "chat"
    elif isinstance(prompt, tuple):
        ids, field = prompt, "prompt_token_ids"
        tokenizer.vocabulary.check_ids(ids, field)
    elif prompt:
        ids, field = tokenizer.encode(prompt), "prompt"
    else:
        raise InvalidArgument("prompt", "must not be empty (or give chat instead)")
    return TextRequest(
        info.check_prompt(ids, field), check_stop_strings(stop_strings), include_stop_string, keep_special_tokens, logprobs
    )


# --- the generation ----------------------------------------------------------------------------


def _push(stream: TextStream, ids: list[int], per_token: bool) -> TextChunk:
    """`stream.push`, with an id outside the vocabulary blamed on the decoder, not the caller."""
    try:
        return stream.push(ids, per_token)
    except InvalidArgument as error:
        problem = str(error)
    raise UnknownTokenId(f"the decoder sent an id this tokenizer does not have: {problem}")


def token_logprobs(vocabulary: Vocabulary, tokens: Sequence[Token], texts: Sequence[str]) -> tuple[TokenLogprob, ...]:
    """The decoder's tokens (ids checked on the way in) with the text each added, as TokenLogprobs."""
    out = []
    for token, text in zip(tokens, texts, strict=True):
        if token.logprob is None:
            raise MissingLogprob("logprobs were asked for, and the decoder sent a token without one")
        top = tuple(Alternative(i, vocabulary.token_text(i), vocabulary.raw_bytes(i), p) for i, p in token.top_logprobs)
        out.append(TokenLogprob(text, vocabulary.raw_bytes(token.id), token.logprob, top))
    return tuple(out)


async def generate_text(
    vocabulary: Vocabulary, request: TextRequest, steps: AsyncGenerator[Sequence[Event], None]
) -> AsyncIterator[TextEvent]:
    """`steps` (one event list per decoder step) -> TextDelta* then exactly one TextFinished.

    Raises DecoderFault or StreamEndedWithoutFinished (see the module docstring). `steps` is
    closed whenever this generator ends, so close it (`contextlib.aclosing`) when leaving early.
    """
    async with contextlib.aclosing(steps):
        stream = TextStream(
            IncrementalDetokenizer(vocabulary, request.prompt_token_ids, request.keep_special_tokens),
            StopStringMatcher(request.stop_strings, request.include_stop_string) if request.stop_strings else None,
        )
        prompt_tokens, completion_tokens = len(request.prompt_token_ids), 0
        async for events in steps:
            finished = events[-1] if events and isinstance(events[-1], Finished) else None
            tokens = [e for e in events if isinstance(e, Token)]
            ids = [t.id for t in tokens]
            chunk = _push(stream, ids, request.logprobs)
            del ids[chunk.consumed :]  # after a stop string: only the ids up to the one completing it
            text, stop_string, texts = chunk.text, chunk.stop_string, list(chunk.token_texts)
            if finished is not None and stop_string is None:
                if finished.usage.completion_tokens != completion_tokens + len(ids):
                    raise AccountingMismatch(finished.usage.completion_tokens, completion_tokens + len(ids))
                end = stream.finish()  # the held tail may still complete a stop string
                text, stop_string = text + end.text, end.stop_string
                if texts:  # the flushed tail (an unfinished character's U+FFFD) is the last token's
                    texts[-1] += end.token_texts[0]
            completion_tokens += len(ids)
            if ids or text:
                logprobs = token_logprobs(vocabulary, tokens[: len(ids)], texts) if request.logprobs else ()
                yield TextDelta(text, tuple(ids), logprobs)
            usage = Usage(prompt_tokens, completion_tokens)
            if stop_string is not None:
                yield TextFinished(FinishReason.STOP, usage, stop_string=stop_string)
                return  # leaving the block closes `steps`: the decode is cancelled
            if finished is not None:
                yield TextFinished(finished.reason, usage, stop_token_id=finished.stop_token_id)
                return
    raise StreamEndedWithoutFinished()
