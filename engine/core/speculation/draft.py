"""The draft-model proposer (`--draft-model`, issue 45): a small model with the target's
tokenizer, in the same engine process, guesses each row's next ids by greedy decoding.

A draft model is a `Model` like the target (engine.core.model), loaded with the same options but
no verify step, that this proposer drives on its own: its own slots, and its own pages from an
allocator of its own (`KvPages` over the draft's pool; the target's pages are the scheduler's).
Per request (`DraftHistory`), the proposer keeps:
  * `ids`: the request's ids (prompt, then every id it emitted, as the scheduler extends them);
  * `valid`: how many of them have their KV in the draft's slot;
  * `written`: the guesses fed past them at the last proposal (their KV written, and right only
    as far as the target accepts them); `count`, the slot's count in the model, is valid +
    len(written) until a guess is rejected, and past `valid` after that until the next
    proposal rewinds it;
  * `held`: the draft's own prediction after the last position written (its last sample, which
    the model keeps and feeds to a step given no token), or None once that is stale.

`propose` runs one batched greedy decode of the draft for every row at once: a row first feeds
the ids it emitted since (`ids[valid:]`, given one by one; usually the target's last sample, or
that and the last guess when all were accepted), and then its own samples, k of them in all. A
row's steps are known in advance, so they are all dispatched before the first is read: the device
runs them back to back. When the target accepted only part of a row's guesses, the slot's count
goes back to `valid` first (`rewind`) and the next steps overwrite the rest.

A request gets its slot and prefill at its first proposal (the whole of its ids in one
`prefill`, whose sample is the first guess), and again where it emitted many ids since its last
proposal (`CATCH_UP_STEPS`). Where the draft has no free slot, or no page for a
row's positions, that row gets no guesses (fewer, where pages run short), never an error; a row
without a slot asks again at its next proposal. Guesses only cost time: the target's verify step
decides every token, so the output is plain decoding's whatever the draft says.
"""

from __future__ import annotations

import itertools
from typing import Protocol, Sequence

from engine.core.kv_pages import KvPages
from engine.core.model import DecodeInput, Model, Sample, SlotSetup
from engine.core.request import SamplingParams

# A row that emitted more ids than this since its last proposal (one back from a rest, whose steps
# do not ask the proposer) and more than a quarter of its length has its slot prefilled again
# from scratch rather than fed those ids one decode step each: a prompt reads many ids per pass.
CATCH_UP_STEPS = 8

# the draft always guesses its most likely id: a one-hot proposal, which the target's rejection
# sampling turns into exactly the target's distribution for sampled rows too
_GREEDY = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())


class DraftModel(Model, Protocol):
    def rewind(self, slot: int, length: int) -> None:
        """The decoding slot's count back to `length` (1..its count), with no step in flight:
        the next step feeds position `length`, its token given (JaxModel.rewind)."""


class DraftHistory:
    """One request as the draft follows it (the module docstring says what each field holds)."""

    __slots__ = ("ids", "seq", "slot", "valid", "count", "written", "held")

    def __init__(self, ids: Sequence[int], seq: int) -> None:
        self.ids: list[int] = list(ids)
        self.seq = seq  # its name in the draft's page allocator
        self.slot: int | None = None  # the draft's slot; None until its first proposal, or none free
        self.valid = 0
        self.count = 0  # the slot's count in the model: valid + the positions written past it
        self.written: tuple[int, ...] = ()  # the ids at positions valid.. that may still prove right
        self.held: int | None = None

    def extend(self, ids: Sequence[int]) -> None:
        """The ids the request emitted since: those that match the guesses written keep their KV."""
        self.ids += ids
        same = next((j for j, (a, b) in enumerate(zip(ids, self.written)) if a != b), min(len(ids), len(self.written)))
        self.valid += same
        self.written = self.written[same:] if same == len(ids) else ()  # past a mismatch: garbage


