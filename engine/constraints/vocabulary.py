"""A tokenizer's vocabulary as llguidance sees it, and the compiler from constraints to grammars.

Building the vocabulary (reading tokenizer.json and indexing every token's bytes) is the slow
part, done once per tokenizer. Compiling a constraint against it is cheap for ordinary schemas and
cached by (kind, text), since clients tend to send the same schema with every request.

The compiler's options are the service's, not the caller's (`schema.JSON_OPTIONS` for JSON):
- No free whitespace (`whitespace_flexible: false`, separators "," and ":"): a sampled model
  given room for whitespace can spend its whole token budget on spaces and newlines inside a
  valid prefix, and the output never completes. Compact JSON is still JSON.
- A regex's `\\d` and `\\w` are ASCII, as in JSON Schema's "pattern" (ECMAScript's rules).
- Not lenient: a keyword llguidance does not implement is refused with its name, rather than
  ignored and the output held to a looser language than the caller asked for.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, regex_to_lark

from engine.constraints import schema as json_schema
from engine.constraints.errors import reason
from engine.constraints.matcher import Grammar
from engine.constraints.spec import Constraint, ConstraintError

# What json_object (OpenAI's "any JSON object") compiles to.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
JSON_OPTIONS = json_schema.JSON_OPTIONS
CACHE_SIZE = 64


class Vocabulary:
    """One tokenizer's tokens, shared by every grammar compiled against it (thread-safe)."""

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's head size: the length of every banned row
        # verbose_errors off: a token refused mid-stream is reported in one line, not with a
        # dump of the parser's state and the whole grammar.
        self._limits = LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer_json(cls, path: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> "Vocabulary":
        """Read a Hugging Face tokenizer.json (no transformers needed).

        `vocab_size` is the model's head size; ids the tokenizer does not have are never allowed.
        A head smaller than the tokenizer's ids drops the ids past it. `eos_token_ids` (the
        model's stop ids) are allowed wherever the output so far is a sentence of the language,
        and nowhere else. Raises FileNotFoundError without the file, ValueError for bad ids.
        """
        if not Path(path).is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}: constraints compile against a tokenizer")
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty: a constrained output could never end")
        if not all(0 <= i < vocab_size for i in eos_token_ids):
            raise ValueError(f"eos_token_ids {sorted(eos_token_ids)} must lie in [0, {vocab_size})")
        eos = sorted(eos_token_ids)
        try:
            tokenizer = LLTokenizer(str(path), n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:
            if "vocab size too small" not in str(e):
                raise
            tokenizer = LLTokenizer(str(path), eos_token=eos)  # the tokenizer's own size
        return cls(tokenizer, vocab_size)

    def compile(self, c: Constraint) -> Grammar:
        """The grammar for `c`, from the cache when the same (kind, text) was compiled lately.

        Raises ConstraintError naming `c.field` when the constraint cannot be compiled.
        """
        key = (c.kind, c.text)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._build(c)  # outside the lock: a large grammar takes a while
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, c: Constraint) -> Grammar:
        source = self._grammar_source(c)
        # LLMatcher never raises for a bad grammar: it starts in an error state that says why.
        prototype = LLMatcher(self._tokenizer, source, log_level=0, limits=self._limits)
        if prototype.is_error():
            raise ConstraintError(c.field, reason(c.kind, prototype.get_error(), c.text))
        return Grammar(prototype, self.vocab_size, self._tokenizer.vocab_size, c.field)

    @staticmethod
    def _grammar_source(c: Constraint) -> str:
        if c.kind == "json_object":
            if c.text:
                raise ConstraintError(c.field, "takes no text (it means any JSON object)")
            return LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
        if not c.text.strip():
            raise ConstraintError(c.field, "is empty")
        if c.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json_schema.prepare(c.text), overrides=JSON_OPTIONS)
        if c.kind == "regex":
            # JSON Schema's (ECMAScript's) classes, as in a schema's "pattern": \d is [0-9] and \w is
            # [0-9a-zA-Z_], not every script's digits and letters, which is what a caller means.
            return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(c.text, 'dw')}/")
        return LLMatcher.grammar_from_lark(c.text)
