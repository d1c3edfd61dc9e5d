"""The model-free proposer: guess that the sequence goes on as it did after an earlier
occurrence of its last few ids (prompt lookup / suffix matching over the request's own ids), and
keep following that occurrence while the sequence keeps copying it.

Finding a source: for each n from `longest` down to `shortest` (4 down to 3 by default), the last
n ids are looked up among the n-grams seen earlier; the first found (longest n wins, and among
equal n the most recent occurrence, since a later one overwrites an earlier one in the index)
is where the copy is taken from, and the ids that followed it are the guess.

Following it: the history remembers that source (`_source`, where the id expected next lies) and
moves it on by one for each id appended that equals the id there, so the next guess continues the
same passage, however the suffix lookup would answer now; the first appended id that differs
drops it, and the next guess looks up a source again. Why: a copied span (a line of code, a quoted
sentence) repeats short n-grams that also occur elsewhere ("    return", '": "'), and the latest
occurrence of the last few ids is then often another place, whose continuation is wrong, while the
passage being copied goes on being right.

Why not from fewer than three ids: one or two ids (" the", '": "') occur everywhere in prose, so
a lookup from them finds a "source" at almost every step of ordinary chat, whose guesses mostly
fail, and each verify step that checks them costs more than a plain step where the weights'
products are bound by arithmetic (a CPU). Down to one id, a copy whose first ids are tokenized
otherwise than its source (`"Riverside` against ` Riverside`) starts a word earlier; the
scheduler's replay of the recorded answers (benchmarks/speculative_replay.py, docs/speculative.md)
puts that at 5% of the copy-heavy gain where a verify step of 4 guesses is cheap (1.3x a plain
step), against 4-6% lost on ordinary chat at every cost from 1.3x to 3x, and 6-8% on copy-heavy
text too where it costs 2.5-3x, as on a 2-vCPU AVX2 host. (`shortest=1` is still a constructor
argument.)

Cost: the index maps each n-gram to where its latest occurrence ended, and an id appended
registers the `longest - shortest + 1` n-grams that end just before it (one id later, so that an
n-gram is indexed only once something follows it, and a lookup never finds the suffix itself).
So `extend` is O(1) an id, and a guess of k ids is O(longest + k), however long the sequence.
"""

from __future__ import annotations

from typing import Sequence


class NgramHistory:
    """One request's ids, the index of its n-grams and the source being copied (module docstring)."""

    __slots__ = ("ids", "_index", "_shortest", "_longest", "_source")

    def __init__(self, ids: Sequence[int], shortest: int, longest: int) -> None:
        self.ids: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where what followed its latest occurrence starts
        self._shortest, self._longest = shortest, longest
        self._source: int | None = None  # where the copy being followed goes on: ids[_source] is the next guess
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        for token in ids:
            end = len(self.ids)  # the n-grams ending at end - 1 are followed by `token`, at `end`
            for n in range(self._shortest, min(self._longest, end) + 1):
                self._index[tuple(self.ids[end - n : end])] = end
            source = self._source  # (< end: it points into what came before)
            self._source = source + 1 if source is not None and self.ids[source] == token else None
            self.ids.append(token)

    def lookup(self) -> int | None:
        """Where the ids that followed the latest earlier occurrence of the longest suffix found
        start (module docstring); None when no suffix of `shortest` ids or more occurred before."""
        ids = self.ids
        for n in range(min(self._longest, len(ids)), self._shortest - 1, -1):
            start = self._index.get(tuple(ids[len(ids) - n :]))
            if start is not None:
                return start
        return None

    def following(self) -> bool:
        """Whether a copy is being followed: the last guess's source, every id since equal to it."""
        return self._source is not None

    def guess(self, k: int) -> tuple[int, ...]:
        """Up to k ids: the continuation of the source being followed, else of the one `lookup`
        finds, which is then followed."""
        if self._source is None:
            self._source = self.lookup()
            if self._source is None:
                return ()
        return tuple(self.ids[self._source : self._source + k])


class NgramProposer:
    """`Proposer` over each request's own prompt and output (engine.core.speculation.proposer)."""

    name = "ngram"
    guesses_ahead = True  # a guess of k + 1 ids from a history one id short: its first stands for that id

    def __init__(self, shortest: int = 3, longest: int = 4) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths must satisfy 1 <= shortest <= longest, got {shortest}, {longest}")
        self.shortest, self.longest = shortest, longest

    def open(self, ids: Sequence[int]) -> NgramHistory:
        return NgramHistory(ids, self.shortest, self.longest)

    def propose(self, rows: Sequence[tuple[NgramHistory, int]]) -> list[tuple[int, ...]]:
        return [history.guess(k) if k > 0 else () for history, k in rows]

    def expects(self, history: NgramHistory) -> bool:
        # A copied span goes on: if the ids known so far follow a source or match, the id in
        # flight most likely continues it; if they do not, it most likely does not start one.
        return history.following() or history.lookup() is not None

    def close(self, history: NgramHistory) -> None:
        pass  # (its index goes with it)
