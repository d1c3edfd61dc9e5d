"""The model-free proposer: guess that the sequence goes on as it did after the latest earlier
occurrence of its last few ids (prompt lookup / suffix matching over the request's own ids).

For each n from `longest` down to `shortest`, the last n ids are looked up among the n-grams
seen earlier; the first found (longest n wins, and among equal n the most recent occurrence,
since a later one overwrites an earlier one in the index) gives as guesses the ids that followed
it. Text that copies its input (rewriting code with one change, extracting fields, quoting)
repeats long spans, so its guesses are long and mostly right; ordinary prose rarely repeats 2+
ids, so it gets few guesses, and the scheduler's policy stops asking a row that gains nothing.

Cost: the index maps each n-gram to where its latest occurrence ended, and an id appended
registers the `longest - shortest + 1` n-grams that end just before it (one id later, so that an
n-gram is indexed only once something follows it, and a lookup never finds the suffix itself).
So `extend` is O(1) an id, and a guess of k ids is O(longest + k), however long the sequence.
"""

from __future__ import annotations

from typing import Sequence


class NgramHistory:
    """One request's ids and the index of its n-grams (see the module docstring)."""

    __slots__ = ("ids", "_index", "_shortest", "_longest")

    def __init__(self, ids: Sequence[int], shortest: int, longest: int) -> None:
        self.ids: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where what followed its latest occurrence starts
        self._shortest, self._longest = shortest, longest
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        for token in ids:
            end = len(self.ids)  # the n-grams ending at end - 1 are followed by `token`, at `end`
            for n in range(self._shortest, min(self._longest, end) + 1):
                self._index[tuple(self.ids[end - n : end])] = end
            self.ids.append(token)

    def guess(self, k: int) -> tuple[int, ...]:
        """Up to k ids that followed the latest earlier occurrence of the longest suffix found."""
        ids = self.ids
        for n in range(min(self._longest, len(ids)), self._shortest - 1, -1):
            start = self._index.get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return tuple(ids[start : start + k])
        return ()


class NgramProposer:
    """`Proposer` over each request's own prompt and output (engine.core.speculation.proposer)."""

    name = "ngram"

    def __init__(self, shortest: int = 2, longest: int = 4) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths must satisfy 1 <= shortest <= longest, got {shortest}, {longest}")
        self.shortest, self.longest = shortest, longest

    def open(self, ids: Sequence[int]) -> NgramHistory:
        return NgramHistory(ids, self.shortest, self.longest)

    def propose(self, rows: Sequence[tuple[NgramHistory, int]]) -> list[tuple[int, ...]]:
        return [history.guess(k) if k > 0 else () for history, k in rows]

    def expects(self, history: NgramHistory) -> bool:
        # A copied span goes on: if the ids known so far match, the id in flight most likely
        # continues the match; if they do not, it most likely does not start one.
        return bool(history.guess(1))

    def close(self, history: NgramHistory) -> None:
        pass  # (its index goes with it)
