"""The `Proposer` interface: where guessed ids come from, and the registry of the built-in ones.

A proposer sees each request through a `History` it opens over the request's ids (prompt, then
output) and that the scheduler extends with every id the request emits; at a verify step it is
asked, for all the step's rows at once, for up to k ids that may follow each history. Guesses
only cost time: a wrong one is rejected by the model and never reaches a client.

Why batched and stateful: the model-free n-gram proposer (engine.core.speculation.ngram) keeps
an index per request that each new id updates in O(1), so a step costs O(k) a row rather than a
rescan; a draft model (a small model with the same tokenizer, issue 45) keeps a slot of its
own per request and answers `propose` with one batched decode of k steps for every row
(engine.core.speculation.draft, `--draft-model`); an EAGLE-style head would do the same over the
target model's hidden states, which would then have to come back from `verify` with the samples
(not built yet: one more class and one more name in `proposer_named`).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from engine.core.speculation.ngram import NgramProposer


class History(Protocol):
    """One request's ids as its proposer keeps them (the prompt, then every emitted id)."""

    def extend(self, ids: Sequence[int]) -> None:
        """Ids the request emitted since the last call, in order."""


class Proposer(Protocol):
    name: str  # the metrics' label and the `--speculation` value that picks it
    # Optional (False when absent): whether a guess of k + 1 ids from a history that lacks the
    # id of the step in flight is worth as much as a guess of k from the whole history, its
    # first id standing for the one in flight. The scheduler then guesses without reading that
    # step first (engine.core.speculative_step, "Ahead"), and never calls `expects`.
    guesses_ahead: bool

    def open(self, ids: Sequence[int]) -> History:
        """Start following a request whose ids so far (prompt, then output) are `ids`."""

    def propose(self, rows: Sequence[tuple[History, int]]) -> list[tuple[int, ...]]:
        """For each (history, k): up to k ids guessed to follow the history's last id, in row
        order; () where there is no guess worth checking. Cheap and on the host: it runs on
        the scheduler's thread between steps."""

    def expects(self, history: History) -> bool:
        """Whether `history` as it stands would get a guess. Asked before the step in flight is
        read, so the history lacks that step's id: the scheduler reads the step early (losing
        the host's one step ahead of the device) only for a row likely to have a guess once it
        has that id, and a row with nothing to guess keeps the pipelined plain step. Optional: a
        proposer without it is asked at every step."""

    def close(self, history: History) -> None:
        """The request ended (finished, cancelled or failed): forget its history."""


SPECULATION_MODES = ("off", "ngram", "draft")  # the `--speculation` values


def proposer_named(name: str) -> Proposer | None:
    """The proposer a `--speculation` value names; None for "off". ValueError for another name,
    and for "draft", which is built around its loaded model (engine.core.speculation.draft;
    the engine is handed it)."""
    if name == "off":
        return None
    if name == "ngram":
        return NgramProposer()
    if name == "draft":
        raise ValueError("speculation draft needs a draft model (decode-server --draft-model NAME|DIR)")
    raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {name!r}")
