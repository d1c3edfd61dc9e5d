"""gpt-oss (GptOssForCausalLM, issue 44 part 5) against transformers: tests/assets/tiny-gpt-oss,
made by transformers 5.24 through scripts/make_tiny_checkpoints.py (3 layers: local (window 8),
global, local; 4 experts of 64 features, top-2; YaRN factor 4 over an original context of 64;
the SwiGLU clamp at 1.0, so it bites; sinks ~ N(0, 1) and every bias ~ N(0, 0.25); norm weights
drawn around 1; prompts of 11, 28 and 2 tokens and 16 greedy steps, so the window is outgrown).

- The config: windows, YaRN, routing, the experts' activation, from transformers 5's keys and the
  Hub's older ones; an unsupported quantization or attention_bias false refused by name.
- Per op: attention sinks in every XLA path (decode, chunk, packed, whole) and in the Pallas
  kernel (interpret mode) against a plain numpy softmax with the sink as one more logit; in the
  C++ CPU kernels (decode, and chunk with its key splits merged; both ISAs; with a window and a
  soft-cap too) against the XLA paths; a model without sinks calls the kernels it called before;
  the clamped SwiGLU against its formula, where the clamps bite.
- MXFP4: our unpacking bit for bit against transformers' own dequantization (a sample with every
  code in both nibbles, in golden.json); tiny-gpt-oss's experts packed into gpt-oss's on-disk layout and
  loaded, bit for bit against a plainly written unpacking; a misshapen block refused.
- The whole model on the served CPU path (the C++ kernels: products, the experts' grouped
  product, decode and chunk attention with sinks; packed prompts on the XLA attention): logits
  within ATOL and greedy ids equal to the goldens, each cached decode step equal to a full
  prefill; a prompt in chunks across the window's edges, packed with the others, and riding
  along with decode steps.
- Served by JaxModel (1 slot), greedy ids equal to the goldens and nothing compiled after
  warm-up; the memory plan's weights equal to the arrays placed. TP=2: tests/test_tensor_parallel.py
  (tests/support/forced_devices.py, ids only).

Float32 on the CPU device, as tests/test_transformer_parity.py (whose module docstring says why).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.core.model import DecodeInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend import cpu_kernels, families, memory_plan, quantize, ragged_attention, transformer
from engine.jax_backend.families import gpt_oss
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.weights import load_checkpoint as load_on_device, packed_head, with_panels
from engine.model_store import mxfp4
from engine.model_store.checkpoint import CheckpointError, RopeScaling, load_checkpoint, parse_config
from support import golden_parity, prerequisites
from support.compile_watch import compile_events
from support.pages import own_pages

GPT_OSS = Path(__file__).parent / "assets" / "tiny-gpt-oss"
RAW = json.loads((GPT_OSS / "config.json").read_text())
GOLDEN = json.loads((GPT_OSS / "golden.json").read_text())
CASES = GOLDEN["cases"]
CFG = parse_config(RAW)
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5
ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_kernels._cpu_flags() else [])


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # conftest: arrays and calls on the CPU device


def test_the_config_gives_windows_yarn_routing_and_the_experts_activation():
    assert CFG.layer_windows == (8, None, 8) and CFG.sliding_window is None
    assert CFG.rope_scaling == RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=64, attention_factor=pytest.approx(1 + 0.1 * np.log(4)),
        beta_fast=32.0, beta_slow=1.0, truncate=False,
    )
    assert (CFG.n_experts, CFG.experts_per_token, CFG.expert_ffn_size, CFG.routing, CFG.moe_layers) == (
        4, 2, 64, "topk_softmax", (True, True, True))
    assert CFG.qkv_bias and CFG.o_bias and CFG.attention_sinks and CFG.expert_bias and not CFG.qk_norm
    assert (CFG.swiglu_alpha, CFG.swiglu_limit, CFG.head_dim, CFG.rope_theta) == (1.702, 1.0, 16, 1000.0)
    assert families.block(CFG) is families.GPT_OSS
    hub = {k: v for k, v in RAW.items() if k not in ("rope_parameters", "layer_types")} | {
        "rope_scaling": {k: v for k, v in RAW["rope_parameters"].items() if k != "rope_theta"}, "rope_theta": 1000.0,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    }  # the Hub's keys: every other layer local from the first, as transformers defaults
    assert parse_config(hub) == CFG
    with pytest.raises(CheckpointError, match="GptOssForCausalLM: quantization_config.quant_method 'bitsandbytes' is not supported"):
        parse_config({**RAW, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(CheckpointError, match="GptOssForCausalLM: attention_bias false is not supported"):
        parse_config({**RAW, "attention_bias": False})
    with pytest.raises(CheckpointError, match="num_experts_per_tok 5 exceeds the 4 experts"):
        parse_config({**RAW, "num_experts_per_tok": 5})


def _sink_reference(q, keys, values, seen, sinks):
    """Plain numpy: q [T, H, D], keys/values [S, K, D], seen [T, S], sinks [H] -> [T, H * D], each
    head's softmax over its seen scores and its sink (one more logit, no value) in float64."""
    t, h, d = q.shape
    g = h // keys.shape[1]
    out = np.zeros((t, h, d))
    for head in range(h):
        scores = q[:, head].astype(np.float64) @ keys[:, head // g].T.astype(np.float64) / np.sqrt(d)  # [T, S]
        scores = np.concatenate([np.where(seen, scores, -np.inf), np.full((t, 1), sinks[head])], axis=1)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, head] = (p / p.sum(axis=1, keepdims=True))[:, :-1] @ values[:, head // g]
    return out.reshape(t, h * d)


# Each path jitted whole, as the model calls it (op by op, each operation would compile its own
# executable on its first call).
DECODE = jax.jit(transformer.decode_attention, static_argnums=(5, 6))
CHUNK = jax.jit(transformer.chunk_attention, static_argnums=(5,), static_argnames=("block", "window"))
WHOLE = jax.jit(transformer.attention, static_argnums=(4, 5))
MASKED = jax.jit(transformer._masked_attention, static_argnums=(4,))
PALLAS = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret", "window"))
PALLAS_REFERENCE = jax.jit(ragged_attention.reference, static_argnames=("window",))


def test_attention_sinks_in_every_xla_path_and_the_pallas_kernel():
    rng = np.random.default_rng(44)
    page, width, kv, h, d = 8, 6, 2, 4, 16
    cfg = replace(CFG, n_heads=h, n_kv_heads=kv, head_dim=d)
    sinks = jnp.asarray(rng.standard_normal(h) + 1.0, jnp.float32)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((kv, 3 * width + 1, page, d)), jnp.float32) for _ in range(2))
    tables = jnp.asarray(1 + rng.permutation(3 * width).reshape(3, width), jnp.int32)  # [R, W]
    keys = np.asarray(transformer.gather_pages(k_pool, tables)).swapaxes(1, 2)  # [R, S, K, D]
    values = np.asarray(transformer.gather_pages(v_pool, tables)).swapaxes(1, 2)
    positions = np.array([3, 20, 41], np.int32)  # inside and past the window
    q = jnp.asarray(2 * rng.standard_normal((3, h, d)), jnp.float32)  # [R, H, D]
    s = np.arange(width * page)
    for window in (None, 8):
        want = np.stack([
            _sink_reference(np.asarray(q)[r : r + 1], keys[r], values[r], np.asarray(transformer.in_window(s, p, window))[None], sinks)[0]
            for r, p in enumerate(positions)
        ])  # [R, H*D]
        got = DECODE(q, k_pool, v_pool, tables, positions, cfg, window, sinks)
        np.testing.assert_allclose(got, want, atol=2e-5)
        plain = DECODE(q, k_pool, v_pool, tables, positions, cfg, window)
        assert not np.allclose(got, plain, atol=1e-2)  # the sinks take their share
    # A chunk of 12 queries at 30..41 over slot 2's pages, blocked (16 keys a block), and the
    # same queries against their own keys through the packed mask and the whole attention.
    start, c, window = 30, 12, 8
    qc = jnp.asarray(2 * rng.standard_normal((c, h, d)), jnp.float32)  # [C, H, D]
    seen = np.asarray(transformer.in_window(s[None, :], start + np.arange(c)[:, None], window))  # [C, S]
    want = _sink_reference(np.asarray(qc), keys[2], values[2], seen, sinks)
    got = CHUNK(qc, k_pool, v_pool, tables[2], jnp.int32(start), cfg, block=16, window=window, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=2e-5)
    whole = WHOLE(qc[None], keys[2][None], values[2][None], jnp.arange(start, start + c)[None], cfg, window, sinks)
    np.testing.assert_allclose(whole[0], want, atol=2e-5)
    own = np.asarray(transformer.in_window(np.arange(c)[None, :], np.arange(c)[:, None], window))  # [C, C]
    packed = MASKED(qc, jnp.asarray(keys[2][:c]), jnp.asarray(values[2][:c]), jnp.asarray(own), cfg, sinks)
    np.testing.assert_allclose(packed, _sink_reference(np.asarray(qc), keys[2][:c], values[2][:c], own, sinks), atol=2e-5)
    # The Pallas kernel (interpret mode): an idle row, rows inside and past the window, 2 splits.
    lengths = jnp.asarray([0, 5, 42], jnp.int32)
    got = PALLAS(q, k_pool, v_pool, tables, lengths, block_k=16, splits=2, interpret=True, window=window, sinks=sinks)
    np.testing.assert_allclose(got, PALLAS_REFERENCE(q, k_pool, v_pool, tables, lengths, window=window, sinks=sinks), atol=2e-5)
    xla = DECODE(q, k_pool, v_pool, tables, lengths - 1, cfg, window, sinks)
    np.testing.assert_allclose(np.asarray(got)[1:], np.asarray(xla)[1:], atol=2e-5)
    assert not np.asarray(got)[0].any()  # the idle row: zeros


