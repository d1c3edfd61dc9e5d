"""The decode step with its head and sampling as their own executable (`split_sampler`, the
accelerator default), whose greedy variant the host picks for a step whose rows are all greedy
and want no alternatives.

What must hold: the split step gives what the one-executable step gives (ids, logprobs,
alternatives, masking, a chunk along), for greedy and sampled rows in one batch; the host picks
the greedy variant exactly when no row samples and none wants alternatives (and never when
`greedy_variant` is off); nothing compiles after warm-up; and the same under a mesh of two
devices. Run on the CPU, where the split is off by default, by asking for it.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine.core.model import ChunkInput, DecodeInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend.jax_model import JaxModel
from support import forced_devices, tiny_served
from support.backend import require_cpu
from support.pages import own_pages

GREEDY = SamplingParams(temperature=0.0, seed=0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
ALTERNATIVES = SamplingParams(temperature=0.0, seed=0, top_logprobs=3)


def _load(name: str, split: bool) -> JaxModel:
    model = tiny_served.load(name, split_sampler=split)  # the one-executable step is the shared configuration's own
    model.warm_up()
    return model


@pytest.fixture(scope="module")
def split() -> tuple[JaxModel, int]:
    """The split model, warmed up once for both tests that run it (each starts it `_fresh`), and
    its compilations at the end of warm-up: whichever test runs first, nothing may compile after."""
    model = _load("tiny-llama", True)
    return model, model.compilations()


def _fresh(model: JaxModel) -> JaxModel:
    """`model` as warm-up left it, whatever a test before did: every slot free, the greedy
    variant on, no sampler call counted."""
    for slot in range(model.info.max_batch_size):
        model.release(slot)
    model.greedy_variant = True
    model.sampler_calls.clear()
    return model


def _run(model: JaxModel) -> list:
    """Prompts into slots 0-2 (greedy with all ids but three masked, sampled, greedy with alternatives),
    then steps: slot 0 alone (greedy), 0 and 2 (alternatives), all three (sampling), and slot 3's
    prompt chunk along with a step. -> every sample, in order."""
    masked = SlotSetup(GREEDY, frozenset(range(model.info.vocab_size)) - {100, 200, 300})  # masked: one of these 3
    setups = [masked, SlotSetup(SAMPLED, frozenset()), SlotSetup(ALTERNATIVES, frozenset())]
    out, length = [], {}
    for slot in range(4):
        own_pages(model, slot)
    for slot, setup in enumerate(setups):
        prompt = [5 + slot, 17, 40 + slot]
        out.append(model.prefill(slot, prompt, setup, slot == 0))
        length[slot] = len(prompt)
    long_prompt = list(range(3, 3 + 12))
    for step, slots in enumerate([[0], [0], [0, 2], [0, 1, 2], [0, 1, 2]]):
        inputs = [DecodeInput(s, None, length[s], s == 0) for s in slots]
        chunk = ChunkInput(3, long_prompt, 0, 8, SlotSetup(GREEDY, frozenset())) if step == 4 else None
        model.dispatch(inputs, chunk)
        out.extend(model.collect())
        for s in slots:
            length[s] += 1
    out.append(model.prefill_chunk(3, long_prompt, 8, len(long_prompt), SlotSetup(GREEDY, frozenset()), False))
    return out


def test_the_split_step_gives_what_the_one_executable_step_gives_and_compiles_nothing_after_warm_up(split):
    require_cpu()  # equal logprobs: float32 on XLA:CPU (tests/support/backend.py)
    (split, warm), one = split, _load("tiny-llama", False)
    _fresh(split)
    assert not one.split_sampler and split.split_sampler
    want, got = _run(one), _run(split)
    assert split.compilations() == warm  # here, nor in the other test if it ran first
    assert [s.token_id for s in got] == [s.token_id for s in want]
    np.testing.assert_allclose([s.logprob for s in got], [s.logprob for s in want], atol=1e-6)
    for g, w in zip(got, want):
        assert [i for i, _ in g.top_logprobs] == [i for i, _ in w.top_logprobs]
        np.testing.assert_allclose([p for _, p in g.top_logprobs], [p for _, p in w.top_logprobs], atol=1e-6)
    assert any(len(s.top_logprobs) == 3 for s in got)  # the alternatives were asked for and came
    assert {s.token_id for s in got[:1] + got[3:4]} <= {100, 200, 300}  # slot 0's masked prefill and first step
    assert split.sampler_calls["greedy"] and split.sampler_calls["full"]


def test_the_host_picks_the_greedy_sampler_only_when_no_row_samples_or_wants_alternatives(split):
    model = _fresh(split[0])
    for slot, params in enumerate([GREEDY, GREEDY, SAMPLED, ALTERNATIVES]):
        own_pages(model, slot)
        model.prefill(slot, [5, 6, 7], SlotSetup(params, frozenset()), False)
    length = dict.fromkeys(range(4), 3)

    def step(*slots: int) -> str:
        model.sampler_calls.clear()
        model.decode([DecodeInput(s, None, length[s], False) for s in slots])
        for s in slots:
            length[s] += 1
        (variant,) = model.sampler_calls
        return variant

    assert step(0) == "greedy"
    assert step(0, 1) == "greedy"
    assert step(0, 1, 2) == "full"  # one row samples
    assert step(0, 3) == "full"  # one row wants alternatives
    assert step(1) == "greedy"  # slots 2 and 3 are idle in this step's rows: they do not count
    model.greedy_variant = False
    assert step(0) == "full"


def test_under_a_mesh_of_two_devices_the_split_step_gives_what_the_one_executable_step_gives(tmp_path_factory):
    """In the child interpreter with forced CPU devices that tests/test_tensor_parallel.py reads
    too (JAX fixes its device count when it starts): tiny-llama at tensor parallelism 2 through
    the split step, warmed up, against the one-executable step on one device (the reference run):
    the same greedy ids, alone and beside another request, and the same seeded samples (top_k and
    top_p), logprobs within the all-reduce's rounding (tests/test_tensor_parallel.py)."""
    runs = forced_devices.runs(tmp_path_factory)
    split, one = runs[forced_devices.SPLIT], runs[f"{forced_devices.TWO_SLOTS}/1"]
    assert sorted(split["sharded_per_device"]) == ["0", "1"] and split["compiled_after_warm_up"] == 0
    assert split["split_sampler"] and not one["split_sampler"]
    assert split["greedy"] == one["greedy"] and split["beside"] == split["greedy"]
    assert split["sampled"] == one["sampled"] and len(set(one["sampled"])) > 1
    np.testing.assert_allclose(split["logprobs"], one["logprobs"], atol=1e-5)
    assert split["sampler_calls"]["greedy"] and split["sampler_calls"]["full"]  # greedy steps, then sampled ones
