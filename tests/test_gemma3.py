"""Gemma 3 (Gemma3ForCausalLM, issue 44 part 2) against transformers: tests/assets/tiny-gemma3,
made by transformers 5.24 through scripts/make_tiny_checkpoints.py (tied, two sliding-window
layers of window 8 then one global layer, each kind with its RoPE base, the global one linearly
scaled; query_pre_attn_scalar 24 != head_dim 16; norm weights drawn around 1, read as 1 + w ~ 2;
prompts of 11 and 28 tokens and 16 greedy steps, so the window is outgrown).

- The registries: the checkpoint side and the forward side name the same architectures.
- The config: each layer's window, the two RoPE bases and the attention scale, from transformers
  5's keys and the older ones alike; soft-capping (Gemma 2) refused by name.
- The whole model in plain JAX and with the CPU kernels (attention and the panel products):
  logits within ATOL and greedy ids equal to the goldens; each cached decode step equal to a
  full prefill of the same history; a prompt prefilled in chunks of 5, packed end to end with
  the others, and in chunks riding along with another slot's decode steps
  (transformer.mixed_layers), each giving transformers' logits.
- Served through JaxModel (CPU kernels on, as decode-server runs on the CPU; skipped, saying
  why, on another default backend): warm-up compiles a prefill layer of each kind, then greedy
  ids equal the goldens (prompts one by one and packed together) and nothing compiles.

Float32 on the CPU device, as tests/test_transformer_parity.py (whose module docstring says why)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.model import DecodeInput, PromptInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend import families
from engine.jax_backend.jax_model import JaxModel
from engine.model_store import families as checkpoint_families
from engine.model_store.checkpoint import CheckpointError, parse_config
from support import golden_parity, prerequisites
from support.compile_watch import compile_events
from support.pages import own_pages

GEMMA3 = Path(__file__).parent / "assets" / "tiny-gemma3"
RAW = json.loads((GEMMA3 / "config.json").read_text())
CASES = json.loads((GEMMA3 / "golden.json").read_text())["cases"]
CFG = parse_config(RAW)
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5



def test_the_config_gives_each_layer_its_window_rope_base_and_the_attention_scale():
    assert CFG.layer_windows == (8, 8, None) and CFG.sliding_window is None
    assert CFG.local_rope_theta == 1e4 and CFG.rope_theta == 1e6 and CFG.rope_scaling.kind == "linear"
    assert CFG.attention_scale == pytest.approx(24**-0.5) and CFG.qk_norm and CFG.tie_word_embeddings
    assert max(len(c["prompt_ids"]) for c in CASES) > 3 * 8  # prompts outgrow the window
    older = {k: v for k, v in RAW.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    older |= {"sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert parse_config(older) == CFG
    with pytest.raises(CheckpointError, match="attn_logit_softcapping is set; logit soft-capping"):
        parse_config({**RAW, "attn_logit_softcapping": 50.0})
    with pytest.raises(CheckpointError, match="layer_types must name"):
        parse_config({**RAW, "layer_types": ["sliding_attention", "full_attention"]})


def test_the_two_family_registries_name_the_same_architectures():
    assert set(families.BLOCKS) == set(checkpoint_families.FAMILIES)
    assert families.block(CFG) is families.GEMMA3 and checkpoint_families.FAMILIES[CFG.architecture].embed_scale
    with pytest.raises(CheckpointError, match="unsupported architecture 'GemmaForCausalLM'; supported: .*Gemma3ForCausalLM"):
        parse_config({**RAW, "architectures": ["GemmaForCausalLM"]})


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def whole_model(request) -> golden_parity.WholeModel:
    """tiny-gemma3's weights and its whole-model calls, jitted once per path."""
    return golden_parity.load(GEMMA3, CFG, CONTEXT, request.param)


@pytest.mark.usefixtures("on_the_cpu")
def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    golden_parity.check_goldens_and_cached_decode(whole_model, CASES, BATCH, ATOL)


@pytest.mark.usefixtures("on_the_cpu")
def test_a_prompt_in_chunks_across_the_window_edge_and_packed_with_the_others_gives_transformers_logits(whole_model):
    golden_parity.check_chunks_across_the_window_edge(whole_model, CASES, BATCH, ATOL)  # 28 tokens in pieces of 5
    golden_parity.check_packed(whole_model, CASES, BATCH, ATOL)


@pytest.mark.usefixtures("on_the_cpu")
def test_chunks_riding_along_with_decode_steps_give_transformers_logits(whole_model):
    golden_parity.check_chunks_riding_along(whole_model, CASES, BATCH, ATOL)



@pytest.fixture(scope="module")
def served() -> JaxModel:
    prerequisites.cpu_kernels()
    # 2 slots (the packed prefill below) in one row bucket (`min_rows` 2: a lone stream's steps run
    # 2 rows, one idle; the row ladder is test_jax_model's), one prompt and one attend bucket: few
    # shapes to warm up, each with both of Gemma 3's layer kinds
    m = JaxModel.load(
        GEMMA3, max_batch_size=2, max_context_length=CONTEXT, min_bucket=CONTEXT, min_attend=CONTEXT, kernels=True,
        dtype="float32", min_rows=2,
    )
    assert m.row_buckets == (2,)
    m.warm_up()
    return m


@pytest.mark.usefixtures("cpu_backend")
def test_served_by_jax_model_greedy_ids_equal_transformers_and_nothing_compiles_after_warm_up(served):
    m, greedy = served, SamplingParams(temperature=0.0, seed=0)
    before = m.compilations()
    with compile_events() as compiles:
        for i, case in enumerate(CASES):  # one by one: prefill, then decode steps (in slots 0, 1, 0)
            slot = i % 2
            own_pages(m, slot)
            out = [m.prefill(slot, case["prompt_ids"], SlotSetup(greedy, frozenset()), masked=False).token_id]
            for step in range(1, len(case["greedy_ids"])):
                position = len(case["prompt_ids"]) + step - 1
                out.append(m.decode([DecodeInput(slot, out[-1], position, False)])[0].token_id)
            assert out == case["greedy_ids"], f"case {i}"
            m.release(slot)
        assert m.packed_prefill_tokens >= 28 + 11
        for slot in range(2):  # the two longer prompts packed end to end
            own_pages(m, slot)
        samples = m.prefill_packed([
            PromptInput(slot, tuple(c["prompt_ids"]), SlotSetup(greedy, frozenset()), False)
            for slot, c in enumerate(CASES[:2])
        ])
        assert [s.token_id for s in samples] == [c["greedy_ids"][0] for c in CASES[:2]]
        for slot in range(2):
            m.release(slot)
    assert compiles == [] and m.compilations() == before
