"""Phi-3 / Phi-4 (Phi3ForCausalLM, issue 44 part 4) against transformers: two tiny checkpoints made
by transformers 5.24 through scripts/make_tiny_checkpoints.py, both with the fused qkv_proj and
gate_up_proj (split at load into the dense layout) and norm weights drawn around 1:
- tests/assets/tiny-phi3: the default RoPE and a sliding window of 12 (Phi-3-mini-4k's 2047, small),
  outgrown by the 28-token prompt and its 16 greedy steps;
- tests/assets/tiny-phi3-longrope: longrope (original context 32, short and long factors, the
  attention factor sqrt(1 + ln 8 / ln 32) from max_position_embeddings 256) over half of each head
  (partial_rotary_factor 0.5, as Phi-4-mini's 0.75); its prompts fit in 32 positions and its
  greedy runs go past them, so both factor sets count. Its goldens are transformers' cached
  generation (scripts/make_tiny_checkpoints.py's docstring says why).

- The config: the window, longrope's factors and attention factor, the rotated dims; the older
  "su" name; what cannot run refused by the key's name.
- The split: the fused tensors read back as transformers' q, k, v, gate and up.
- The whole model in plain JAX and with the CPU kernels (tiny-phi3-longrope in plain JAX only: its
  rotation is the same code on both paths): logits within ATOL and greedy ids equal
  to the goldens, each cached decode step equal to a full prefill of the same history, and a
  prompt in chunks of 5 and packed with the others giving transformers' logits.

Float32 on the CPU device, as tests/test_transformer_parity.py (whose module docstring says why)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.jax_backend import families
from engine.model_store.checkpoint import CheckpointError, load_checkpoint, parse_config
from support import golden_parity

ASSETS = Path(__file__).parent / "assets"
PHI3, LONGROPE = ASSETS / "tiny-phi3", ASSETS / "tiny-phi3-longrope"
RAW = {p.name: json.loads((p / "config.json").read_text()) for p in (PHI3, LONGROPE)}
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # conftest: arrays and calls on the CPU device


def test_the_config_gives_the_window_longrope_and_the_rotated_dims():
    plain, long = parse_config(RAW["tiny-phi3"]), parse_config(RAW["tiny-phi3-longrope"])
    assert plain.sliding_window == 12 and plain.rope_scaling is None and plain.rotary_dim is None
    assert families.block(plain) is families.DENSE and not plain.qkv_bias and not plain.qk_norm
    s = long.rope_scaling
    assert long.rotary_dim == 8 and long.head_dim == 16 and long.sliding_window is None
    assert s.kind == "longrope" and s.original_max_position_embeddings == 32 and s.factor == 8.0
    assert s.short_factor == (1.0, 1.3, 1.8, 2.5) and s.long_factor == (1.5, 3.0, 6.0, 12.0)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    rope = RAW["tiny-phi3-longrope"]["rope_parameters"]
    assert parse_config({**RAW["tiny-phi3-longrope"], "rope_parameters": {**rope, "rope_type": "su"}}) == long
    with pytest.raises(CheckpointError, match="unsupported rope_parameters.rope_type 'dynamic'"):
        parse_config({**RAW["tiny-phi3"], "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(CheckpointError, match="rope_parameters.short_factor must list 4 numbers"):
        parse_config({**RAW["tiny-phi3-longrope"], "rope_parameters": {**rope, "short_factor": [1.0] * 8}})
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.35 gives 5 rotated dims of 16"):
        parse_config({**RAW["tiny-phi3-longrope"], "rope_parameters": {**rope, "partial_rotary_factor": 0.35}})


def test_the_fused_projections_are_split_into_transformers_q_k_v_gate_and_up():
    c = parse_config(RAW["tiny-phi3"])
    tensors = load_file(PHI3 / "model.safetensors")
    layer = load_checkpoint(PHI3).weights.layers[1]
    qkv, gate_up = tensors["model.layers.1.self_attn.qkv_proj.weight"], tensors["model.layers.1.mlp.gate_up_proj.weight"]
    hd, kd, f, d, g = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.ffn_size, c.head_dim, c.n_heads // c.n_kv_heads
    w = layer.w_qkv.T.reshape(c.n_kv_heads, g + 2, d, c.hidden_size)  # per kv head: its queries, key, value
    np.testing.assert_array_equal(w[:, :g].reshape(hd, -1), qkv[:hd])
    np.testing.assert_array_equal(w[:, g].reshape(kd, -1), qkv[hd : hd + kd])
    np.testing.assert_array_equal(w[:, g + 1].reshape(kd, -1), qkv[hd + kd :])
    np.testing.assert_array_equal(layer.w_gate_up[:, 0::2].T, gate_up[:f])  # gate and up interleaved
    np.testing.assert_array_equal(layer.w_gate_up[:, 1::2].T, gate_up[f:])


@pytest.fixture(
    scope="module", params=[(PHI3, False), (PHI3, True), (LONGROPE, False)],
    ids=["jax-attention", "kernel-attention", "longrope-jax-attention"],
)
def whole_model(request) -> tuple[golden_parity.WholeModel, list]:
    """A checkpoint's weights and its whole-model calls, jitted once per path, with its goldens.
    tiny-phi3 on both attention paths; tiny-phi3-longrope on XLA's only: its difference is the
    rotation (engine.jax_backend.layers.rope), which both paths share before their attention, so
    its kernel run would compile the family's calls again to prove nothing tiny-phi3's does not."""
    folder, kernels = request.param
    cases = json.loads((folder / "golden.json").read_text())["cases"]
    return golden_parity.load(folder, parse_config(RAW[folder.name]), CONTEXT, kernels), cases


def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    model, cases = whole_model
    golden_parity.check_goldens_and_cached_decode(model, cases, BATCH, ATOL)


def test_a_prompt_in_chunks_and_packed_with_the_others_gives_transformers_logits(whole_model):
    model, cases = whole_model
    golden_parity.check_chunks_across_the_window_edge(model, cases, BATCH, ATOL)  # 28 tokens in pieces of 5
    golden_parity.check_packed(model, cases, BATCH, ATOL)
