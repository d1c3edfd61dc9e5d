"""One model's tokenizer: ids <-> text, its special and end-of-sequence ids, and its chat template.

Data flow: the tokenizer service loads one `TextTokenizer` per model directory at start-up
(`from_dir`), encodes prompts (`encode`, `encode_chat`), and for each generation stream makes an
`IncrementalDetokenizer` (`detokenizer`) that turns the engine's token ids into text deltas.

Text is defined by the HF `tokenizers` library: `decode` is `tokenizers.Tokenizer.decode`, with
special tokens skipped unless `keep_special_tokens`. Every other text this package produces
(incremental deltas, chat prompts) is checked against that definition in the tests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tokenizers import Tokenizer

from engine.model_store.model_files import eos_token_ids, read_json
from tokenizer_svc.chat import SPECIAL_TOKEN_NAMES, ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
from tokenizer_svc.detokenizer import IncrementalDetokenizer

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


def _token_content(value: object) -> str | None:
    """tokenizer_config.json names a token either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Immutable after construction (apart from a memo of token bytes, filled idempotently), so one
    instance serves all requests and threads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        special_token_names: Mapping[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self.eos_token_ids: frozenset[int] = eos_token_ids
        # Named special tokens ("bos_token" -> "<s>") from tokenizer_config.json; chat templates see them.
        self.special_token_names: Mapping[str, str] = dict(special_token_names or {})
        self.chat_template = chat_template
        self.decoder_traits = DecoderTraits.of_tokenizer(tokenizer)
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        """Load tokenizer.json and whichever of tokenizer_config.json, chat_template.jinja,
        generation_config.json and config.json the directory has."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tok_config = read_json(model_dir / "tokenizer_config.json")
        names = {n: c for n in SPECIAL_TOKEN_NAMES if (c := _token_content(tok_config.get(n))) is not None}
        return cls(
            tokenizer,
            eos_token_ids=eos_token_ids(model_dir),  # the same definition the engine uses
            special_token_names=names,
            chat_template=load_chat_template(model_dir, tok_config),
        )

    # --- ids <-> text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text in `text` (e.g. "<|im_start|>") becomes its id, as in HF.
        `add_special_tokens` runs the tokenizer's post-processor (e.g. a BOS prefix)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], keep_special_tokens: bool = False) -> str:
        """The reference text of `token_ids`; raises ValueError for an id outside [0, vocab_size)."""
        self.check_ids(token_ids)
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=not keep_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of a vocabulary or added token given its exact token string (e.g. "<0xE4>", "<|im_end|>")."""
        return self._tokenizer.token_to_id(token)

    def check_ids(self, token_ids: Sequence[int]) -> None:
        """Ids the tokenizer cannot produce are refused rather than silently dropped."""
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    def detokenizer(
        self, prompt_token_ids: Sequence[int], keep_special_tokens: bool = False
    ) -> IncrementalDetokenizer:
        """A fresh per-stream detokenizer; the prompt's last tokens give the output its context."""
        return IncrementalDetokenizer(self, prompt_token_ids, keep_special_tokens=keep_special_tokens)

    # --- what the detokenizer needs to know about single tokens ---------------------------------

    def is_dropped(self, token_id: int, keep_special_tokens: bool) -> bool:
        """True when decode ignores this id: a skipped special token, or an id with no token."""
        if not keep_special_tokens and token_id in self.special_token_ids:
            return True
        return self._tokenizer.id_to_token(token_id) is None

    def is_byte_token(self, token_id: int) -> bool:
        """A `<0xHH>` token, which ByteFallback decodes together with its neighbours."""
        token = self._tokenizer.id_to_token(token_id)
        return token is not None and _BYTE_TOKEN.fullmatch(token) is not None

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

    # --- chat ---------------------------------------------------------------------------------

    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of `messages` (ChatTemplateError if none)."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)")
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special_token_names
        )

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Equal to transformers' apply_chat_template(tokenize=True): the template writes any BOS
        itself, so the rendered text is encoded without the post-processor."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
