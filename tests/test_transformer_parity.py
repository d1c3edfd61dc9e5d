"""engine.jax_backend.transformer against transformers' own outputs (tests/assets/tiny-*/golden.json, made by
scripts/make_tiny_checkpoints.py with torch 2.13.0 / transformers 5.24.0).

Each golden case is run the way the engine runs it: prefill into a slot of a batch, then decode
one token per step with the other slots idle; logits must match within float32 noise and the
greedy ids exactly (the goldens keep every greedy step >= 2e-3 away from a tie). Decode runs
in plain JAX and with the CPU kernels (engine.jax_backend.cpu_kernels: attention, and the one-row products
since each step here decodes one slot).

Float32 noise is a CPU claim (a GPU's float32 products may run as TF32): the weights are loaded as
float32 and every array and call is placed on the CPU device, whatever JAX's default backend is, so
the test means the same on a GPU host. tests/test_bfloat16.py bounds bfloat16 against float32."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import transformer
from engine.jax_backend.weights import load_checkpoint, with_panels
from support import prerequisites

ASSETS = Path(__file__).parent / "assets"
BATCH, CONTEXT, PROMPT_BUCKET = 3, 64, 32
ATOL = 1e-4  # goldens are rounded to 1e-5; f32 differences seen are ~1e-5


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # conftest: arrays and calls on the CPU device


@pytest.mark.parametrize("kernels", [False, True], ids=["jax-attention", "kernel-attention"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_logits_and_greedy_ids_match_transformers(name, kernels):
    if kernels:
        prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
    ckpt = load_checkpoint(ASSETS / name, dtype="float32")
    cfg = ckpt.config
    weights = ckpt.weights
    if kernels:  # decode steps and short prompts then run their products on the kernel too
        weights = replace(weights, layers=tuple(map(with_panels, weights.layers)))
    cases = json.loads((ASSETS / name / "golden.json").read_text())["cases"]
    prefill = jax.jit(transformer.prefill, static_argnames="cfg", donate_argnums=1)
    decode = jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels"), donate_argnums=1)
    cache = transformer.init_cache(cfg, BATCH, CONTEXT, jnp.float32)
    for slot, case in enumerate(cases):
        prompt = case["prompt_ids"]
        tokens = np.zeros(PROMPT_BUCKET, np.int32)
        tokens[: len(prompt)] = prompt
        logits, cache = prefill(weights, cache, tokens, np.int32(len(prompt)), np.int32(slot), cfg=cfg)
        np.testing.assert_allclose(np.asarray(logits), case["first_logits"], atol=ATOL, rtol=0)
        greedy = [int(np.argmax(logits))]
        for step, expected in enumerate(case["steps"][1:], start=1):
            ids, positions, active = (np.zeros(BATCH, np.int32) for _ in range(3))
            ids[slot], positions[slot], active[slot] = greedy[-1], len(prompt) + step - 1, 1
            logits, cache = decode(
                weights, cache, ids, positions, active.astype(bool), cfg=cfg, attend=CONTEXT, kernels=kernels
            )
            row = np.asarray(logits)[slot]
            np.testing.assert_allclose(row[expected["ids"]], expected["logits"], atol=ATOL, rtol=0)
            greedy.append(int(np.argmax(row)))
        assert greedy == case["greedy_ids"], f"{name} case {slot}"
