"""`SlotTable`: what each of a model's B slots holds, and the Model contract's checks on it.

A slot is free (length 0), filling (part of its prompt written, more chunks to come before it
may decode) or decoding (its prompt written, one position more per step). Every call that writes
a slot is checked here first and refused with ModelUsageError, because JAX would clamp an
out-of-range id or position silently instead of failing; a refused call changes nothing.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.core.model import DecodeInput, ModelUsageError


def require(condition: bool, problem: str) -> None:
    if not condition:
        raise ModelUsageError(problem)


class SlotTable:
    """B slots in a context of `context` positions, for ids below `vocab_size`."""

    def __init__(self, slots: int, context: int, vocab_size: int) -> None:
        self.context, self.vocab_size = context, vocab_size
        self.length = np.zeros(slots, np.int64)  # positions written per slot; 0 = free slot
        self.filling = np.zeros(slots, bool)  # prefilled in part: more chunks to come before it may decode

    def check_free(self, slot: int) -> None:
        require(self.length[slot] == 0 and not self.filling[slot], f"slot {slot} is in use")

    def check_chunk(self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int) -> None:
        """A chunk [start, end) of a prompt this slot can take next (prefill_chunk, dispatch)."""
        n, s_ = len(prompt_token_ids), self.context
        require(1 <= n < s_, f"a prompt of {n} tokens in a context of {s_}")
        require(0 <= start < end <= n, f"a chunk [{start}, {end}) of a prompt of {n} tokens")
        if start == 0:
            self.check_free(slot)
        else:
            require(self.filling[slot] and self.length[slot] == start, f"a chunk at {start} is not slot {slot}'s next one")
        ids = np.asarray(prompt_token_ids[start:end], np.int64)
        require(0 <= ids.min() and ids.max() < self.vocab_size, "a prompt id outside the vocabulary")

    def check_step(self, inputs: Sequence[DecodeInput]) -> tuple[np.ndarray, np.ndarray]:
        """A decode step's inputs, each a decoding slot's next position; -> their slots and positions."""
        require(bool(inputs), "a decode step with no inputs")
        slots = np.fromiter((i.slot for i in inputs), np.int64, len(inputs))
        given = np.fromiter((i.position for i in inputs), np.int64, len(inputs))
        ids = [i.token_id for i in inputs if i.token_id is not None]
        require(len(np.unique(slots)) == len(slots), "a slot twice in one step")
        require((self.length[slots] > 0).all() and not self.filling[slots].any(), "a slot that was not prefilled")
        require((given == self.length[slots]).all(), "a position that is not the slot's next one")
        require(given.max() < self.context, "a position past the context")
        require(all(0 <= t < self.vocab_size for t in ids), "a token id outside the vocabulary")
        return slots, given

    def release(self, slot: int) -> None:
        self.length[slot] = 0
        self.filling[slot] = False
