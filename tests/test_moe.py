"""Mixture of experts (issue 44 part 5): the shared MoE block (engine.jax_backend.moe) and the two
families on it, Qwen3-MoE and Mixtral, against transformers: tests/assets/tiny-qwen3-moe (8
experts of 32 features, top-2 not renormalised, q/k norms, its middle layer a dense MLP) and
tiny-mixtral (4 experts of 64 features, top-2), made by transformers 5.24 through
scripts/make_tiny_checkpoints.py with norm weights drawn around 1.

- Per op: the three routings (Mixtral's top-k-then-softmax equals the renormalised softmax), and
  the grouped product's forms (per-row gather, the CPU's blocks, ragged_dot, the CPU kernel)
  equal to each row times its own expert.
- The configs: which layers are MoE (mlp_only_layers, decoder_sparse_step), the routing, and the
  refusals; int8 / fp8 refused for MoE and `--weights auto` choosing float32, saying why.
- The whole model, tiny-qwen3-moe in plain JAX and tiny-mixtral on the C++ kernels (one
  path each keeps the compiles few; the attention paths are the dense families' and tested
  there): logits within ATOL and greedy ids equal to the goldens, each cached decode step equal
  to a full prefill; a prompt in chunks, packed with the others, and riding along with decode
  steps.
- bfloat16 within the stated tolerance of float32 (tiny-qwen3-moe's prompts); the memory plan's
  weights equal to the arrays placed; tiny-qwen3-moe served by JaxModel on the CPU kernels, in
  the smallest configuration (warm-up compiles its dense and its MoE layer), with greedy ids
  equal to the goldens and nothing compiling after warm-up. Tensor parallelism: tests/test_tensor_parallel.py runs both
  checkpoints at TP=2 (tests/support/forced_devices.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.core.model import DecodeInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend import cpu_kernels, families, loading, memory_plan, mesh, moe, quantize, transformer
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.weights import load_checkpoint, packed_head, with_panels
from engine.model_store.checkpoint import CheckpointError, parse_config
from services import cli
from support import golden_parity, prerequisites
from support.compile_watch import compile_events
from support.pages import own_pages

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
QWEN3_MOE, MIXTRAL = ASSETS / "tiny-qwen3-moe", ASSETS / "tiny-mixtral"
RAW = {d: json.loads((d / "config.json").read_text()) for d in (QWEN3_MOE, MIXTRAL)}
CASES = {d: json.loads((d / "golden.json").read_text())["cases"] for d in (QWEN3_MOE, MIXTRAL)}
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5
BF16_RTOL = 0.03  # as tests/test_bfloat16.py: |bf16 - f32| <= 3% of the step's largest |f32 logit|



def test_routings_mixtrals_top_k_softmax_equals_the_renormalised_softmax():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)), jnp.float32)  # [T, X]
    plain, plain_ids = moe.route(logits, 2, "softmax")
    renormed, ids = moe.route(logits, 2, "softmax_renormalized")
    topk, topk_ids = moe.route(logits, 2, "topk_softmax")
    np.testing.assert_array_equal(ids, topk_ids)
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_allclose(renormed, topk, atol=1e-6)
    np.testing.assert_allclose(np.sum(renormed, -1), 1.0, atol=1e-6)
    probs = jax.nn.softmax(logits, -1)
    np.testing.assert_allclose(plain, np.take_along_axis(np.asarray(probs), np.asarray(ids), -1), atol=1e-7)
    assert np.all(np.sum(plain, -1) < 1.0)  # not renormalised
    with pytest.raises(ValueError, match="unknown routing 'sigmoid'"):
        moe.route(logits, 2, "sigmoid")


@pytest.mark.parametrize("rows", [5, 300])  # at most X (gathered per row), more (the CPU's blocks)
def test_the_grouped_products_forms_multiply_each_row_by_its_own_expert(rows):
    r = np.random.default_rng(rows)
    experts = np.sort(r.integers(0, 8, rows)).astype(np.int32)  # [M], some experts with no rows
    experts[experts == 3] = 4
    sizes = np.bincount(experts, minlength=8).astype(np.int32)
    x, w = r.standard_normal((rows, 16), np.float32), r.standard_normal((8, 16, 24), np.float32)
    want = np.einsum("mi,mio->mo", x, w[experts])
    got = moe.grouped_product(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), jnp.asarray(experts))
    np.testing.assert_allclose(got, want, atol=1e-4)
    ragged = jax.lax.ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))  # the accelerators' form
    np.testing.assert_allclose(ragged, want, atol=1e-4)
    prerequisites.cpu_kernels()  # and the CPU kernel's, over each expert packed in panels
    panels = jax.vmap(cpu_kernels.pack_panels)(jnp.asarray(w))
    kernel = jax.jit(moe.grouped_product)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), jnp.asarray(experts), panels)
    np.testing.assert_allclose(kernel, want, atol=1e-4)
    assert moe.copied_experts(rows, 8) == (rows if rows <= 8 else -(-rows // moe.block_rows(rows, 8)) + 8)


def test_the_moe_benchmark_times_the_kernels_on_a_served_models_threads(tmp_path):
    """benchmarks/moe.py at a toy size: the kernels on the threads a served model's load gives
    them (it once left them on one thread against XLA's GEMM on all), each block's calls over its
    weight sets, and the experts each call reads counted from the routing."""
    from benchmarks import moe as bench

    kernels = prerequisites.cpu_kernels()
    cpu_kernels.set_threads(kernels, 1 if cpu_kernels.available_cpus() > 1 else 2)  # not what the benchmark must set
    out = tmp_path / "moe.json"
    args = ["--hidden", "64", "--experts", "4", "--expert-ffn", "32", "--tokens", "1,8", "--rounds", "1", "--calls", "1",
            "--sets", "2", "--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert cpu_kernels.threads(kernels) == result["threads"] == cpu_kernels.available_cpus()
    one, eight = result["rows"]
    assert one["experts_read"] == 2 and 2 <= eight["experts_read"] <= 4
    assert all(r["moe_ms"] > 0 and r["dense_ms"] > 0 for r in result["rows"])
    assert eight["per_weight_read"] == pytest.approx(eight["ratio"] * 2 / eight["experts_read"])


def test_the_configs_say_which_layers_are_moe_and_how_they_route():
    qwen, mixtral = parse_config(RAW[QWEN3_MOE]), parse_config(RAW[MIXTRAL])
    assert (qwen.moe_layers, qwen.routing, qwen.n_experts, qwen.experts_per_token, qwen.expert_ffn_size) == (
        (True, False, True), "softmax", 8, 2, 32)
    assert qwen.qk_norm and not mixtral.qk_norm and qwen.ffn_size == 128
    assert (mixtral.moe_layers, mixtral.routing, mixtral.n_experts, mixtral.expert_ffn_size) == ((True, True), "topk_softmax", 4, 64)
    hub = {k: v for k, v in RAW[QWEN3_MOE].items() if k != "num_local_experts"} | {"num_experts": 8}  # the Hub's key
    assert parse_config({**hub, "norm_topk_prob": True}).routing == "softmax_renormalized"
    assert parse_config({**hub, "mlp_only_layers": [], "decoder_sparse_step": 2}).moe_layers == (False, True, False)
    assert families.block(qwen) is families.block(mixtral) is families.SPARSE_MOE
    with pytest.raises(CheckpointError, match="MixtralForCausalLM: num_experts_per_tok 5 exceeds the 4 experts"):
        parse_config({**RAW[MIXTRAL], "num_experts_per_tok": 5})
    with pytest.raises(CheckpointError, match="Qwen3MoeForCausalLM: unsupported hidden_act 'gelu'"):
        parse_config({**RAW[QWEN3_MOE], "hidden_act": "gelu"})
    with pytest.raises(mesh.TensorParallelError, match="expert intermediate size 33"):
        mesh.check_sizes(replace(qwen, expert_ffn_size=33), 2)


def test_int8_is_refused_for_moe_and_auto_chooses_float32_saying_why(caplog, tmp_path):
    with pytest.raises(ValueError, match="--weights int8 cannot serve Qwen3MoeForCausalLM: a mixture of experts runs in float32"):
        JaxModel.load(QWEN3_MOE, max_batch_size=1, max_context_length=CONTEXT, weights="int8")
    (tmp_path / "model.gguf").write_bytes(b"")  # even beside a GGUF (which would otherwise pick int8)
    (tmp_path / "config.json").write_text(json.dumps(RAW[MIXTRAL]))
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        assert loading.auto_weights(tmp_path, kernels=True) == "float32"
    assert "weights auto: float32 (MixtralForCausalLM: a mixture of experts runs in float32 or bfloat16" in caplog.text


def test_the_cli_refuses_int8_moe_with_exit_2_and_the_reason_last(capsys):
    # In this process (a child would import JAX again to refuse), with the compilation cache off so
    # that the CLI leaves this process's cache where conftest put it.
    argv = ["generate", "--local", "--model", str(MIXTRAL), "--weights", "int8", "--compilation-cache", "off", "hi"]
    assert cli.main(argv) == 2
    assert "--weights int8 cannot serve MixtralForCausalLM" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("checkpoint", [QWEN3_MOE, MIXTRAL], ids=["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("panels", [False, True], ids=["float32", "float32+copies"])
def test_the_memory_plan_counts_the_experts_as_placed(checkpoint, panels):
    ckpt = load_checkpoint(checkpoint, "float32")
    w = ckpt.weights
    if panels:  # the CPU kernels' copies: of the attention, a dense layer's MLP and the head; none of the experts
        w = replace(w, layers=tuple(map(with_panels, w.layers)), lm_head=packed_head(w.lm_head))
    s = memory_plan.Settings(2, CONTEXT, 512, 9, 16, 4, panel_copies=panels)
    plan = memory_plan.plan(ckpt.config, ckpt.tokenizer_size, s)
    assert plan.weights == quantize.weight_bytes(w)
    assert plan.temporaries > memory_plan.plan(replace(ckpt.config, n_experts=0), ckpt.tokenizer_size, s).temporaries


@pytest.fixture(scope="module", params=[(QWEN3_MOE, False), (MIXTRAL, True)], ids=["qwen3-moe-jax", "mixtral-kernels"])
def whole_model(request) -> tuple[Path, golden_parity.WholeModel]:
    """A checkpoint's whole-model calls on one attention path: tiny-qwen3-moe's in plain JAX,
    tiny-mixtral's on the C++ kernels (and tiny-qwen3-moe's on the kernels again in `served`)."""
    checkpoint, kernels = request.param
    return checkpoint, golden_parity.load(checkpoint, parse_config(RAW[checkpoint]), CONTEXT, kernels)


@pytest.mark.usefixtures("on_the_cpu")
def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    checkpoint, m = whole_model
    golden_parity.check_goldens_and_cached_decode(m, CASES[checkpoint], BATCH, ATOL)


@pytest.mark.usefixtures("on_the_cpu")
def test_chunks_packed_prompts_and_chunks_riding_along_give_transformers_logits(whole_model):
    checkpoint, m = whole_model
    golden_parity.check_chunks_across_the_window_edge(m, CASES[checkpoint], BATCH, ATOL)
    golden_parity.check_packed(m, CASES[checkpoint], BATCH, ATOL)
    golden_parity.check_chunks_riding_along(m, CASES[checkpoint], BATCH, ATOL)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("whole_model", [(QWEN3_MOE, False)], ids=["qwen3-moe-jax"], indirect=True)
def test_bfloat16_logits_are_within_the_stated_tolerance_of_float32(whole_model):
    checkpoint, f32 = whole_model
    cfg = f32.cfg
    bf16 = replace(f32, weights=load_checkpoint(checkpoint, "bfloat16").weights)
    assert bf16.weights.layers[0].experts.gate_up.dtype == jnp.bfloat16
    for case in CASES[checkpoint]:
        cache = transformer.init_cache(cfg, 1, CONTEXT, jnp.bfloat16)
        low, _ = golden_parity.prefill(bf16, cache, case["prompt_ids"], 0, CONTEXT)
        cache = transformer.init_cache(cfg, 1, CONTEXT, jnp.float32)
        high, _ = golden_parity.prefill(f32, cache, case["prompt_ids"], 0, CONTEXT)
        bound = BF16_RTOL * np.abs(high).max()
        assert np.abs(low.astype(np.float32) - high).max() <= bound
        assert not np.array_equal(low, high), "bfloat16 ran as float32"
        top2 = np.sort(high)[-2:]
        if top2[1] - top2[0] > 2 * bound:
            assert low.argmax() == high.argmax()


@pytest.fixture(scope="module")
def served() -> JaxModel:
    prerequisites.cpu_kernels()
    # The smallest configuration (1 slot: one row bucket, no packed prefill, no chunk along; one
    # prompt and one attend bucket): 11 shapes, each with the dense and the MoE layer, against 20
    # at 2 slots, whose packed prefill and chunk along of 64 tokens MoE makes the dearest compiles.
    # What this adds to the parity tests above: JaxModel's own steps (pages, sampling, the kernels)
    # on an MoE model, and a warm-up that covers both layer kinds; packed prompts and chunks along
    # are proven on the whole-model calls.
    m = JaxModel.load(
        QWEN3_MOE, max_batch_size=1, max_context_length=CONTEXT, min_bucket=CONTEXT, min_attend=CONTEXT, kernels=True,
        dtype="float32",
    )
    m.warm_up()
    return m


@pytest.mark.usefixtures("cpu_backend")
def test_served_by_jax_model_greedy_ids_equal_transformers_and_nothing_compiles_after_warm_up(served):
    m, greedy = served, SamplingParams(temperature=0.0, seed=0)
    before = m.compilations()
    with compile_events() as compiles:
        for i, case in enumerate(CASES[QWEN3_MOE]):
            slot = 0  # the one slot, released after each case
            own_pages(m, slot)
            out = [m.prefill(slot, case["prompt_ids"], SlotSetup(greedy, frozenset()), masked=False).token_id]
            for step in range(1, len(case["greedy_ids"])):
                position = len(case["prompt_ids"]) + step - 1
                out.append(m.decode([DecodeInput(slot, out[-1], position, False)])[0].token_id)
            assert out == case["greedy_ids"], f"case {i}"
            m.release(slot)
    assert compiles == [] and m.compilations() == before
