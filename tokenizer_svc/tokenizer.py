"""One model's tokenizer: ids <-> text, its special and end-of-sequence ids, and its chat template.

Data flow: the tokenizer service loads one `TextTokenizer` per model directory at start-up
(`from_dir`) and encodes prompts with it (`encode`, `encode_chat`). Its `vocabulary` is what a
generation's `IncrementalDetokenizer` reads to turn the engine's token ids into text deltas.

Text is defined by the HF `tokenizers` library: `decode` is `tokenizers.Tokenizer.decode`, with
special tokens skipped unless `keep_special_tokens`. Every other text this package produces
(incremental deltas, chat prompts) is checked against that definition in the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from tokenizers import Tokenizer

from engine.model_store.model_files import eos_token_ids, read_json
from tokenizer_svc.chat import SPECIAL_TOKEN_NAMES, ChatMessage, ChatTemplate, ChatTemplateError, load_chat_template
from tokenizer_svc.vocabulary import Vocabulary


def _token_content(value: object) -> str | None:
    """tokenizer_config.json names a token either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Immutable after construction (its vocabulary's memo of token bytes aside, filled
    idempotently), so one instance serves all requests and threads."""

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
        """The reference text of `token_ids`; InvalidArgument for an id outside [0, vocab_size)."""
        return self.vocabulary.decode(token_ids, keep_special_tokens)

    # --- chat ---------------------------------------------------------------------------------

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
