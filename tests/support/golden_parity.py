"""A tiny checkpoint's whole-model calls (engine.jax_backend.transformer's layer functions, jitted
once per attention path) checked against the goldens transformers wrote for it
(scripts/make_tiny_checkpoints.py): the parity checks that every family with windows shares
(tests/test_sliding_window.py for Mistral, tests/test_gemma3.py for Gemma 3).

Each check runs on a `WholeModel` and the checkpoint's golden `cases` (per prompt: its ids, the
logits after it, and per greedy step the top logits and the greedy ids), with `batch` slots of
`context` positions, logits within `atol`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import packed_prefill, transformer
from engine.jax_backend.weights import load_checkpoint, with_panels
from engine.model_store.checkpoint import ModelConfig
from support import prerequisites


@dataclass(frozen=True)
class WholeModel:
    weights: Any
    kernels: bool  # the C++ CPU kernels' attention and products, or XLA's
    cfg: ModelConfig
    context: int
    calls: dict  # name -> jitted call: chunk, packed, mixed, decode


def load(checkpoint: Path, cfg: ModelConfig, context: int, kernels: bool) -> WholeModel:
    """The checkpoint's float32 weights on the CPU device and its calls on one path."""
    if kernels:
        prerequisites.cpu_kernels()
    with jax.default_device(jax.devices("cpu")[0]):
        weights = load_checkpoint(checkpoint, dtype="float32").weights
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
            cache.tables[1], start, start + chunk.shape[0], cfg, context, kernels,
        )
        logits = transformer.logits(x[0, 0], weights.final_norm, weights.lm_head, cfg)
        return logits, transformer.KVCache(ks, vs, cache.tables)

    calls = {
        "chunk": jax.jit(chunk, static_argnames="cfg", donate_argnums=1),
        "packed": jax.jit(packed, static_argnames="cfg"),
        "mixed": jax.jit(mixed, static_argnames="cfg", donate_argnums=1),
        "decode": jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels"), donate_argnums=1),
    }
    return WholeModel(weights, kernels, cfg, context, calls)


def prefill(m: WholeModel, cache, ids, slot: int, piece: int):
    """ids prefilled into `slot` in pieces of `piece` tokens (each padded to `piece`) -> logits, cache."""
    for lo in range(0, len(ids), piece):
        part = ids[lo : lo + piece]
        tokens = np.zeros(piece, np.int32)
        tokens[: len(part)] = part
        logits, cache = m.calls["chunk"](m.weights, cache, tokens, np.int32(len(part)), np.int32(slot), np.int32(lo), cfg=m.cfg)
    return np.asarray(logits), cache


def check_goldens_and_cached_decode(m: WholeModel, cases: list, batch: int, atol: float) -> None:
    """Each prompt's logits and every greedy step's top logits are the goldens', the greedy ids
    equal, and each cached decode step's logits equal a full prefill of the same history."""
    cache = transformer.init_cache(m.cfg, batch, m.context, jnp.float32)
    for slot, case in enumerate(cases):
        prompt = case["prompt_ids"]
        logits, cache = prefill(m, cache, prompt, slot, m.context)
        np.testing.assert_allclose(logits, case["first_logits"], atol=atol, rtol=0)
        greedy = [int(np.argmax(logits))]
        for step, expected in enumerate(case["steps"][1:], start=1):
            ids, positions, active = (np.zeros(batch, np.int32) for _ in range(3))
            ids[slot], positions[slot], active[slot] = greedy[-1], len(prompt) + step - 1, 1
            logits, cache = m.calls["decode"](
                m.weights, cache, ids, positions, active.astype(bool), cfg=m.cfg, attend=m.context, kernels=m.kernels
            )
            row = np.asarray(logits)[slot]
            np.testing.assert_allclose(row[expected["ids"]], expected["logits"], atol=atol, rtol=0)
            # The same history prefilled whole into a spare slot (its pages are rewritten each time).
            full, cache = prefill(m, cache, prompt + greedy, batch - 1, m.context)
            np.testing.assert_allclose(row, full, atol=atol, rtol=0)
            greedy.append(int(np.argmax(row)))
        assert greedy == case["greedy_ids"], f"case {slot}"


def check_chunks_across_the_window_edge(m: WholeModel, cases: list, batch: int, atol: float) -> None:
    """The longest prompt prefilled 5 tokens a piece (pieces ending on both sides of each window
    edge) gives the logits of it prefilled at once, and transformers'."""
    case = max(cases, key=lambda c: len(c["prompt_ids"]))
    cache = transformer.init_cache(m.cfg, batch, m.context, jnp.float32)
    whole, cache = prefill(m, cache, case["prompt_ids"], 0, m.context)
    pieces, cache = prefill(m, cache, case["prompt_ids"], 1, 5)
    np.testing.assert_allclose(pieces, whole, atol=atol, rtol=0)
    np.testing.assert_allclose(pieces, case["first_logits"], atol=atol, rtol=0)


def check_packed(m: WholeModel, cases: list, batch: int, atol: float) -> None:
    """Every prompt in one packed prefill: each prompt's last logits are transformers'."""
    cache = transformer.init_cache(m.cfg, batch, m.context, jnp.float32)
    lengths = [len(c["prompt_ids"]) for c in cases]
    tokens = np.zeros((1, m.context), np.int32)
    tokens[0, : sum(lengths)] = [t for c in cases for t in c["prompt_ids"]]
    pages, positions, prompts = packed_prefill.token_arrays(
        np.asarray(cache.tables), list(range(batch)), lengths, m.context, cache.k[0].shape[2]
    )
    logits = np.asarray(m.calls["packed"](m.weights, cache, tokens, pages, positions, prompts, cfg=m.cfg))  # [T, V']
    for case, end in zip(cases, np.cumsum(lengths), strict=True):
        np.testing.assert_allclose(logits[end - 1], case["first_logits"], atol=atol, rtol=0)


def check_chunks_riding_along(m: WholeModel, cases: list, batch: int, atol: float) -> None:
    """Slot 1's prompt (cases[1]) written 5 tokens at a time beside slot 0's decode steps
    (transformer.mixed_layers), each step's logits slot 0's golden ones; then its last piece."""
    cache = transformer.init_cache(m.cfg, batch, m.context, jnp.float32)
    first, long = cases[0], cases[1]
    logits, cache = prefill(m, cache, first["prompt_ids"], 0, m.context)
    last, start, step = int(np.argmax(logits)), 0, 1
    while len(long["prompt_ids"]) - start > 5:
        chunk = np.asarray(long["prompt_ids"][start : start + 5], np.int32)
        position = np.int32(len(first["prompt_ids"]) + step - 1)
        logits, cache = m.calls["mixed"](m.weights, cache, np.int32(last), position, chunk, np.int32(start), cfg=m.cfg)
        expected = first["steps"][step]
        np.testing.assert_allclose(np.asarray(logits)[expected["ids"]], expected["logits"], atol=atol, rtol=0)
        last, start, step = first["greedy_ids"][step], start + 5, step + 1
    rest = long["prompt_ids"][start:]
    tokens = np.zeros(m.context, np.int32)
    tokens[: len(rest)] = rest
    logits, cache = m.calls["chunk"](m.weights, cache, tokens, np.int32(len(rest)), np.int32(1), np.int32(start), cfg=m.cfg)
    np.testing.assert_allclose(np.asarray(logits), long["first_logits"], atol=atol, rtol=0)
