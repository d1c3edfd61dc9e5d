"""`SlotSamplingState`: each slot's sampling parameters, kept on the host, and the packed columns
a decode step carries them in.

A request's parameters are written when it takes a slot (`take`) and reset when it leaves
(`release`). A decode step packs the first R slots' parameters, inputs and block tables into two
arrays (`pack`), one [R, 9 + W] i32 and one [R, 3] f32, so that two transfers cross to the device
per step, not twelve small ones; a prompt chunk along with it adds its ids, place and table
(`chunk_arrays`). Prompts' last positions are sampled by the same executable as a decode step of
their row bucket, from the same two arrays (`pack_prompts`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.core.model import DecodeInput
from engine.core.request import SamplingParams
from engine.jax_backend import sampling
from engine.jax_backend.slot_table import require

# Columns of a decode step's packed host inputs ([R, 9 + W] i32 and [R, 3] f32): the row's block
# table [W] fills the i32 columns from TABLE on.
GIVEN, USE_GIVEN, POSITION, ACTIVE, MASKED, TOP_K, TOP_N, SEED_HI, SEED_LO, TABLE = range(10)
TEMPERATURE, TOP_P, MIN_P = range(3)


class SlotSamplingState:
    """B slots' sampling parameters: idle slots are greedy, with no cuts and no alternatives."""

    def __init__(self, slots: int) -> None:
        self.temperature = np.zeros(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.top_p = np.ones(slots, np.float32)
        self.min_p = np.zeros(slots, np.float32)
        self.seed = np.zeros((slots, 2), np.uint32)
        self.top_n = np.zeros(slots, np.int32)  # alternatives each slot's samples report

    def take(self, slot: int, s: SamplingParams) -> None:
        """A request's parameters into its slot (its seed set: the engine sets one for every request)."""
        self.temperature[slot], self.top_k[slot] = s.temperature, s.top_k
        self.top_p[slot], self.min_p[slot] = s.top_p, s.min_p
        self.seed[slot] = sampling.seed_words(s.seed)
        self.top_n[slot] = min(s.top_logprobs, sampling.MAX_TOP_LOGPROBS)

    def release(self, slot: int) -> None:
        self.temperature[slot], self.top_k[slot], self.top_p[slot], self.min_p[slot] = 0.0, 0, 1.0, 0.0
        self.seed[slot] = 0
        self.top_n[slot] = 0

    def pack(self, inputs: Sequence[DecodeInput], rows: int, tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A step's host inputs for the first `rows` slots as the two packed arrays the step
        reads (columns GIVEN.., the slots' block tables [B, W] from TABLE, and TEMPERATURE..);
        rows with no input are idle (greedy, no cuts)."""
        ints, floats = np.zeros((rows, TABLE + tables.shape[1]), np.int32), np.zeros((rows, 3), np.float32)
        ints[:, TABLE:] = tables[:rows]
        floats[:, TOP_P] = 1.0
        for i in inputs:
            s = i.slot
            ints[s, GIVEN] = 0 if i.token_id is None else i.token_id
            ints[s, USE_GIVEN] = i.token_id is not None
            ints[s, POSITION], ints[s, ACTIVE], ints[s, MASKED] = i.position, 1, i.masked
            ints[s, TOP_K], ints[s, TOP_N] = self.top_k[s], self.top_n[s]
            floats[s] = self.temperature[s], self.top_p[s], self.min_p[s]
        ints[:, SEED_HI:SEED_LO + 1] = self.seed[:rows].view(np.int32)
        return ints, floats


    def pack_prompts(
        self, slots: Sequence[int], masked: Sequence[bool], lengths: Sequence[int], rows: int, width: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sampler's inputs for the last positions of prompts into `slots` (lengths: each
        prompt's, so the sample's position), padded to `rows` (a row bucket): as `pack`'s two
        arrays (POSITION the prompt's last, so that POSITION + 1 is the sample's; no block
        table: the sampler reads none, W = `width` zero columns to share the decode step's
        shapes) and the rows' slots [rows] i32. Rows past the prompts sample for nobody, at a slot
        none of them holds, so the write of each row's sample into `last` never meets another
        row's at the same slot (greedy, no cuts)."""
        m, taken = len(slots), set(slots)
        require(0 < m <= rows and len(taken) == m, f"prompts into slots {list(slots)} in {rows} rows")
        idle = next((s for s in range(len(self.temperature)) if s not in taken), 0)  # none: no idle rows
        at = np.full(rows, idle, np.int32)
        at[:m] = slots
        ints, floats = np.zeros((rows, TABLE + width), np.int32), np.zeros((rows, 3), np.float32)
        floats[:, TOP_P] = 1.0
        s = at[:m]
        ints[:m, POSITION], ints[:m, ACTIVE], ints[:m, MASKED] = np.asarray(lengths) - 1, 1, masked
        ints[:m, TOP_K], ints[:m, TOP_N] = self.top_k[s], self.top_n[s]
        ints[:m, SEED_HI:SEED_LO + 1] = self.seed[s].view(np.int32)
        floats[:m] = np.stack([self.temperature[s], self.top_p[s], self.min_p[s]], axis=1)
        return ints, floats, at


def mask_row(head_size: int, vocab_size: int, masked_ids=(), banned: np.ndarray | None = None) -> np.ndarray:
    """A slot's mask row [V'] bool (True: never sampled while a step says `masked`): a constrained
    request's banned ids ([V] bool, which hold its masked ids too), else its masked ids. Ids past
    the vocabulary (V' > V, a head padded for the tokenizer or a mesh) are never sampled anyway."""
    row = np.zeros(head_size, bool)  # [V']
    if banned is not None:
        require(banned.dtype == bool and banned.shape == (vocab_size,), f"a banned row of {banned.dtype} {banned.shape}")
        n = min(vocab_size, head_size)
        row[:n] = banned[:n]
    else:
        row[[t for t in masked_ids if t < head_size]] = True
    return row


def mask_rows(head_size: int, vocab_size: int, slots: Sequence[int], banned: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Several slots' mask rows at once from their banned ids [R, V] bool, padded to `size` rows
    (a compiled row count) by repeating the first: -> (rows [size, V'] bool, slots [size] i32)."""
    r = len(slots)
    require(banned.dtype == bool and banned.shape == (r, vocab_size) and 0 < r <= size, f"banned rows of {banned.dtype} {banned.shape} for {r} slots")
    require(len(set(slots)) == r, "a slot twice in one ban")
    rows = np.zeros((size, head_size), bool)  # [size, V']
    n = min(vocab_size, head_size)
    rows[:r, :n] = banned[:, :n]
    rows[r:] = rows[0]
    padded = np.full(size, slots[0], np.int32)
    padded[:r] = slots
    return rows, padded


def chunk_arrays(
    table: np.ndarray, ids: Sequence[int], start: int, size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt chunk along with a decode step: its ids padded to `size` (default: its length),
    (start, end) of its real tokens, and its slot's block table [W] (a copy: the call may read it
    after the host has changed the slot's row)."""
    tokens = np.zeros(size or len(ids), np.int32)
    tokens[: len(ids)] = ids
    return tokens, np.array([start, start + len(ids)], np.int32), np.array(table, np.int32)
