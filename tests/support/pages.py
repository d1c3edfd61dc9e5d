"""Block tables for tests that drive a JaxModel (or any engine.core.model.Model) directly, as the
scheduler would: before a slot is prefilled it needs pages (`Model.set_pages`), and `release`
clears them.

`own_pages` gives slot b the b-th whole context of pages, in order (pages 1 + b * W .. (b + 1) * W),
which a pool of the default size (kv_cache_tokens 0: a whole context of pages per slot) holds, so
slots never share a page: the slot cache of before, as pages.
"""

from __future__ import annotations


def width(model) -> int:
    """W, the pages one context spans."""
    return -(-model.info.max_context_length // model.kv.page_size)


def own_pages(model, slot: int) -> list[int]:
    """Slot `slot`'s pages in the contiguous layout (module docstring), set on the model; -> them."""
    w = width(model)
    pages = list(range(1 + slot * w, 1 + (slot + 1) * w))
    if pages[-1] >= model.kv.num_pages:
        raise ValueError(f"slot {slot}'s {w} pages do not fit a pool of {model.kv.num_pages}")
    model.set_pages(slot, pages)
    return pages


def own_pages_all(model) -> None:
    """Every slot its own pages (`own_pages`)."""
    for slot in range(model.info.max_batch_size):
        own_pages(model, slot)
