"""The accelerator's sampler as the decode step runs it, lowered for CUDA on the CPU (JAX lowers for
another platform without its device): no sort, no top-k over the vocabulary, no scatter and no
conditional or loop in the StableHLO an XLA:GPU would compile (issue 42).

Lowered: the tiny checkpoint's jitted steps, as JaxModel holds them (`model._steps`), with the head
and the mask widened to a real vocabulary (Llama 3's 128,256 ids) as abstract shapes, so the
top-k pieces show against a row of that width. The steps: the split sampler's full variant
(`step_sampler`, what an accelerator runs for any step with a sampled row or alternatives), its
greedy variant (every sampling call, prompts' too, goes through one of the two), and the
one-executable greedy decode step (layers, head and the greedy sampler). Lowering costs no
compile; the test reads the module's operations.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.sampling import TOP_K_PIECE
from support.lowering import stablehlo_ops

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128_256  # Llama 3's ids: a row far wider than a top-k chunk
ROWS = 4


@pytest.fixture(scope="module")
def model() -> JaxModel:
    # kernels off: a GPU's layers are plain JAX (the CPU kernels' custom calls do not lower for CUDA)
    return JaxModel.load(ROOT / "tests" / "assets" / "tiny-llama", max_batch_size=ROWS, max_context_length=32,
                         kernels=False, dtype="float32", split_sampler=True)


def _lowered_steps(model: JaxModel, platform: str = "cuda") -> dict[str, object]:
    """Each sampling step of `model` lowered for `platform` at ROWS rows, head [E, VOCAB] -> its StableHLO."""
    s, w, cfg = model._steps, model._weights, model.config
    head = jax.ShapeDtypeStruct((cfg.hidden_size, VOCAB), jnp.float32)  # [E, V]
    mask = jax.ShapeDtypeStruct((ROWS, VOCAB), bool)  # [B, V]
    ints, floats = model._sampling.pack([], ROWS, model._slots.tables)  # [R, 9 + W], [R, 3]
    x = jax.ShapeDtypeStruct((ROWS, 1, cfg.hidden_size), jnp.float32)  # [R, 1, E]
    slots = jax.ShapeDtypeStruct((ROWS,), jnp.int32)
    sampler = (x, w.final_norm, head, mask, model._last, ints, floats, slots)
    traced = {
        "split sampler, full": s.step_sampler.trace(*sampler, cfg=cfg),
        "split sampler, greedy": s.step_sampler.trace(*sampler, cfg=cfg, greedy_only=True),
        "one-executable greedy decode step": s.step.trace(
            w.embed, w.final_norm, head, model._decode_weights, model.cache.k, model.cache.v, model._last, mask,
            ints, cfg=cfg, attend=model.info.max_context_length),
    }
    return {name: t.lower(lowering_platforms=(platform,)).compiler_ir("stablehlo") for name, t in traced.items()}


def _forbidden(module) -> list[str]:
    """What in `module` an accelerator's sampler must not have: a sort; a top-k over a row of the
    vocabulary's width, or of k above TOP_K_PIECE (XLA:GPU's own top-k kernel takes k <= 16); a
    top-k as a custom call; a scatter of one update per id (a histogram: atomic adds on a GPU;
    writing each row's sample into `last` is a scatter of R updates, and stays); a while or an if; a case other than
    lax.platform_dependent's pick of the platform's code (a constant index, or one branch, which
    XLA folds away)."""
    found = []
    for op in stablehlo_ops(module):
        name = op.name
        if name in ("stablehlo.sort", "stablehlo.while", "stablehlo.if", "mhlo.topk"):
            found.append(name)
        elif name == "stablehlo.scatter" and math.prod(op.operands[-1].type.shape) >= VOCAB:
            found.append("stablehlo.scatter per id")
        elif name == "chlo.top_k":
            width, k = op.operands[0].type.shape[-1], op.results[0].type.shape[-1]
            if width >= VOCAB or k > TOP_K_PIECE:
                found.append(f"chlo.top_k over {width}, k {k}")
        elif name == "stablehlo.custom_call" and "topk" in str(op.attributes["call_target_name"]).lower():
            found.append(f"custom_call {op.attributes['call_target_name']}")
        elif name == "stablehlo.case" and len(op.regions) > 1 and op.operands[0].owner.name != "stablehlo.constant":
            found.append(name)
    return found


def test_the_accelerator_sampler_lowered_for_cuda_has_no_sort_no_vocabulary_top_k_and_no_conditional(model):
    modules = _lowered_steps(model)
    for name, module in modules.items():
        assert _forbidden(module) == [], name
    top_ks = [op for op in stablehlo_ops(modules["split sampler, full"]) if op.name == "chlo.top_k"]
    assert len(top_ks) == 4  # top_logprobs' two pieces (16 + 4), each over chunks and then over their winners


def test_the_cpu_lowering_of_the_same_steps_has_what_the_check_looks_for(model):
    """The check can fail: lowered for the CPU, the full sampler keeps its branches, its lax.top_k
    over the whole row and the exact select's scatter-adds (sampling.py's CPU strategy)."""
    found = set(_forbidden(_lowered_steps(model, "cpu")["split sampler, full"]))
    assert {"stablehlo.case", "stablehlo.scatter per id", f"chlo.top_k over {VOCAB}, k 128"} <= found, found
