"""Incremental detokenization: a stream of generated token ids -> text deltas that are final.

Data flow: the generation use case (tokenizer_svc/generation.py) makes one `IncrementalDetokenizer`
per generation stream over the tokenizer's `Vocabulary`, `push`es each batch of ids the engine
sends and forwards the returned delta (maybe ""), and calls `finish` when the engine reports
Finished. The `Vocabulary` is all it reads: single-token facts and the reference decode.

What holds (checked by property tests over GPT-2, Qwen3 and a SentencePiece-style tokenizer):
  * Exactness. With no prompt, the deltas of all pushes joined with `finish()` equal
    `vocabulary.decode(all ids)` with the same special-token setting, for any ids split into
    chunks in any way. With a prompt P and output O they equal `decode(P + O)` with the prompt's
    text removed: `decode(P + O)[len(decode(P)):]` whenever the prompt ends on a complete
    character (the normal case). If the prompt ends inside an unfinished character, the output
    starts after the longest common prefix of `decode(P)` and `decode(P + O)`.
  * A delta is never taken back: text is released only once no later token can change it. A
    character split across tokens is held until complete; U+FFFD appears only where the full
    decode has it. `finish()` flushes the held tail exactly as the full decode writes it, so an
    unfinished character at the end becomes U+FFFD, just as `decode` gives.
  * Leading spaces: the last prompt tokens are kept as context, so a SentencePiece-style first
    delta gets the leading space the full text has, and no delta contains prompt text.

How: released ids are represented by `context`, their last few ids (the window); the delta for
`pending` ids is `decode(context + pending)` minus the context's released text, computed only at a
*boundary*, a token end after which no later token can change earlier text. Per decoder
(`DecoderTraits`):
  * ByteLevel: text is lossy UTF-8 over all token bytes, and everything before an unfinished last
    character (a truncated-but-completable UTF-8 sequence, <= 3 bytes, decided from the last 3
    bytes; decode shows it as one U+FFFD) is final. So every token end is a boundary, and only
    that last U+FFFD is held, as part of the context.
  * ByteFallback: a run of `<0xHH>` tokens decodes all-or-nothing (its UTF-8 string, or one
    U+FFFD per byte if invalid), so a boundary needs the last kept token to be a non-byte token.
  * Other decoders: every token end is a boundary, but a delta ending in U+FFFD is held.
Skipped special tokens and ids without a token are dropped on arrival: decode ignores them too.
Stripping the first token's leading space (Metaspace, Strip) affects the window's first token in
both decodes alike, so it cancels out.

Bounded state: `context` holds at most CONTEXT_TOKENS ids (an unfinished character spans at most 3
tokens), and `pending` is empty after every push except during a ByteFallback run of byte tokens
(or, for another decoder, while a delta ends in U+FFFD).
That run is the one thing not bounded by a window, because its text depends on every byte in it:
while it lasts a push costs O(1) (no decode), and it is decoded once when it ends. Per-token cost is
two decodes of at most CONTEXT_TOKENS + len(pending) ids, independent of the output length.
"""

from __future__ import annotations

from typing import Sequence

from tokenizer_svc.vocabulary import Vocabulary

CONTEXT_TOKENS = 4  # released ids kept as decode context (their text is subtracted again)
PROMPT_SCAN_TOKENS = 64  # how far back the prompt is read for context


def _second_byte_range(lead: int) -> tuple[int, int]:
    """Unicode Table 3-7: the bytes allowed right after a lead byte (no overlongs, no surrogates)."""
    return {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, (0x80, 0xBF))


def _is_truncated_char(seq: bytes) -> bool:
    """True when `seq` is a lead byte plus valid continuations, still short of a whole character."""
    lead = seq[0]
    if 0xC2 <= lead <= 0xDF:
        continuations = 1
    elif 0xE0 <= lead <= 0xEF:
        continuations = 2
    elif 0xF0 <= lead <= 0xF4:
        continuations = 3
    else:
        return False
    if len(seq) - 1 >= continuations:
        return False
    for i, byte in enumerate(seq[1:]):
        low, high = _second_byte_range(lead) if i == 0 else (0x80, 0xBF)
        if not low <= byte <= high:
            return False
    return True


