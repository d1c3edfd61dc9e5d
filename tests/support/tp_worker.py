"""Run by tests/test_tensor_parallel.py in a fresh interpreter with 4 forced CPU devices (JAX
reads the device count only when its backend starts, and the test session's JAX has one): the
tiny checkpoints at the tensor-parallel sizes given (`NAME:SIZE,SIZE ...`), and one JSON object
on stdout with what the tests assert on. A spec `NAME:SIZES:2` runs with two slots, and also
runs the batch-invariance and seeded-sampling cases (each slot count is a few more compiles). One interpreter for all of it, because each JAX start
costs seconds.

Per (checkpoint, size): greedy ids and logprobs of the golden prompt through the engine's own
calls (prefill, then decode; forced_devices.IDS_ONLY's families with the split sampler), with two
slots a seeded sampled run and, under a mesh, the same request again beside a second one (batch
invariance), the prompt's next-token logits, compilations after warm-up (none at size 1, the
reference, which is not warmed up: what warm-up covers on one device is the in-process tests'
claim; none at 4 devices nor for IDS_ONLY's families, which are not warmed up either), and what
each device holds of the weights and of the KV cache.

The two-slot tiny-llama model at size 2 (forced_devices.SPLIT) runs with the split sampler, the
accelerators' step, warmed up: its greedy and seeded ids equal the one-device reference's (the
one-executable step), and it records which sampler variants its steps ran
(tests/test_split_sampler.py reads that run too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from engine.core.model import DecodeInput, SlotSetup  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.jax_backend import mesh, transformer  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from tests.support.forced_devices import IDS_ONLY, SPLIT  # noqa: E402
from tests.support.pages import own_pages_all  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "assets"
STEPS = 12
CONTEXT = 32


def greedy(model: JaxModel, slot: int, prompt: list[int], steps: int, other: list[int] | None = None) -> tuple[list, list]:
    """Prefill `prompt` into `slot` (and `other` into slot 1 - slot, decoded alongside), decode."""
    setup = SlotSetup(SamplingParams(seed=1), frozenset())
    own_pages_all(model)
    first = model.prefill(slot, prompt, setup, False)
    ids, logprobs = [first.token_id], [first.logprob]
    if other is not None:
        other_last = model.prefill(1 - slot, other, setup, False).token_id
    for i in range(steps - 1):
        inputs = [DecodeInput(slot, ids[-1], len(prompt) + i, False)]
        if other is not None:
            inputs.append(DecodeInput(1 - slot, other_last, len(other) + i, False))
        samples = model.decode(inputs)
        ids.append(samples[0].token_id)
        logprobs.append(samples[0].logprob)
        if other is not None:
            other_last = samples[1].token_id
    model.release(slot)
    if other is not None:
        model.release(1 - slot)
    return ids, logprobs


def sampled(model: JaxModel, prompt: list[int], steps: int) -> list[int]:
    setup = SlotSetup(SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234), frozenset())
    own_pages_all(model)
    ids = [model.prefill(0, prompt, setup, False).token_id]
    for i in range(steps - 1):
        ids.append(model.decode([DecodeInput(0, ids[-1], len(prompt) + i, False)])[0].token_id)
    model.release(0)
    return ids


def logits(model: JaxModel, prompt: list[int]) -> list[float]:
    """The prompt's next-token logits [V'], through the model's own compiled prefill (embed and
    layer calls, as warmed up) and the head on its (sharded) weights: only the head compiles."""
    w = model._weights
    tokens = np.zeros(model.buckets[-1], np.int32)  # the largest chunk (16): any prompt here fits
    tokens[: len(prompt)] = prompt
    x = model._steps.embed(w.embed, tokens[None])  # [1, C, E]
    zero = np.int32(0)  # the null table: every write to the null page (the head reads x, not the pool)
    x = model._through(model._steps.prefill_layers, x, model._put_once(model._null_table), zero, zero, zero)
    out = jax.jit(transformer.logits, static_argnames="cfg")(x[0, len(prompt) - 1], w.final_norm, w.lm_head, cfg=model.config)
    return np.asarray(out)[: model._head_size].tolist()  # V': a padded head cut back, as sampling does


def held(model: JaxModel) -> dict:
    """Bytes per device of the sharded weights, of all weights, and of the KV cache, and the
    specs of the sharded ones."""
    w = model._weights
    sharded = [w.embed, w.lm_head] + [
        a for layer in w.layers for a in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down, layer.b_qkv) if a is not None
    ]
    cache = model.cache
    return {
        "sharded_total": sum(int(a.nbytes) for a in sharded),
        "sharded_per_device": mesh.device_bytes(sharded),
        "cache_total": sum(int(a.nbytes) for a in cache.k + cache.v),
        "cache_per_device": mesh.device_bytes(cache.k + cache.v),
        "specs": sorted({str(a.sharding.spec) for a in sharded}) if model.plan is not None else [],
        "cache_specs": sorted({str(a.sharding.spec) for a in cache.k + cache.v}) if model.plan is not None else [],
    }


def main() -> None:
    out: dict = {"devices": jax.device_count()}
    for spec in sys.argv[1:]:
        name, sizes, slots = (spec + ":1").split(":")[:3]
        case = json.loads((ASSETS / name / "golden.json").read_text())["cases"][0]
        prompt = case["prompt_ids"]
        for size in map(int, sizes.split(",")):
            options = dict(max_batch_size=int(slots), max_context_length=CONTEXT, max_chunk=16, tensor_parallel=size)
            ids_only = Path(name).name in IDS_ONLY
            # IDS_ONLY families and SPLIT decode through the split sampler (the accelerators' default step;
            # why: forced_devices)
            split = ids_only or (f"{name}/{size}" == SPLIT and int(slots) == 2)
            model = JaxModel.load(ASSETS / name, **options, **({"split_sampler": True} if split else {}))
            # warmed at 2 ways only: one device is the reference, the IDS_ONLY families compare ids
            # and shares, and 4 ways (kv heads copied) ids, samples and shares: each compiles what
            # it runs (forced_devices says why)
            warmed = size == 2 and not ids_only
            if warmed:
                model.warm_up()
            warm = model.compilations()
            ids, logprobs = greedy(model, 0, prompt, STEPS)
            two = int(slots) == 2
            out[f"{name}/{size}"] = {
                "greedy": ids,
                "logprobs": logprobs,
                # batch invariance is asserted under the mesh only (test_tensor_parallel, sizes 2 and 4)
                "beside": greedy(model, 1, prompt, STEPS, other=prompt[:5])[0] if two and size > 1 else None,
                "sampled": sampled(model, prompt, STEPS) if two else None,
                "logits": logits(model, prompt),
                "compiled_after_warm_up": model.compilations() - warm if warmed else None,
                "kernel_state": model.kernel_state,
                "kv_heads": model.config.n_kv_heads,
                "head_shape": list(model._weights.lm_head.shape),
                "split_sampler": model.split_sampler,
                "sampler_calls": dict(model.sampler_calls),  # split: the steps of each variant
                **held(model),
            }
            del model
    print(json.dumps(out))


if __name__ == "__main__":
    main()
