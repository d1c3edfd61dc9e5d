"""Constrained requests on the engine's side: compiling a request's constraint against the served
model's tokenizer, and the banned-ids row each of its samples is drawn under.

The grammar work itself (llguidance) is engine.constraints; this module is what the services
and the scheduler need around it:

* `ConstraintCompiler`: one per service, for one tokenizer file and one model's vocabulary size
  and EOS ids. Its `Vocabulary` (the slow part: every token's bytes) is built once, on the first
  constrained request or ahead of it on a thread (`warm`: the decode service, whose validation
  runs on its event loop, starts it when its model is ready).
  `compile` turns a `Constraint` into a `Grammar` (what `Request.constraint` holds) or raises
  InvalidArgument naming the field (a ConstraintError's), which the services send as
  INVALID_ARGUMENT. A request crosses a pipe to the engine process (engine.core.engine_process):
  a Grammar pickles as its vocabulary's origin and its grammar text, and is compiled again there
  against that process's own copy of the vocabulary (engine.constraints.vocabulary).
* `banned_row`: the [V] row a constrained request's next sample is drawn under: what its
  matcher bans (EOS unless the output so far is a whole sentence of the language), and the
  request's control ids too while it is below min_output_tokens. `banned_rows` is the same for
  every constrained row of a decode step at once (llguidance computes them in parallel).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from engine.core.errors import InvalidArgument

if TYPE_CHECKING:  # (imported where used: the scheduler imports this module, and needs no grammar library)
    from engine.constraints.matcher import Grammar
    from engine.constraints.spec import Constraint, ConstraintError

log = logging.getLogger(__name__)

NO_TOKENIZER = "this model has no tokenizer to compile constraints against"
NOTHING_ALLOWED = "no token of this model's vocabulary can continue the output"


def constraint_error(error: ConstraintError) -> InvalidArgument:
    """A ConstraintError as the services' InvalidArgument, naming the same field once."""
    return InvalidArgument(error.field, error.reason)


class ConstraintCompiler:
    """Compiles constraints for one served model. With no tokenizer file (a model served
    without one, as the scripted model is unless given one) every constraint is refused with
    InvalidArgument naming its field."""

    def __init__(self, tokenizer_json: str | Path | None, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        # the vocabulary's origin (engine.constraints.vocabulary.Origin), or None
        self.origin = None if tokenizer_json is None else (str(tokenizer_json), vocab_size, frozenset(eos_token_ids))
        self._lock = threading.Lock()  # one build: a second caller waits for the first's
        self._vocabulary = None

    def warm(self) -> None:
        """Build the vocabulary now, on a daemon thread: a service whose validation runs on its
        event loop calls it at start, so the first constrained request does not stall every
        stream for the build (seconds for a large vocabulary). A failure here is the first
        request's error again, so it is only logged."""
        if self.origin is not None:
            threading.Thread(target=self._warm, name="constraint-vocabulary", daemon=True).start()

    def _warm(self) -> None:
        try:
            self._shared()
        except (ValueError, OSError) as error:
            log.info("constraints will be refused: %s", error)

    def _shared(self):
        from engine.constraints.vocabulary import Vocabulary

        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary.shared(self.origin)
            return self._vocabulary

    def compile(self, spec: Constraint, field: str = "constraint") -> Grammar:
        """`spec` compiled against the served vocabulary (built the first time); InvalidArgument
        naming `field` when there is no tokenizer, and the constraint's field when it does not
        compile or the model cannot take constraints at all (no EOS ids)."""
        from engine.constraints.spec import ConstraintError

        if self.origin is None:
            raise InvalidArgument(field, NO_TOKENIZER)
        try:
            vocabulary = self._shared()
        except (ValueError, OSError) as error:  # a model with no EOS ids, an unreadable tokenizer file
            raise InvalidArgument(spec.field, f"this model cannot take constraints: {error}") from error
        try:
            return vocabulary.compile(spec)
        except ConstraintError as error:
            raise constraint_error(error) from error


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
        raise InvalidArgument("constraint", NOTHING_ALLOWED)
    return row


def banned_rows(
    matchers: Sequence, vocab_size: int, control_token_ids: Sequence[frozenset[int]], mask_control: Sequence[bool],
) -> tuple[np.ndarray, list[InvalidArgument | None]]:
    """`banned_row` of several requests at once (a decode step's constrained rows), the grammar
    work done in one parallel call (engine.constraints.matcher.banned_rows). -> (rows [R, V]
    bool, per row None or the InvalidArgument that fails that request alone: its matcher
    failed, or its row allows nothing)."""
    from engine.constraints.matcher import banned_rows as grammar_rows

    rows, failures = grammar_rows(matchers)  # [R, V]
    if rows.shape[1] != vocab_size:
        raise ValueError(f"banned rows of shape {rows.shape} for a vocabulary of {vocab_size}")
    errors: list[InvalidArgument | None] = []
    for i, failure in enumerate(failures):
        if failure is None and mask_control[i] and control_token_ids[i]:
            rows[i, list(control_token_ids[i])] = True
        if failure is not None:
            errors.append(constraint_error(failure))
        elif rows[i].all():
            errors.append(InvalidArgument("constraint", NOTHING_ALLOWED))
        else:
            errors.append(None)
    return rows, errors
