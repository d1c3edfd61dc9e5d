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
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.core.model import DecodeInput, PromptInput, SlotSetup
from engine.core.request import SamplingParams
from engine.jax_backend import families, packed_prefill, transformer
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.weights import load_checkpoint, with_panels
from engine.model_store import families as checkpoint_families
from engine.model_store.checkpoint import CheckpointError, parse_config
from support import prerequisites
from support.compile_watch import compile_events
from support.pages import own_pages

GEMMA3 = Path(__file__).parent / "assets" / "tiny-gemma3"
RAW = json.loads((GEMMA3 / "config.json").read_text())
CASES = json.loads((GEMMA3 / "golden.json").read_text())["cases"]
CFG = parse_config(RAW)
BATCH, CONTEXT = 3, 64
ATOL = 1e-4  # goldens are rounded to 1e-5; float32 differences seen are ~1e-5


@pytest.fixture
def on_the_cpu():
    """The whole-model calls on the CPU device whatever the default backend. (Not for JaxModel:
    a default device is part of jit's cache key, so a step warmed up outside the context would
    compile again inside it.)"""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


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
    with pytest.raises(CheckpointError, match="unsupported architecture 'Gemma2ForCausalLM'; supported: .*Gemma3ForCausalLM"):
        parse_config({**RAW, "architectures": ["Gemma2ForCausalLM"]})


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def whole_model(request):
    """tiny-gemma3's weights and its whole-model calls, jitted once per path."""
    kernels = request.param
    if kernels:
        prerequisites.cpu_kernels()
    with jax.default_device(jax.devices("cpu")[0]):
        weights = load_checkpoint(GEMMA3, dtype="float32").weights
    if kernels:
        weights = replace(weights, layers=tuple(map(with_panels, weights.layers)))

    def chunk(weights, cache, tokens, length, slot, start, cfg):  # prefill_chunk, on the kernels when asked
        x = transformer.embed(weights.embed, tokens)[None]  # [1, C, E]
        x, ks, vs = transformer.prefill_layers(
            weights.layers, cache.k, cache.v, x, cache.tables[slot], start, start, start + length, cfg, kernels
        )
        last = jax.lax.dynamic_index_in_dim(x[0], length - 1, keepdims=False)  # [E]
        return transformer.logits(last, weights.final_norm, weights.lm_head, cfg), transformer.KVCache(ks, vs, cache.tables)

    def packed(weights, cache, tokens, pages, positions, prompts, cfg):  # -> logits at every token [T, V']
        x = transformer.embed(weights.embed, tokens)  # [1, T, E]
        x, _, _ = transformer.packed_prefill_layers(weights.layers, cache.k, cache.v, x, pages, positions, prompts, cfg)
        return transformer.logits(x[0], weights.final_norm, weights.lm_head, cfg)

    def mixed(weights, cache, token, position, chunk, start, cfg):
        """Slot 0 decodes `token` at `position` while chunk [C] of slot 1 at `start` rides along."""
        x = transformer.embed(weights.embed, token[None])[:, None]  # [1, 1, E]
        c = transformer.embed(weights.embed, chunk)  # [C, E]
        x, ks, vs = transformer.mixed_layers(
            weights.layers, cache.k, cache.v, x, cache.tables[:1], position[None], jnp.ones(1, bool), c,
            cache.tables[1], start, start + chunk.shape[0], cfg, CONTEXT, kernels,
        )
        logits = transformer.logits(x[0, 0], weights.final_norm, weights.lm_head, cfg)
        return logits, transformer.KVCache(ks, vs, cache.tables)

    calls = {
        "chunk": jax.jit(chunk, static_argnames="cfg", donate_argnums=1),
        "packed": jax.jit(packed, static_argnames="cfg"),
        "mixed": jax.jit(mixed, static_argnames="cfg", donate_argnums=1),
        "decode": jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels"), donate_argnums=1),
    }
    return weights, kernels, calls


def _prefill(whole_model, cache, ids, slot, piece):
    """ids prefilled into `slot` in pieces of `piece` tokens (each padded to `piece`) -> logits, cache."""
    weights, _, calls = whole_model
    for lo in range(0, len(ids), piece):
        part = ids[lo : lo + piece]
        tokens = np.zeros(piece, np.int32)
        tokens[: len(part)] = part
        logits, cache = calls["chunk"](weights, cache, tokens, np.int32(len(part)), np.int32(slot), np.int32(lo), cfg=CFG)
    return np.asarray(logits), cache


