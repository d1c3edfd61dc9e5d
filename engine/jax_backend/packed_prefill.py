"""The host arrays of a packed prefill: several whole prompts end to end in one sequence.

`JaxModel.prefill_packed` runs the prompts of a burst, each into its own slot, as one sequence of
the smallest packed size that holds them (transformer.packed_prefill_layers reads, per token, its
page, its position in its prompt and its prompt's index), then samples every prompt's last
position in one call of a row bucket's sampler (steps.step_sample). These are the arrays it hands the device, built here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.core.model import PromptInput


def tokens(prompts: Sequence[PromptInput], size: int) -> np.ndarray:
    """The prompts' ids end to end, padded to `size`: [1, T]."""
    ids = np.zeros((1, size), np.int32)
    ids[0, : sum(len(p.prompt_token_ids) for p in prompts)] = [t for p in prompts for t in p.prompt_token_ids]
    return ids


def token_arrays(
    tables: np.ndarray, slots: Sequence[int], lengths: Sequence[int], size: int, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token of a packed sequence of `size`: the page its K/V goes to (through its slot's row
    of `tables` [B, W]), its position in its prompt and its prompt's index; the padding continues
    the last prompt's positions (or, with none, those of prompt 0 from position 0), its K/V for
    the null page."""
    page, position, prompt = np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int32)
    at = 0
    for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
        positions = np.arange(n)
        page[at : at + n], position[at : at + n], prompt[at : at + n] = tables[slot, positions // page_size], positions, i
        at += n
    last_n, last_i = (lengths[-1], len(slots) - 1) if slots else (0, 0)
    position[at:], prompt[at:] = last_n + np.arange(size - at), last_i
    return page, position, prompt


def ends(lengths: Sequence[int], rows: int) -> np.ndarray:
    """[R]: one past each prompt's last token in the sequence; 1 for the rows past the prompts
    (the sampler's row bucket R samples for nobody there: slot_sampling.pack_prompts)."""
    out = np.ones(rows, np.int32)
    out[: len(lengths)] = np.cumsum(lengths)
    return out
