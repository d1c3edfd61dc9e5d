"""The split sampler under a mesh of two devices, as run by tests/support/tp_worker.py in its child
with forced CPU devices (tests/test_split_sampler.py asserts on it): the same calls (a greedy and a
sampled slot, greedy steps and mixed ones) on tiny-llama at tensor parallelism 2, once with the
one-executable decode step (the worker's own model of that size) and once split (`split_sampler`).
"""

from __future__ import annotations

from engine.core.model import DecodeInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend.jax_model import JaxModel
from tests.support.pages import own_pages_all


def calls(model: JaxModel) -> dict:
    """Prefill slots 0 (greedy) and 1 (sampled), then steps of slot 0 alone and of both; -> the
    ids and logprobs of every sample, in order. Releases both slots."""
    setups = [SlotSetup(SamplingParams(seed=1), frozenset()), SlotSetup(SamplingParams(temperature=1.0, seed=5), frozenset())]
    own_pages_all(model)
    samples = [model.prefill(slot, [3, 4, 5 + slot], setups[slot], False) for slot in (0, 1)]
    length = {0: 3, 1: 3}
    for slots in ([0], [0], [0, 1], [0, 1], [0]):
        samples += model.decode([DecodeInput(s, None, length[s], False) for s in slots])
        for s in slots:
            length[s] += 1
    model.release(0)
    model.release(1)
    return {"ids": [s.token_id for s in samples], "logprobs": [s.logprob for s in samples]}


def compare(one: JaxModel, load_split) -> dict:
    """`one` (tensor parallel, one-executable step) against the model `load_split()` loads with the
    same options and `split_sampler=True`: each one's samples, the split one's sampler calls, its
    mesh size and its compilations after warm-up."""
    assert not one.split_sampler
    want = calls(one)
    split = load_split()
    split.warm_up()
    warm = split.compilations()
    got = calls(split)
    return {"mesh": split.plan.size, "split_sampler": split.split_sampler, "one": want, "split": got,
            "calls": dict(split.sampler_calls), "compiled_after_warm_up": split.compilations() - warm}