@pytest.mark.usefixtures("on_the_cpu")
def test_logits_and_greedy_ids_match_transformers_and_each_decode_step_a_full_prefill(whole_model):
    weights, kernels, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    for slot, case in enumerate(CASES):
        prompt = case["prompt_ids"]
        logits, cache = _prefill(whole_model, cache, prompt, slot, CONTEXT)
        np.testing.assert_allclose(logits, case["first_logits"], atol=ATOL, rtol=0)
        greedy = [int(np.argmax(logits))]
        for step, expected in enumerate(case["steps"][1:], start=1):
            ids, positions, active = (np.zeros(BATCH, np.int32) for _ in range(3))
            ids[slot], positions[slot], active[slot] = greedy[-1], len(prompt) + step - 1, 1
            logits, cache = calls["decode"](
                weights, cache, ids, positions, active.astype(bool), cfg=CFG, attend=CONTEXT, kernels=kernels
            )
            row = np.asarray(logits)[slot]
            np.testing.assert_allclose(row[expected["ids"]], expected["logits"], atol=ATOL, rtol=0)
            # The same history prefilled whole into a spare slot (its pages are rewritten each time).
            full, cache = _prefill(whole_model, cache, prompt + greedy, BATCH - 1, CONTEXT)
            np.testing.assert_allclose(row, full, atol=ATOL, rtol=0)
            greedy.append(int(np.argmax(row)))
        assert greedy == case["greedy_ids"], f"case {slot}"


@pytest.mark.usefixtures("on_the_cpu")
def test_a_prompt_in_chunks_across_the_window_edge_and_packed_with_the_others_gives_transformers_logits(whole_model):
    weights, _, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    case = max(CASES, key=lambda c: len(c["prompt_ids"]))  # 28 tokens: chunks of 5 end on both sides of each edge
    pieces, cache = _prefill(whole_model, cache, case["prompt_ids"], 1, 5)
    np.testing.assert_allclose(pieces, case["first_logits"], atol=ATOL, rtol=0)
    lengths = [len(c["prompt_ids"]) for c in CASES]
    tokens = np.zeros((1, CONTEXT), np.int32)
    tokens[0, : sum(lengths)] = [t for c in CASES for t in c["prompt_ids"]]
    pages, positions, prompts = packed_prefill.token_arrays(
        np.asarray(cache.tables), list(range(BATCH)), lengths, CONTEXT, cache.k[0].shape[2]
    )
    logits = np.asarray(calls["packed"](weights, cache, tokens, pages, positions, prompts, cfg=CFG))  # [T, V']
    for case, end in zip(CASES, np.cumsum(lengths), strict=True):
        np.testing.assert_allclose(logits[end - 1], case["first_logits"], atol=ATOL, rtol=0)


@pytest.mark.usefixtures("on_the_cpu")
def test_chunks_riding_along_with_decode_steps_give_transformers_logits(whole_model):
    """Slot 1's 28-token prompt written 5 tokens at a time beside slot 0's decode steps
    (transformer.mixed_layers), each step's logits slot 0's golden ones; then its last piece."""
    weights, _, calls = whole_model
    cache = transformer.init_cache(CFG, BATCH, CONTEXT, jnp.float32)
    first, long = CASES[0], CASES[1]
    logits, cache = _prefill(whole_model, cache, first["prompt_ids"], 0, CONTEXT)
    last, start, step = int(np.argmax(logits)), 0, 1
    while len(long["prompt_ids"]) - start > 5:
        chunk = np.asarray(long["prompt_ids"][start : start + 5], np.int32)
        position = np.int32(len(first["prompt_ids"]) + step - 1)
        logits, cache = calls["mixed"](weights, cache, np.int32(last), position, chunk, np.int32(start), cfg=CFG)
        expected = first["steps"][step]
        np.testing.assert_allclose(np.asarray(logits)[expected["ids"]], expected["logits"], atol=ATOL, rtol=0)
        last, start, step = first["greedy_ids"][step], start + 5, step + 1
    rest = long["prompt_ids"][start:]
    tokens = np.zeros(CONTEXT, np.int32)
    tokens[: len(rest)] = rest
    logits, cache = calls["chunk"](weights, cache, tokens, np.int32(len(rest)), np.int32(1), np.int32(start), cfg=CFG)
    np.testing.assert_allclose(np.asarray(logits), long["first_logits"], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def served() -> JaxModel:
    prerequisites.cpu_kernels()
    m = JaxModel.load(  # 2 slots, one prompt and one attend bucket: few shapes to warm up
        GEMMA3, max_batch_size=2, max_context_length=CONTEXT, min_bucket=CONTEXT, min_attend=CONTEXT, kernels=True,
        dtype="float32",
    )
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
