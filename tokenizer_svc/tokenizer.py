"""One model's tokenizer: ids <-> text, its special and end-of-sequence ids, and its chat template.

Data flow: the tokenizer service loads one `TextTokenizer` per model directory at start-up
(`from_dir`) and encodes prompts with it (`encode`, `encode_chat`). Its `vocabulary` is what a
generation's `IncrementalDetokenizer` reads to turn the engine's token ids into text deltas.

Chat input differs from raw prompt text in one way: special-token text that a message holds is
encoded as plain text, never as a special id (see `encode_chat`); a raw prompt's is the token, as
in HF, so callers can write chat markup by hand.

Text is defined by the HF `tokenizers` library: `decode` is `tokenizers.Tokenizer.decode`, with
special tokens skipped unless `keep_special_tokens`. Every other text this package produces
(incremental deltas, chat prompts) is checked against that definition in the tests.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from pathlib import Path
from typing import Mapping, Sequence

from tokenizers import AddedToken, Tokenizer

from engine.model_store.model_files import eos_token_ids, read_json
from tokenizer_svc.chat import (
    SPECIAL_TOKEN_NAMES,
    ChatMessage,
    ChatTemplate,
    ChatTemplateError,
    SpecialTextShield,
    load_chat_template,
    strings_of,
)
from tokenizer_svc import tool_template
from tokenizer_svc.tool_template import TemplateTools
from tokenizer_svc.vocabulary import Vocabulary

_NO_TEMPLATE = "this tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
# Texts up to this many characters are encoded holding the GIL: the text service encodes them
# inline on its event loop (services.text_service.INLINE_MAX is this), where a call that releases
# the GIL then waits to take it back from the server's other threads, longer than the call itself
# takes, and the streams through the text service kept less of the engine's speed
# (docs/benchmarks.md, 'Figures behind code comments'). Longer texts are encoded on worker threads,
# where releasing it lets the loop run.
INLINE_CHARS = 1024


def _encoding(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False, offsets: bool = False):
    """`text`'s Encoding: up to INLINE_CHARS characters through plain `encode`, which holds the
    GIL; longer through the batch entry point (a batch of one), which releases it while the Rust
    code works, so a large input encoded on a thread does not stall the event loop. Same ids either
    way; `offsets`: the long path computes them too (plain `encode` always does)."""
    if len(text) <= INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    batch = tokenizer.encode_batch if offsets else tokenizer.encode_batch_fast
    return batch([text], add_special_tokens=add_special_tokens)[0]


def _token_content(value: object) -> str | None:
    """tokenizer_config.json names a token either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Immutable after construction (its vocabulary's memo of token bytes aside, filled
    idempotently, and the chat encoder, built once under a lock), so one instance serves all
    requests and threads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        special_token_names: Mapping[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocabulary = Vocabulary(tokenizer)
        self.vocab_size: int = self.vocabulary.size
        self.special_token_ids: frozenset[int] = self.vocabulary.special_token_ids
        self.eos_token_ids: frozenset[int] = eos_token_ids
        # Named special tokens ("bos_token" -> "<s>") from tokenizer_config.json; chat templates see them.
        self.special_token_names: Mapping[str, str] = dict(special_token_names or {})
        self.chat_template = chat_template
        # the tool-call format the template writes, and whether it shows a chat's tools itself
        self.tool_template: TemplateTools = (
            tool_template.read(chat_template) if chat_template is not None else tool_template.NO_TOOLS
        )
        added = tokenizer.get_added_tokens_decoder()
        self._shield = SpecialTextShield(added[i].content for i in self.special_token_ids)
        # A special token with normalized=true is matched after the normalizer, so text that only
        # becomes its text there (NFKC turns "＜" into "<") passes the shield: encode_chat refuses it.
        normalized = sorted({added[i].content for i in self.special_token_ids if added[i].normalized}, key=len)
        self._normalized_special = (
            re.compile("|".join(map(re.escape, reversed(normalized))))
            if normalized and tokenizer.normalizer is not None
            else None
        )
        self._chat_encoder: _ChatEncoder | None = None  # built on first need: it copies the tokenizer
        # the file it was read from (`from_dir`), which constraints compile against (engine.core.constrained)
        self.tokenizer_json: Path | None = None
        self._chat_encoder_lock = threading.Lock()

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
        loaded = cls(
            tokenizer,
            eos_token_ids=eos_token_ids(model_dir),  # the same definition the engine uses
            special_token_names=names,
            chat_template=load_chat_template(model_dir, tok_config),
        )
        loaded.tokenizer_json = tokenizer_file
        return loaded

    # --- ids <-> text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token text in `text` (e.g. "<|im_start|>") becomes its id, as in HF.
        `add_special_tokens` runs the tokenizer's post-processor (e.g. a BOS prefix).
        The GIL held or released by the text's size (`_encoding`)."""
        return _encoding(self._tokenizer, text, add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], keep_special_tokens: bool = False) -> str:
        """The reference text of `token_ids`; InvalidArgument for an id outside [0, vocab_size)."""
        return self.vocabulary.decode(token_ids, keep_special_tokens)

    # --- chat ---------------------------------------------------------------------------------

    def render_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[object] = ()
    ) -> str:
        """The prompt text the model's chat template makes of `messages` and `tools` (JSON values
        the template sees as its `tools` variable); ChatTemplateError if there is no template."""
        if self.chat_template is None:
            raise ChatTemplateError(_NO_TEMPLATE)
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, special_tokens=self.special_token_names, tools=tools
        )

    def encode_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, tools: Sequence[object] = ()
    ) -> list[int]:
        """The chat's prompt ids: only the template's own text makes special ids.

        Messages without special-token text: transformers' apply_chat_template(tokenize=True)
        exactly, i.e. the rendered text encoded without the post-processor (the template writes
        any BOS itself). Special-token text in a role or content (e.g. "<|im_end|>"), or in any
        string of `tools`, is encoded as plain text where transformers makes it the special
        token. ChatTemplateError when the tokenizer cannot keep that promise for this chat (see
        `_ChatEncoder`)."""
        if self.chat_template is None:
            raise ChatTemplateError(_NO_TEMPLATE)
        avoid = self.chat_template.source + "".join(self.special_token_names.values())
        shielded, shielded_tools, restore = self._shield.shield_chat(messages, tools, avoid)
        if self._normalized_special is not None:
            normalize = self._tokenizer.normalizer.normalize_str
            texts = [t for m in shielded for t in (m.role, m.content)] + [t for tool in shielded_tools for t in strings_of(tool)]
            if any(self._normalized_special.search(normalize(t)) for t in texts):
                raise ChatTemplateError("a chat message holds text the tokenizer normalizes into a special token")
        text = self.render_chat(shielded, add_generation_prompt, shielded_tools)
        if not restore:
            return _encoding(self._tokenizer, text).ids
        return self._get_chat_encoder().encode(text, restore)

    def prepare_chat_encoding(self) -> None:
        """Build now what `encode_chat` builds on the first message with special-token text: a
        private copy of the tokenizer (slow and large for a large vocabulary such as Qwen3's:
        docs/benchmarks.md, 'Figures behind code comments'). A server calls this at
        start-up so that no request waits for it."""
        self._get_chat_encoder()

    def _get_chat_encoder(self) -> "_ChatEncoder":
        with self._chat_encoder_lock:
            if self._chat_encoder is None:
                self._chat_encoder = _ChatEncoder(self._tokenizer, self.special_token_ids)
            return self._chat_encoder


