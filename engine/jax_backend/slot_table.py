"""`SlotTable`: what each of a model's B slots holds, its block table, and the Model contract's
checks on them.

A slot is free (length 0), filling (part of its prompt written, more chunks to come before it
may decode) or decoding (its prompt written, one position more per step). Its block table
(`tables[slot]`, [W] page ids, 0 past its pages) is the scheduler's (`set_pages`): kept here on
the host and handed to each call that reads or writes the slot, as an input of fixed shape, so no
table change ever compiles anything. Every call that writes a slot is checked here first and
refused with ModelUsageError, because JAX would clamp an out-of-range id or position silently
(and write a position with no page into the null page) instead of failing; a refused call
changes nothing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.core.model import DecodeInput, ModelUsageError


def require(condition: bool, problem: str) -> None:
    if not condition:
        raise ModelUsageError(problem)


class SlotTable:
    """B slots in a context of `context` positions, for ids below `vocab_size`, over a pool of
    `num_pages` pages (the null page 0 included) of `page_size` positions."""

    def __init__(self, slots: int, context: int, vocab_size: int, page_size: int, num_pages: int) -> None:
        self.context, self.vocab_size = context, vocab_size
        self.page_size, self.num_pages = page_size, num_pages
        self.length = np.zeros(slots, np.int64)  # positions written per slot; 0 = free slot
        self.filling = np.zeros(slots, bool)  # prefilled in part: more chunks to come before it may decode
        self.tables = np.zeros((slots, -(-context // page_size)), np.int32)  # [B, W]; 0: the null page
        self.held = np.zeros(slots, np.int64)  # pages in each slot's table

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        """The slot's block table from now on (pages[i] holds positions [i*P, (i+1)*P))."""
        require(0 <= slot < len(self.length), f"slot {slot} outside the {len(self.length)} slots")
        ids = np.asarray(pages, np.int64)
        require(len(ids) <= self.tables.shape[1], f"{len(ids)} pages, but a table holds {self.tables.shape[1]}")
        require(bool(((1 <= ids) & (ids < self.num_pages)).all()), f"a page outside 1..{self.num_pages - 1}")
        self.tables[slot] = 0
        self.tables[slot, : len(ids)] = ids
        self.held[slot] = len(ids)

    def covers(self, slot: int, end: int) -> bool:
        """Whether the slot's table names a page for each of its positions [0, end)."""
        return self.held[slot] * self.page_size >= end

    def free(self, slot: int) -> bool:
        return self.length[slot] == 0 and not self.filling[slot]

    def check_free(self, slot: int) -> None:
        require(self.free(slot), f"slot {slot} is in use")

    def check_chunk(self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int) -> None:
        """A chunk [start, end) of a prompt this slot can take next (prefill_chunk, dispatch): on a
        free slot from 0, or from a page-aligned start after a shared prefix the table names
        (a prefix hit); else where the slot's previous chunk ended."""
        n, s_ = len(prompt_token_ids), self.context
        require(1 <= n < s_, f"a prompt of {n} tokens in a context of {s_}")
        require(0 <= start < end <= n, f"a chunk [{start}, {end}) of a prompt of {n} tokens")
        if start == 0 or self.free(slot):
            self.check_free(slot)
            require(start % self.page_size == 0, f"a prefix hit of {start} positions is not whole pages of {self.page_size}")
        else:
            require(self.filling[slot] and self.length[slot] == start, f"a chunk at {start} is not slot {slot}'s next one")
        require(self.covers(slot, end), f"slot {slot}'s table has no page for position {end - 1}")
        ids = np.asarray(prompt_token_ids[start:end], np.int64)
        require(0 <= ids.min() and ids.max() < self.vocab_size, "a prompt id outside the vocabulary")

    def check_step(self, inputs: Sequence[DecodeInput]) -> tuple[np.ndarray, np.ndarray]:
        """A decode step's inputs, each a decoding slot's next position, with a page in its
        table; -> their slots and positions."""
        require(bool(inputs), "a decode step with no inputs")
        slots = np.fromiter((i.slot for i in inputs), np.int64, len(inputs))
        given = np.fromiter((i.position for i in inputs), np.int64, len(inputs))
        ids = [i.token_id for i in inputs if i.token_id is not None]
        require(len(np.unique(slots)) == len(slots), "a slot twice in one step")
        require((self.length[slots] > 0).all() and not self.filling[slots].any(), "a slot that was not prefilled")
        require((given == self.length[slots]).all(), "a position that is not the slot's next one")
        require(given.max() < self.context, "a position past the context")
        require(bool((self.held[slots] * self.page_size > given).all()), "a position with no page in its slot's table")
        require(all(0 <= t < self.vocab_size for t in ids), "a token id outside the vocabulary")
        return slots, given

    def rewind(self, slot: int, length: int) -> None:
        """The decoding slot's count back to `length` (at least 1, at most its count): what it
        wrote past that is garbage its next steps overwrite (a draft model's rejected guesses)."""
        require(0 <= slot < len(self.length), f"slot {slot} outside the {len(self.length)} slots")
        require(self.length[slot] > 0 and not self.filling[slot], f"rewind of slot {slot}, which was not prefilled")
        require(1 <= length <= self.length[slot], f"rewind of slot {slot} to {length}, outside 1..{self.length[slot]}")
        self.length[slot] = length

    def release(self, slot: int) -> None:
        self.length[slot] = 0
        self.filling[slot] = False
        self.tables[slot] = 0
        self.held[slot] = 0