def ends_inside_char(tail: bytes) -> bool:
    """Whether lossy UTF-8 text of a byte stream ending in `tail` (its last <= 3 bytes) could
    still change: the stream ends with a truncated character that more bytes may complete."""
    if not tail or tail[-1] < 0x80:  # ends in ASCII (most tokens): no character is open
        return False
    return any(_is_truncated_char(tail[-n:]) for n in (1, 2, 3) if len(tail) >= n)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """Per-stream state; not thread-safe (one stream is fed by one task)."""

    def __init__(
        self, vocabulary: Vocabulary, prompt_token_ids: Sequence[int], keep_special_tokens: bool = False
    ) -> None:
        self._vocabulary = vocabulary
        self._keep_special = keep_special_tokens
        self._traits = vocabulary.decoder_traits
        self._tail = b""  # last <= 3 bytes of the kept tokens (ByteLevel)
        self._in_byte_run = False  # the last kept token is a <0xHH> token (ByteFallback)
        self._finished = False

        # Read the prompt's end: ids up to its last boundary are context; ids after it (a run of
        # byte-fallback tokens) are pending. Text the prompt already shows for its unfinished end
        # is skipped from the first delta where the output shares it.
        vocabulary.check_ids(prompt_token_ids, "prompt_token_ids")
        scan = list(prompt_token_ids[-PROMPT_SCAN_TOKENS:])
        kept = [t for t in scan if not vocabulary.is_dropped(t, keep_special_tokens)]
        boundary, boundary_open = 0, False
        for i, token_id in enumerate(kept, start=1):
            at_boundary, inside_char = self._track(token_id)
            if at_boundary:
                boundary, boundary_open = i, inside_char
        self._context: list[int] = []
        self._context_text = ""  # decode(context) less an unfinished last character: all released
        self._set_context(kept[max(0, boundary - CONTEXT_TOKENS) : boundary], boundary_open)
        self._pending: list[int] = kept[boundary:]
        self._boundary, self._boundary_open = 0, False  # pending[:boundary] may be released
        tail_text = self._delta(self._decode(self._context + self._pending))
        self._prompt_tail_text: str | None = tail_text or None

    @property
    def held_token_count(self) -> int:
        """Ids this stream holds (context + pending): the state that Bounded state is about."""
        return len(self._context) + len(self._pending)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became final ("" while nothing did).
        An id outside the vocabulary raises InvalidArgument (`token_ids[i]`) before any is taken."""
        if self._finished:
            raise RuntimeError("push after finish")
        self._vocabulary.check_ids(token_ids)
        for token_id in token_ids:
            if self._vocabulary.is_dropped(token_id, self._keep_special):
                continue
            self._pending.append(token_id)
            at_boundary, inside_char = self._track(token_id)
            if at_boundary:
                self._boundary, self._boundary_open = len(self._pending), inside_char
        if self._boundary == 0:
            return ""
        return self._release(self._boundary, self._boundary_open)

    def finish(self) -> str:
        """Flush the held tail as the full decode writes it (an unfinished character -> U+FFFD).
        Idempotent; the state is freed."""
        if self._finished:
            return ""
        text = self._release(len(self._pending), inside_char=False, final=True)
        self._finished = True
        self._context, self._pending, self._context_text = [], [], ""
        return text

    # --- internals ----------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._vocabulary.decode_checked(token_ids, keep_special_tokens=self._keep_special)

    def _track(self, token_id: int) -> tuple[bool, bool]:
        """Account for one kept token: (is the stream now at a token boundary, does its text end
        inside a character). Byte-level text can be released up to an unfinished character, so
        every token end is a boundary there; a byte-fallback run is not."""
        inside_char = False
        if self._traits.byte_level:
            self._tail = (self._tail + self._vocabulary.token_bytes(token_id))[-3:]
            inside_char = ends_inside_char(self._tail)
        if self._traits.byte_fallback:
            self._in_byte_run = self._vocabulary.is_byte_token(token_id)
        return not self._in_byte_run, inside_char

    def _set_context(self, token_ids: list[int], inside_char: bool) -> None:
        """Keep the last CONTEXT_TOKENS ids (an unfinished character spans at most 3). Its text
        less the U+FFFD that stands for an unfinished last character is what was released."""
        self._context = token_ids[-CONTEXT_TOKENS:]
        text = self._decode(self._context)
        self._context_text = text[:-1] if inside_char and text.endswith("\ufffd") else text

    def _delta(self, full: str) -> str:
        """What `full` = decode(context + ids) adds to the context's released text."""
        if full.startswith(self._context_text):
            return full[len(self._context_text) :]
        # Only for decoders outside DecoderTraits' model; never taken for the tested families.
        return full[_common_prefix_len(self._context_text, full) :]

    def _release(self, n: int, inside_char: bool, final: bool = False) -> str:
        """Release pending[:n], which ends at a boundary (or the stream's end when `final`); text of
        an unfinished last character (one U+FFFD in decode's output) stays held."""
        text = self._delta(self._decode(self._context + self._pending[:n]))
        if inside_char and text.endswith("\ufffd"):
            text = text[:-1]
        precise = self._traits.byte_level or self._traits.byte_fallback
        if not final and not precise and text.endswith("\ufffd"):
            return ""  # unknown decoder: wait for a token that completes the character
        if self._prompt_tail_text is not None and (text or final):
            text = text[_common_prefix_len(self._prompt_tail_text, text) :]
            self._prompt_tail_text = None
        self._set_context(self._context + self._pending[:n], inside_char)
        del self._pending[:n]
        self._boundary, self._boundary_open = 0, False
        return text