class DraftProposer:
    """`Proposer` (engine.core.speculation.proposer) over a draft model; `model` is loaded and
    warmed up, and this proposer is its only user."""

    name = "draft"

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        kv = model.kv
        self._pages = KvPages(kv.num_pages, kv.page_size)  # no reserve: nothing but guesses grows here
        self._free = set(range(model.info.max_batch_size))  # the draft's free slots
        self._seqs = itertools.count()

    def open(self, ids: Sequence[int]) -> DraftHistory:
        return DraftHistory(ids, next(self._seqs))

    def expects(self, history: DraftHistory) -> bool:
        # a draft always has a guess where it has a slot (or can get one); the policy rests rows
        # whose guesses the target keeps rejecting
        return history.slot is not None or bool(self._free)

    def close(self, history: DraftHistory) -> None:
        if history.slot is not None:
            self.model.release(history.slot)
            self._pages.free(history.seq)
            self._free.add(history.slot)
            history.slot = None

    def propose(self, rows: Sequence[tuple[DraftHistory, int]]) -> list[tuple[int, ...]]:
        plans = [self._plan(history, k) for history, k in rows]
        steps = max((len(feed) for _, feed, _ in plans if feed), default=0)
        samples: list[list[Sample]] = []
        dispatched = []
        for t in range(steps):  # every step dispatched before the first is read (the module docstring)
            inputs = []
            for history, feed, _ in plans:
                if history is not None and t < len(feed):
                    inputs.append(DecodeInput(history.slot, feed[t], history.valid + t, False))
            self.model.dispatch(inputs)
            dispatched.append(inputs)
        for inputs in dispatched:
            samples.append(self.model.collect())
        return [self._guesses(plan, dispatched, samples) for plan in plans]

    def _plan(self, history: DraftHistory, k: int) -> tuple[DraftHistory | None, list[int | None], int]:
        """What a row's proposal feeds, step by step: its ids not yet in the slot (given), then
        None (its own last sample) until k guesses are made. -> (the history, or None for no
        guesses; the feed; k as it fits the context and the pages)."""
        if k < 1 or (history.slot is None and not self._take_slot(history)):
            return None, [], 0
        if history.count > history.valid:  # positions not (yet) confirmed: overwritten from `valid`
            self._rewind(history, history.valid)
        n = len(history.ids)
        if n - history.valid > max(CATCH_UP_STEPS, n // 4):  # (a row back from a rest: read again as a prompt)
            self.close(history)
            if not self._take_slot(history):
                return None, [], 0
        if history.valid == n and history.held is None:  # (a rewind to the end)
            if history.valid < 2:
                return None, [], 0
            self._rewind(history, history.valid - 1)  # the last id fed again, for its prediction
        k = min(k, self.model.info.max_context_length - n + 1)  # the last guess fed sits at n + k - 2
        k = min(k, self._grow(history, n + k - 1))
        if k < 1:
            return None, [], 0
        return history, [*history.ids[history.valid :], *[None] * (k - 1)], k

    def _rewind(self, history: DraftHistory, length: int) -> None:
        self.model.rewind(history.slot, length)
        history.valid = history.count = length
        history.written, history.held = (), None

    def _guesses(self, plan, dispatched: list[list[DecodeInput]], samples: list[list[Sample]]) -> tuple[int, ...]:
        """A row's k guesses from its steps' samples, and its state after them."""
        history, feed, k = plan
        if history is None:
            return ()
        own = [
            sample.token_id
            for inputs, step in zip(dispatched[: len(feed)], samples)
            for given, sample in zip(inputs, step) if given.slot == history.slot
        ]
        pending = len(feed) - (k - 1)
        # with no id pending, the first guess is the one the slot already holds
        guesses = own[pending - 1 :] if pending else [history.held, *own]
        history.valid = len(history.ids)
        history.count = history.valid + k - 1
        history.written, history.held = tuple(guesses[:-1]), guesses[-1]
        return tuple(guesses)

    def _take_slot(self, history: DraftHistory) -> bool:
        """A free slot and pages for the request's ids, prefilled (its sample: `held`). False,
        taking nothing, where there is no free slot, no room, or no context left for a guess."""
        n = len(history.ids)
        if not self._free or n >= self.model.info.max_context_length or not self._pages.can_admit(history.ids, 0):
            return False
        slot = min(self._free)  # the lowest: a decode step runs the rows up to the highest slot
        self._free.discard(slot)
        self._pages.admit(history.seq, history.ids, 0)  # (nothing is published: no prefix hit)
        self.model.set_pages(slot, self._pages.pages(history.seq))
        history.slot = slot
        history.held = self.model.prefill(slot, history.ids, _GREEDY, False).token_id
        history.valid = history.count = n
        return True

    def _grow(self, history: DraftHistory, length: int) -> int:
        """Pages for the slot's positions up to `length` (n + k - 1 for k guesses after the n ids),
        or as far as there is room. -> the guesses whose positions have pages (k, or fewer)."""
        pages, size = self._pages, self._pages.page_size
        held = len(pages.pages(history.seq))
        room = (held + pages.spare_pages()) * size  # positions its table could cover
        end = min(length, room)
        if pages.pages_for(end) > held:
            pages.grow(history.seq, end)
            self.model.set_pages(history.slot, pages.pages(history.seq))
        return end - len(history.ids) + 1