@pytest.mark.parametrize("isa", ISAS)
def test_the_cpu_kernels_take_the_sinks_as_the_xla_paths_do(isa):
    kernels = prerequisites.cpu_kernels()
    assert cpu_kernels.decode_attention_isa(kernels, isa == "avx512") == isa
    assert cpu_kernels.chunk_attention_isa(kernels, isa == "avx512") == isa
    cpu_kernels.set_threads(kernels, 2)  # 2 threads: a short chunk splits its keys, then merges them
    try:
        rng = np.random.default_rng(7)
        page, width, kv, h, d = 8, 72, 2, 4, 16
        sinks = jnp.asarray(rng.standard_normal(h) + 1.0, jnp.float32)
        k_pool, v_pool = (jnp.asarray(rng.standard_normal((kv, 2 * width + 1, page, d)), jnp.float32) for _ in range(2))
        tables = jnp.asarray(1 + rng.permutation(2 * width).reshape(2, width), jnp.int32)  # [R, W]
        positions = jnp.asarray([6, 300], jnp.int32)
        q = jnp.asarray(2 * rng.standard_normal((2, h, d)), jnp.float32)
        qc = jnp.asarray(2 * rng.standard_normal((12, h, d)), jnp.float32)  # a chunk at 540..551: 5 key blocks
        for window, cap in ((None, None), (8, None), (300, 3.0)):
            cfg = replace(CFG, n_heads=h, n_kv_heads=kv, head_dim=d, attn_softcap=cap)
            want = transformer.decode_attention(q, k_pool, v_pool, tables, positions, cfg, window, sinks)
            got = cpu_kernels.decode_attention(q, k_pool, v_pool, tables, positions, window, cap, sinks)
            np.testing.assert_allclose(got, want, atol=2e-5)
            assert not np.allclose(got, cpu_kernels.decode_attention(q, k_pool, v_pool, tables, positions, window, cap), atol=1e-3)
            want = transformer.chunk_attention(qc, k_pool, v_pool, tables[1], jnp.int32(540), cfg, block=64, window=window, sinks=sinks)
            got = cpu_kernels.chunk_attention(qc, k_pool, v_pool, tables[1], np.int32(540), window, cap, sinks)
            np.testing.assert_allclose(got, want, atol=2e-5)
            assert not np.allclose(got, cpu_kernels.chunk_attention(qc, k_pool, v_pool, tables[1], np.int32(540), window, cap), atol=1e-4)
    finally:
        cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())  # (as tests/test_chunk_attention_kernel.py restores it)
        cpu_kernels.decode_attention_isa(kernels, True)
        cpu_kernels.chunk_attention_isa(kernels, True)


