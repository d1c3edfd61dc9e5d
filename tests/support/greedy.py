"""`greedy_ids`: a JaxModel's greedy ids for a few prompts decoded together, one slot each, free
running or teacher-forced (each step fed a reference's id: picks compared at equal histories)."""

from __future__ import annotations

from engine.core.model import DecodeInput, SlotSetup
from engine.core.request import SamplingParams
from support.pages import own_pages_all

GREEDY = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())


def greedy_ids(model, prompts: list[tuple[int, ...]], n: int, fed: list[list[int]] | None = None) -> list[list[int]]:
    """n greedy ids per prompt (slot = its index); with `fed`, each step is fed fed[slot][i]
    instead of the model's own last pick."""
    own_pages_all(model)
    ids = [[model.prefill(slot, p, GREEDY, False).token_id] for slot, p in enumerate(prompts)]
    for i in range(n - 1):
        last = [(fed[slot][i] if fed else ids[slot][-1]) for slot in range(len(prompts))]
        outs = model.decode([DecodeInput(slot, last[slot], len(p) + i, False) for slot, p in enumerate(prompts)])
        for slot, sample in enumerate(outs):
            ids[slot].append(sample.token_id)
    for slot in range(len(prompts)):
        model.release(slot)
    return ids
