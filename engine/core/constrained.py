"""Constrained requests on the engine's side: compiling a request's constraint against the served
model's tokenizer, and the banned-ids row each of its samples is drawn under.

The grammar work itself (llguidance) is engine.constraints; this module is what the services
and the scheduler need around it:

* `ConstraintCompiler`: one per service, for one tokenizer file and one model's vocabulary size
  and EOS ids. Its `Vocabulary` (the slow part: every token's bytes) is built on the first
  constrained request, not at start, so a server that never sees one never pays for it.
  `compile` turns a `Constraint` into a `CompiledConstraint` or raises InvalidArgument naming
  the field (a ConstraintError's), which the services send as INVALID_ARGUMENT.
* `CompiledConstraint`: what `Request.constraint` holds. A request crosses a pipe to the engine
  process (engine.core.engine_process), and llguidance's objects do not pickle, so it pickles as
  its source (the constraint and the vocabulary's tokenizer file, size and EOS ids) and is
  compiled again on the other side against that process's own copy of the vocabulary (built
  once per process: `vocabulary`).
* `banned_row`: the [V] row a constrained request's next sample is drawn under: what its
  matcher bans (EOS unless the output so far is a whole sentence of the language), and the
  request's control ids too while it is below min_output_tokens.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.core.errors import InvalidArgument

if TYPE_CHECKING:  # (imported where used: the scheduler imports this module, and needs no grammar library)
    from engine.constraints.spec import Constraint, ConstraintError
    from engine.constraints.vocabulary import Vocabulary

NO_TOKENIZER = "this model has no tokenizer to compile constraints against"


@dataclass(frozen=True)
class VocabularySource:
    """What a `Vocabulary` is built from: a tokenizer file and the model's head size and EOS ids."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: frozenset[int]


_build_lock = threading.Lock()  # one build at a time: two threads asking at once build it once


@functools.lru_cache(maxsize=4)
def _vocabulary(source: VocabularySource) -> Vocabulary:
    from engine.constraints.vocabulary import Vocabulary

    return Vocabulary.from_tokenizer_json(Path(source.tokenizer_json), source.vocab_size, source.eos_token_ids)


def vocabulary(source: VocabularySource) -> Vocabulary:
    """The process's one `Vocabulary` for `source`, built on first use."""
    with _build_lock:
        return _vocabulary(source)


def constraint_error(error: ConstraintError) -> InvalidArgument:
    """A ConstraintError as the services' InvalidArgument, naming the same field once."""
    return InvalidArgument(error.field, error.reason)


class CompiledConstraint:
    """A request's constraint compiled against the served vocabulary: `matcher()` gives each
    request (or each run of it) a fresh state. Pickles as its source (see the module docstring)."""

    __slots__ = ("spec", "source", "_grammar")

    def __init__(self, spec: Constraint, source: VocabularySource, grammar) -> None:
        self.spec, self.source, self._grammar = spec, source, grammar

    def matcher(self):
        return self._grammar.matcher()

    def __reduce__(self):
        return compile_constraint, (self.spec, self.source)

    def __repr__(self) -> str:
        return f"CompiledConstraint({self.spec.kind}, {len(self.spec.text)} characters)"


def compile_constraint(spec: Constraint, source: VocabularySource) -> CompiledConstraint:
    """`spec` compiled against `source`'s vocabulary; InvalidArgument naming the field if it
    does not compile."""
    from engine.constraints.spec import ConstraintError

    try:
        vocab = vocabulary(source)
    except (ValueError, OSError) as error:  # a model with no EOS ids, an unreadable tokenizer file
        raise InvalidArgument(spec.field, f"this model cannot take constraints: {error}") from error
    try:
        grammar = vocab.compile(spec)
    except ConstraintError as error:
        raise constraint_error(error) from error
    return CompiledConstraint(spec, source, grammar)


class ConstraintCompiler:
    """Compiles constraints for one served model. With no tokenizer file (a model served
    without one, as the scripted model is unless given one) every constraint is refused with
    InvalidArgument naming `field`."""

    def __init__(self, tokenizer_json: str | Path | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.source = (
            None if tokenizer_json is None
            else VocabularySource(str(tokenizer_json), vocab_size, frozenset(eos_token_ids))
        )

    def compile(self, spec: Constraint, field: str = "constraint") -> CompiledConstraint:
        if self.source is None:
            raise InvalidArgument(field, NO_TOKENIZER)
        return compile_constraint(spec, self.source)


def banned_row(matcher, vocab_size: int, control_token_ids: frozenset[int], mask_control: bool) -> np.ndarray:
    """[V] bool, True = not allowed next: the matcher's row, and the control ids too while the
    request is below min_output_tokens (`mask_control`). A row that allows nothing cannot be
    sampled under: InvalidArgument (the constraint has no continuation this vocabulary can
    spell), which fails the request rather than the engine; so does a matcher that failed
    (its ConstraintError, a ValueError too)."""
    row = np.asarray(matcher.banned(), bool)  # [V]
    if row.shape != (vocab_size,):
        raise ValueError(f"a banned row of shape {row.shape} for a vocabulary of {vocab_size}")
    if mask_control and control_token_ids:
        row = row.copy()
        row[list(control_token_ids)] = True
    if row.all():
        raise InvalidArgument("constraint", "no token of this model's vocabulary can continue the output")
    return row