def test_without_sinks_the_kernels_called_are_those_of_before():
    q, pool = jnp.zeros((2, 4, 16), jnp.float32), jnp.zeros((2, 9, 8, 16), jnp.float32)
    tables, positions = jnp.ones((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)

    def lowered(sinks):
        def step(q, k, v, t, p):
            return transformer._decode_seen(q, k, v, t, p, p >= 0, CFG, 32, True, False, 8, sinks)
        return jax.jit(step).lower(q, pool, pool, tables, positions).as_text()

    assert cpu_kernels.SINKS_ATTENTION_TARGET in lowered(jnp.ones(4, jnp.float32))
    plain = lowered(None)
    assert cpu_kernels.WINDOW_ATTENTION_TARGET in plain and "sinks" not in plain


def test_the_clamped_swiglu_is_transformers_formula_where_both_clamps_bite():
    gate = jnp.asarray([[-3.0, -0.5, 0.0, 0.7, 1.0, 4.0]], jnp.float32)
    up = jnp.asarray([[-4.0, 2.0, 0.3, -1.0, 0.9, 5.0]], jnp.float32)
    g, u = np.minimum(np.asarray(gate), 1.0), np.clip(np.asarray(up), -1.0, 1.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(gpt_oss.clamped_swiglu(gate, up, 1.702, 1.0), want, rtol=1e-6)
    assert want[0, -1] == pytest.approx(2 / (1 + np.exp(-1.702)))  # gate 4 and up 5 clamped to 1


def test_mxfp4_unpacking_equals_transformers_dequantization_bit_for_bit():
    sample = GOLDEN["mxfp4"]
    blocks, scales = np.asarray(sample["blocks"], np.uint8), np.asarray(sample["scales"], np.uint8)
    want = np.asarray(sample["dequantized"], np.float32)  # [X, in, out], as transformers holds it
    got = mxfp4.unpack(blocks, scales).swapaxes(1, 2)  # [X, out, in] -> [X, in, out]
    assert got.shape == want.shape == (2, 64, 3)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for nibbles in (blocks & 15, blocks >> 4):  # every code in both halves of a byte, several scales
        assert len(np.unique(nibbles)) == 16
    assert len(np.unique(scales)) > 8
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.unpack(blocks.astype(np.int32), scales)


def _pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round w [..., in] to MXFP4 (each 32 values: the scale that fits the largest in 6, each value
    to the nearest e2m1 code) -> (blocks [..., in / 32, 16], scales [..., in / 32]) uint8."""
    groups = w.reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    exponent = np.ceil(np.log2(np.abs(groups).max(axis=-1) / 6.0)).astype(np.int32)  # [..., G]
    codes = np.abs(groups[..., None] / 2.0 ** exponent[..., None, None] - mxfp4.E2M1).argmin(axis=-1)  # [..., G, 32]
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exponent + 127, np.uint8)  # (save_file writes raw strides)


def _plain_unpack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The format written out plainly, one value at a time: [..., G, 16], [..., G] -> [..., G * 32]."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    out = np.zeros((*scales.shape, 32), np.float32)
    for index in np.ndindex(*blocks.shape):
        byte, scale = int(blocks[index]), int(scales[index[:-1]])
        for half, code in enumerate((byte & 15, byte >> 4)):
            sign = -1.0 if code & 8 else 1.0
            out[(*index[:-1], 2 * index[-1] + half)] = np.float32(sign * magnitudes[code & 7] * 2.0 ** (scale - 127))
    return out.reshape(*scales.shape[:-1], -1)


def test_mxfp4_experts_in_gpt_oss_layout_load_bit_for_bit_and_bad_ones_are_refused(tmp_path):
    folder = tmp_path / "tiny-gpt-oss-mxfp4"
    shutil.copytree(GPT_OSS, folder)
    tensors = load_file(GPT_OSS / "model.safetensors")
    packed = {}
    for name in list(tensors):
        if name.endswith(("gate_up_proj", "down_proj")):  # [X, in, out] -> on disk [X, out, in / 32, 16] + scales
            packed[name] = _pack(tensors.pop(name).swapaxes(1, 2))
            tensors[name + "_blocks"], tensors[name + "_scales"] = packed[name]
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**RAW, "quantization_config": {"quant_method": "mxfp4"}}))
    quantized, float_ = load_checkpoint(folder), load_checkpoint(GPT_OSS)
    for i, layer in enumerate(quantized.weights.layers):
        prefix = f"model.layers.{i}.mlp.experts."
        for name, got in ((prefix + "gate_up_proj", layer.experts.gate_up), (prefix + "down_proj", layer.experts.down)):
            want = _plain_unpack(*packed[name]).swapaxes(1, 2)  # [X, in, out]
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
        assert 0 < np.abs(layer.experts.gate_up - float_.weights.layers[i].experts.gate_up).max() < 0.5  # rounded, not the floats
        np.testing.assert_array_equal(layer.w_qkv, float_.weights.layers[i].w_qkv)
        np.testing.assert_array_equal(layer.experts.gate_up_bias, float_.weights.layers[i].experts.gate_up_bias)
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = tensors["model.layers.0.mlp.experts.down_proj_scales"][:, :8]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"down_proj_blocks \(4, 64, 2, 16\) / _scales \(4, 8, 2\), expected"):
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({**RAW, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        load_checkpoint(folder)


@pytest.fixture(scope="module")
def whole_model() -> golden_parity.WholeModel:
    """tiny-gpt-oss's whole-model calls on the served CPU path: the C++ kernels (the experts'
    grouped product and the attention with sinks included)."""
    return golden_parity.load(GPT_OSS, CFG, CONTEXT, kernels=True)


def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    golden_parity.check_goldens_and_cached_decode(whole_model, CASES, BATCH, ATOL)


def test_a_prompt_in_chunks_across_the_window_edge_packed_and_riding_along_gives_transformers_logits(whole_model):
    golden_parity.check_chunks_across_the_window_edge(whole_model, CASES, BATCH, ATOL)  # 28 tokens in pieces of 5
    golden_parity.check_packed(whole_model, CASES, BATCH, ATOL)
    golden_parity.check_chunks_riding_along(whole_model, CASES, BATCH, ATOL)


@pytest.mark.parametrize("panels", [False, True], ids=["float32", "float32+copies"])
def test_the_memory_plan_counts_the_biases_sinks_and_experts_as_placed(panels):
    ckpt = load_on_device(GPT_OSS, "float32")
    w = ckpt.weights
    if panels:
        w = replace(w, layers=tuple(map(with_panels, w.layers)), lm_head=packed_head(w.lm_head))
    s = memory_plan.Settings(2, CONTEXT, 512, 9, 16, 4, panel_copies=panels)
    assert memory_plan.plan(ckpt.config, ckpt.tokenizer_size, s).weights == quantize.weight_bytes(w)


@pytest.mark.usefixtures("cpu_backend")
def test_served_by_jax_model_greedy_ids_equal_transformers_and_nothing_compiles_after_warm_up():
    prerequisites.cpu_kernels()
    m = JaxModel.load(
        GPT_OSS, max_batch_size=1, max_context_length=CONTEXT, min_bucket=CONTEXT, min_attend=CONTEXT, kernels=True,
        dtype="float32",
    )
    assert m.kernels
    m.warm_up()
    greedy, before = SamplingParams(temperature=0.0, seed=0), m.compilations()
    with compile_events() as compiles:
        for i, case in enumerate(CASES):
            own_pages(m, 0)
            out = [m.prefill(0, case["prompt_ids"], SlotSetup(greedy, frozenset()), masked=False).token_id]
            for step in range(1, len(case["greedy_ids"])):
                out.append(m.decode([DecodeInput(0, out[-1], len(case["prompt_ids"]) + step - 1, False)])[0].token_id)
            assert out == case["greedy_ids"], f"case {i}"
            m.release(0)
    assert compiles == [] and m.compilations() == before
