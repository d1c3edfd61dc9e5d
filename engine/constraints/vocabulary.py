"""A tokenizer's vocabulary as llguidance sees it, and the compiler from constraints to grammars.

Building the vocabulary (reading tokenizer.json and indexing every token's bytes) is the slow
part, done once per tokenizer. Compiling a constraint against it is cheap for ordinary schemas and
cached by (kind, text), since clients tend to send the same schema with every request.

A Grammar crosses to the engine's child process (engine.core.engine_process pickles each Request)
as its vocabulary's origin (tokenizer path, head size, EOS ids) and its llguidance grammar text;
the child builds the vocabulary once, on the first grammar it receives (`shared`), and compiles
the grammar text against it (cached like any compile).

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

# (tokenizer path, head size, EOS ids) of a vocabulary built from a file.
Origin = tuple[str, int, frozenset[int]]
_SHARED: dict[Origin, "Vocabulary"] = {}  # this process's vocabularies, by origin: few, kept
_SHARED_LOCK = threading.Lock()


class Vocabulary:
    """One tokenizer's tokens, shared by every grammar compiled against it (thread-safe)."""

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int, origin: Origin | None = None) -> None:
        self._tokenizer = tokenizer
        self._origin = origin  # None: its grammars cannot be pickled
        self.vocab_size = vocab_size  # the model's head size: the length of every banned row
        # verbose_errors off: a token refused mid-stream is reported in one line, not with a
        # dump of the parser's state and the whole grammar.
        self._limits = LLParserLimits(verbose_errors=False)
        # ("constraint", kind, text) or ("source", llguidance grammar text, kind) -> Grammar
        self._cache: OrderedDict[tuple[str, str, str], Grammar] = OrderedDict()
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
        origin = (str(path), vocab_size, frozenset(eos_token_ids))
        vocabulary = cls(tokenizer, vocab_size, origin)
        with _SHARED_LOCK:
            _SHARED.setdefault(origin, vocabulary)
        return vocabulary

    @classmethod
    def shared(cls, origin: Origin) -> "Vocabulary":
        """This process's vocabulary for `origin`, read from the file the first time."""
        with _SHARED_LOCK:
            vocabulary = _SHARED.get(origin)
        return vocabulary if vocabulary is not None else cls.from_tokenizer_json(Path(origin[0]), origin[1], origin[2])

    def compile(self, c: Constraint) -> Grammar:
        """The grammar for `c`, from the cache when the same (kind, text) was compiled lately.

        Raises ConstraintError naming `c.field` when the constraint cannot be compiled.
        """
        return self._cached(("constraint", c.kind, c.text), lambda: self._build(self._grammar_source(c), c))

    def from_source(self, source: str, kind: str) -> Grammar:
        """A grammar from llguidance's grammar text for a constraint of `kind`, compiled before
        (in another process, say)."""
        return self._cached(("source", source, kind), lambda: self._build(source, Constraint(kind)))

    def _cached(self, key: tuple[str, str, str], build) -> Grammar:
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = build()  # outside the lock: a large grammar takes a while
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, source: str, c: Constraint) -> Grammar:
        # LLMatcher never raises for a bad grammar: it starts in an error state that says why.
        prototype = LLMatcher(self._tokenizer, source, log_level=0, limits=self._limits)
        if prototype.is_error():
            raise ConstraintError(c.field, reason(c.kind, prototype.get_error(), c.text))
        reduce = None if self._origin is None else (_shared_grammar, (self._origin, source, c.kind))
        return Grammar(prototype, self.vocab_size, self._tokenizer.vocab_size, c.field, reduce)

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


def _shared_grammar(origin: Origin, source: str, kind: str) -> Grammar:
    """Unpickle a Grammar: its vocabulary in this process, and its grammar text compiled there."""
    return Vocabulary.shared(origin).from_source(source, kind)
