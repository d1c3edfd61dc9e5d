"""One tokenizer's vocabulary as the detokenizer sees it: facts about single tokens, and the
reference decode that defines what text a list of ids is.

Data flow: a `TextTokenizer` builds one `Vocabulary` at load and owns it; `TextTokenizer.decode`
is `Vocabulary.decode`, and every `IncrementalDetokenizer` reads the same object. It is the
detokenizer's only dependency, so the detokenizer cannot reach encoding, chat templates or
anything else the tokenizer does.

What holds: immutable after construction, apart from a memo of token bytes that is filled
idempotently, so one instance serves every stream and thread. `decode` is
`tokenizers.Tokenizer.decode` with special tokens skipped unless kept, and it refuses ids
outside [0, size) instead of dropping them as the library would.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer

from engine.core.errors import check_token_ids

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet inverted: printable char -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL_CHARS = _byte_level_alphabet()


@dataclass(frozen=True)
class DecoderTraits:
    """What the decoder chain does that makes text depend on tokens not yet seen.

    byte_level: a ByteLevel decoder turns every token into bytes and the whole stream into text
        with lossy UTF-8, so a character can span tokens.
    byte_fallback: a ByteFallback decoder turns each run of `<0xHH>` tokens into text all at once:
        the run's string if the run is valid UTF-8, else one U+FFFD per byte, so a later byte
        token can change the text of the whole run.
    Other decoders this package knows (Metaspace, Replace, Fuse, Strip, WordPiece, BPEDecoder)
    are local to a token, except for stripping the first token's leading space, which the
    detokenizer handles with context tokens.
    """

    byte_level: bool
    byte_fallback: bool

    @staticmethod
    def of_tokenizer(tokenizer: Tokenizer) -> "DecoderTraits":
        kinds: set[str] = set()
        stack = [json.loads(tokenizer.decoder.__getstate__())] if tokenizer.decoder is not None else []
        while stack:
            node = stack.pop()
            kinds.add(node.get("type", ""))
            stack.extend(node.get("decoders") or [])
        return DecoderTraits(byte_level="ByteLevel" in kinds, byte_fallback="ByteFallback" in kinds)


class Vocabulary:
    """Shared by every stream of one tokenizer; see the module docstring for what holds."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self.decoder_traits = DecoderTraits.of_tokenizer(tokenizer)
        self._token_bytes: dict[int, bytes] = {}
        # ids in range with no token (gaps in some vocabularies): decode drops them. Found once, so
        # that `is_dropped`, asked for every generated token, is two set lookups.
        self._tokenless: frozenset[int] = frozenset(i for i in range(self.size) if tokenizer.id_to_token(i) is None)

    def check_ids(self, token_ids: Sequence[int], field: str = "token_ids") -> None:
        """Ids the tokenizer cannot produce are refused (InvalidArgument naming `field[i]`)."""
        check_token_ids(token_ids, self.size, field)

    def decode(self, token_ids: Sequence[int], keep_special_tokens: bool = False) -> str:
        """The reference text of `token_ids`."""
        self.check_ids(token_ids)
        return self.decode_checked(token_ids, keep_special_tokens)

    def decode_checked(self, token_ids: Sequence[int], keep_special_tokens: bool = False) -> str:
        """`decode` for ids already checked (the detokenizer checks each id once, on arrival)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=not keep_special_tokens)

    def decode_releasing_gil(self, token_ids: list[int], keep_special_tokens: bool = False) -> str:
        """`decode_checked` through the batch entry point, which releases the GIL while the Rust
        code works: for large inputs decoded on a thread. Slower a call (docs/benchmarks.md,
        'Figures behind code comments'), so the detokenizer's few-id decodes keep `decode_checked`."""
        return self._tokenizer.decode_batch([token_ids], skip_special_tokens=not keep_special_tokens)[0]

    def is_dropped(self, token_id: int, keep_special_tokens: bool) -> bool:
        """True when decode ignores this id: a skipped special token, or an id with no token."""
        if not keep_special_tokens and token_id in self.special_token_ids:
            return True
        return token_id in self._tokenless

    def is_byte_token(self, token_id: int) -> bool:
        """A `<0xHH>` token, which ByteFallback decodes together with its neighbours."""
        token = self._tokenizer.id_to_token(token_id)
        return token is not None and _BYTE_TOKEN.fullmatch(token) is not None

    def token_text(self, token_id: int) -> str:
        """The token's text on its own, special tokens shown (U+FFFD for part of a character):
        how a logprob alternative is named."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def raw_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: for a ByteLevel decoder its raw bytes, for a `<0xHH>` token that
        byte (both may be part of a UTF-8 character), else its text's UTF-8."""
        if self.decoder_traits.byte_level:
            return self.token_bytes(token_id)
        token = self._tokenizer.id_to_token(token_id)
        if self.decoder_traits.byte_fallback and token is not None:
            byte = _BYTE_TOKEN.fullmatch(token)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a ByteLevel decoder makes of this token (its text is not final on its own)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            token = self._tokenizer.id_to_token(token_id) or ""
            try:
                cached = bytes(_BYTE_LEVEL_CHARS[c] for c in token)
            except KeyError:  # like the ByteLevel decoder: a token outside the alphabet is its UTF-8
                cached = token.encode("utf-8")
            self._token_bytes[token_id] = cached
        return cached