# Stand-in tokens live in the supplementary private-use planes: an 8-character random marker,
# then two characters numbering the special token.
_MARKER_BASE, _INDEX_BASE, _INDEX_SPAN = 0xF0000, 0x100000, 0xFFFE


class _ChatEncoder:
    """Encodes a rendered chat so that only special-token text the template wrote becomes special ids.

    Input: the text rendered from shielded messages (`SpecialTextShield`), in which every special
    token's text is the template's, and the table restoring the stand-ins to the messages' text.

    How: the special tokens of the text are found by the tokenizer itself (`encode` with offsets;
    it also applies each token's lstrip/rstrip/single_word rules). Each is replaced by a stand-in:
    a non-special added token of a private copy of the tokenizer, with the special token's rules;
    the messages' text is restored; the copy encodes the result with `encode_special_tokens` on,
    so special-token text in it is plain text, and the stand-ins' ids become the special ids again.
    The copy splits the text at the stand-ins exactly where the tokenizer splits it at the special
    tokens, so every piece is pre-tokenized as in a whole-text encode (a Metaspace with
    prepend_scheme "first" adds "▁" only at the start of the text, in both). Encoding the pieces
    one by one would not keep that.

    Checked on every call, else ChatTemplateError: the restored text does not hold the stand-ins'
    marker (random per process, so only by chance); every stand-in came back as its id; and no
    other special id appears, which the model could still make of plain text if its vocabulary
    had a merge into a special token's text (its unknown-token id excepted: that is how it writes
    text it has no tokens for, with or without this).
    """

    def __init__(self, tokenizer: Tokenizer, special_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        spec = tokenizer.to_str()
        self._plain = Tokenizer.from_str(spec)
        self._plain.encode_special_tokens = True  # its added special tokens are never matched
        self._special_ids = special_ids
        if hasattr(tokenizer.model, "unk_token"):  # BPE, WordPiece, WordLevel
            unk = tokenizer.token_to_id(tokenizer.model.unk_token) if tokenizer.model.unk_token else None
        else:  # Unigram names it by id, in the file only
            unk = json.loads(spec).get("model", {}).get("unk_id")
        self._unk_id = unk if isinstance(unk, int) else None

        self._marker = "".join(chr(_MARKER_BASE + secrets.randbelow(_INDEX_SPAN)) for _ in range(8))
        added = tokenizer.get_added_tokens_decoder()
        self._stand_in: dict[int, str] = {}
        tokens = []
        for n, special_id in enumerate(sorted(special_ids)):
            rules = added[special_id]
            text = self._marker + chr(_INDEX_BASE + n // _INDEX_SPAN) + chr(_INDEX_BASE + n % _INDEX_SPAN)
            self._stand_in[special_id] = text
            tokens.append(
                AddedToken(text, special=False, single_word=rules.single_word, lstrip=rules.lstrip,
                           rstrip=rules.rstrip, normalized=rules.normalized)
            )
        self._plain.add_tokens(tokens)
        self._special_of = {self._plain.token_to_id(text): special_id for special_id, text in self._stand_in.items()}
        # A normalizer that changed a stand-in would leave it unmatched: found here, refused in `encode`.
        probe = self._plain.encode(" ".join(self._stand_in.values()), add_special_tokens=False).ids
        self._usable = [self._special_of.get(i) for i in probe if i in self._special_of] == list(self._stand_in)

    def encode(self, text: str, restore: Mapping[int, str]) -> list[int]:
        if not self._usable:
            raise ChatTemplateError("this tokenizer cannot encode special-token text in chat messages as plain text")
        found = _encoding(self._tokenizer, text, offsets=True)
        pieces: list[str] = []
        structure = 0
        pos = 0
        for token_id, (start, end) in zip(found.ids, found.offsets):
            if token_id in self._special_ids:
                pieces += [text[pos:start].translate(restore), self._stand_in[token_id]]
                structure += 1
                pos = end
        pieces.append(text[pos:].translate(restore))
        if any(self._marker in piece for piece in pieces[::2]):
            raise ChatTemplateError("a chat message holds this process's stand-in marker")
        ids = _encoding(self._plain, "".join(pieces)).ids
        from_template = sum(1 for i in ids if i in self._special_of)
        from_text = sum(1 for i in ids if i in self._special_ids and i != self._unk_id)
        if from_template != structure or from_text:
            raise ChatTemplateError("this tokenizer makes a special token of plain text in a chat message")
        return [self._special_of.get(i, i) for i in ids]
