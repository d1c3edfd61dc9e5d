"""Run by tests/test_split_sampler.py in a fresh interpreter with 2 forced CPU devices (JAX reads
the device count only when its backend starts): tiny-llama at tensor parallelism 2, once with the
one-executable decode step and once split (`split_sampler`), the same calls on both (a greedy and
a sampled slot, greedy steps and mixed ones), and one JSON object on stdout: each run's ids and
logprobs, the split run's sampler calls and its compilations after warm-up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

import jax  # noqa: E402

from engine.core.model import DecodeInput, SlotSetup  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402

LLAMA = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"


def run(split: bool) -> tuple[dict, JaxModel, int]:
    model = JaxModel.load(LLAMA, max_batch_size=2, max_context_length=32, tensor_parallel=2, split_sampler=split)
    model.warm_up()
    compiled = model.compilations()
    setups = [SlotSetup(SamplingParams(seed=1), frozenset()), SlotSetup(SamplingParams(temperature=1.0, seed=5), frozenset())]
    samples = [model.prefill(slot, [3, 4, 5 + slot], setups[slot], False) for slot in (0, 1)]
    length = {0: 3, 1: 3}
    for slots in ([0], [0], [0, 1], [0, 1], [0]):
        samples += model.decode([DecodeInput(s, None, length[s], False) for s in slots])
        for s in slots:
            length[s] += 1
    out = {"ids": [s.token_id for s in samples], "logprobs": [s.logprob for s in samples]}
    return out, model, model.compilations() - compiled


def main() -> None:
    one, _, _ = run(False)
    split, model, after = run(True)
    print(json.dumps({"devices": len(jax.devices()), "one": one, "split": split, "calls": dict(model.sampler_calls),
                      "compiled_after_warm_up": after}))


if __name__ == "__main__":
    main()
