"""A compiled grammar and the per-request state that walks it token by token.

The engine's contract is three calls per emitted token: `banned()` for the row the sampler masks
with, `advance(id)` with the id it sampled, and `complete()` to ask whether the output is whole.
A decode step asks for all its constrained rows at once (`banned_rows`): llguidance computes
them in parallel on its own threads (a row alone, on the caller's), into one bitmask, and one
unpacking turns it into the rows.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

from engine.constraints.spec import ConstraintError


class Grammar:
    """A constraint compiled against one vocabulary; immutable, shared by every request using it.

    It pickles (a Request carries it to the engine's child process) as the way to build it again
    there, which its Vocabulary supplies: `reduce`, as `__reduce__` returns it.
    """

    def __init__(self, prototype: LLMatcher, vocab_size: int, tokenizer_size: int, field: str,
                 reduce: tuple[Callable[..., "Grammar"], tuple[Any, ...]] | None = None) -> None:
        self._prototype = prototype  # never advanced: each request walks its own copy
        self._vocab_size = vocab_size
        self._tokenizer_size = tokenizer_size
        self._field = field
        self._reduce = reduce
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[Callable[..., "Grammar"], tuple[Any, ...]]:
        if self._reduce is None:
            raise TypeError("this Grammar's vocabulary was not read from a tokenizer file, so it cannot be pickled")
        return self._reduce

    def matcher(self) -> "Matcher":
        """A fresh state at the start of the language, for one request."""
        with self._lock:
            state = self._prototype.deep_copy()
        return Matcher(state, self._vocab_size, self._tokenizer_size, self._field)


class Matcher:
    """One request's position in its grammar. Not thread-safe: one engine loop drives it."""

    def __init__(self, state: LLMatcher, vocab_size: int, tokenizer_size: int, field: str) -> None:
        self._state = state
        self._vocab_size = vocab_size
        self._tokenizer_size = tokenizer_size
        self._field = field
        self._bitmask = allocate_token_bitmask(1, tokenizer_size)  # [1, ceil(V_tok / 32)] int32, bit set = allowed

    def banned(self) -> np.ndarray:
        """[V] bool, True where an id may not come next (V is the model's head size).

        The EOS ids are allowed only where the output so far is a whole sentence of the language,
        and only they are allowed once it is complete. Raises ConstraintError if the matcher has
        failed (a refused `advance`), so a broken state is never sampled from.
        """
        self._raise_if_failed()
        fill_next_token_bitmask(self._state, self._bitmask)
        return _banned(self._bitmask, self._vocab_size, self._tokenizer_size)[0]

    def advance(self, token_id: int) -> None:
        """Consume one sampled id; raises ConstraintError if the grammar does not allow it here."""
        self._raise_if_failed()
        if not 0 <= token_id < min(self._vocab_size, self._tokenizer_size):
            raise ConstraintError(self._field, f"token id {token_id} is outside the vocabulary")
        if not self._state.consume_token(token_id):
            self._raise_if_failed(f"token id {token_id} is not allowed here: ")

    def complete(self) -> bool:
        """Nothing but EOS may follow: the output is whole, and the request can stop now."""
        return self._state.is_stopped() and not self._state.is_error()

    def accepting(self) -> bool:
        """The output so far is a sentence of the language (EOS is allowed next)."""
        return self._state.is_accepting() and not self._state.is_error()

    def _raise_if_failed(self, context: str = "") -> None:
        if self._state.is_error():
            first = self._state.get_error().strip().splitlines()
            raise ConstraintError(self._field, context + (first[0] if first else "the grammar refused a token"))


_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


def banned_rows(matchers: Sequence[Matcher]) -> tuple[np.ndarray, list[ConstraintError | None]]:
    """`banned()` of every matcher (all of one vocabulary) in one call: llguidance's executor
    computes the masks in parallel into one bitmask [R, ceil(V_tok / 32)], unpacked once.
    -> (rows [R, V] bool, per row the ConstraintError of a failed matcher, whose row is all
    banned, or None): one failed request must not fail its neighbours' rows."""
    global _executor
    first = matchers[0]
    if any((m._vocab_size, m._tokenizer_size) != (first._vocab_size, first._tokenizer_size) for m in matchers):
        raise ValueError("banned_rows over matchers of different vocabularies")
    errors: list[ConstraintError | None] = []
    for m in matchers:
        try:
            m._raise_if_failed()
            errors.append(None)
        except ConstraintError as error:
            errors.append(error)
    bitmask = allocate_token_bitmask(len(matchers), first._tokenizer_size)  # [R, ceil(V_tok / 32)] int32
    live = [(m._state, i) for i, m in enumerate(matchers) if errors[i] is None]
    if len(live) == 1:  # on this thread: a hand-off to the executor's pool costs more than one row's work
        fill_next_token_bitmask(live[0][0], bitmask, live[0][1])
    elif live:
        with _executor_lock:
            if _executor is None:
                _executor = LLExecutor()
        fill_next_token_bitmask_par(_executor, live, bitmask)
    rows = _banned(bitmask, first._vocab_size, first._tokenizer_size)  # [R, V]
    rows[[i for i, e in enumerate(errors) if e is not None]] = True
    return rows, errors


def _banned(bitmask: np.ndarray, vocab_size: int, tokenizer_size: int) -> np.ndarray:
    """llguidance's bitmask [R, ceil(V_tok / 32)] (bit set = allowed) -> [R, V] bool, True =
    banned; ids past the tokenizer (a head wider than it) stay banned."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=tokenizer_size, bitorder="little")  # [R, V_tok]
    banned = np.ones((bitmask.shape[0], vocab_size), dtype=bool)  # [R, V]
    n = min(vocab_size, tokenizer_size)
    banned[:, :n] = allowed[:, :n] == 0
    return banned
