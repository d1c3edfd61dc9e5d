"""The jitted functions a model runs, as pure functions of their arrays, and `Steps`, their
compiled forms for one model.

Sampling is one executable per row bucket R, in a greedy and a full variant the host picks
(`step_sample`, `Steps.step_sampler`): every kind of step that samples goes through it, so the
full sampler (sampling.sample, most of a small model's compile time) is compiled once per row
bucket, not into every program that samples. A decode step is its layers (`decode_layers`,
with the page pools donated and handed back written in place), then that sampler; a step whose
rows are all greedy and want no alternatives may instead run as one executable with the greedy
sampler inside (`decode_step`: the CPU's choice, where a second dispatch is a measurable part of
a batch-1 step; `split_sampler` says never). A step whose sampling waits for its rows of banned
ids runs its layers, then `write_masks` and the sampler. A prompt runs one layer per call
(transformer.prefill_layers, or packed_prefill_layers for several prompts end to end), then
`prompt_ends` takes each prompt's last position as a row of the sampler's bucket. `fetch` reads a
sampling call's outputs back, its alternatives only when a row asks.

Shapes: B slots, R rows in a step, T prompt tokens, W block table width, N pool pages, P page
size, V embedding rows, V' ids the tokenizer can produce, E hidden, K kv heads, D head dim, L layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import sampling, transformer, verify_step
from engine.jax_backend.sampling import SlotSampling
from engine.jax_backend.slot_sampling import (
    ACTIVE, GIVEN, MASKED, MIN_P, POSITION, SEED_HI, SEED_LO, TABLE, TEMPERATURE, TOP_K, TOP_N, TOP_P, USE_GIVEN,
)
from engine.model_store.checkpoint import ModelConfig


def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return transformer.embed(table, tokens)  # [V, E], [R, T] -> [R, T, E]


def prompt_ends(x: jax.Array, ends: jax.Array) -> jax.Array:
    """x [1, T, E], ends [R] (one past each prompt's last token; 1 for rows that sample for
    nobody) -> the hidden state after each prompt's last token [R, 1, E], the sampler's rows."""
    return x[0, ends - 1][:, None]


def write_mask(mask: jax.Array, row: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(mask, row[None], (slot, 0))  # [B, V'] with row [V'] at slot


def write_masks(mask: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """mask [B, V'] with rows [R, V'] at slots [R] (a slot listed twice is given the same row
    twice: the host pads R to a compiled size so)."""
    return mask.at[slots].set(rows)


def head_and_sample(
    x: jax.Array,  # [R, 1, E]
    final_norm: jax.Array,
    lm_head: jax.Array,  # [E, V'] (with its panel copy, weights.PackedHead, where the kernels use it)
    mask: jax.Array,  # [B, V'] bool, every slot's masked ids
    last: jax.Array,  # [B] i32, each slot's last sampled token, donated
    slots: jax.Array,  # [R] the slot of each row
    active: jax.Array,  # [R] bool, rows whose sample is the slot's next token
    masked: jax.Array,  # [R] bool, mask this step
    params: SlotSampling,  # [R] rows
    positions: jax.Array,  # [R] of the tokens being sampled
    top_n: jax.Array,  # [R] i32, alternatives each row reports (0: none; all 0 skips the top-k)
    cfg: ModelConfig,
    head_size: int | None = None,  # V' when the head is padded (engine.jax_backend.mesh), else None
    greedy_only: bool = False,  # every row greedy and wanting no alternatives (the host knows): sampling.greedy
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (last [B] with each active row's sample at its slot, ids [R], logprobs [R], top ids
    [R, K], top logprobs [R, K]). The sample stays on the device as the slot's next input, so a
    decode step never waits for the host to send back what it just sampled."""
    logits = transformer.logits(x[:, 0], final_norm, lm_head, cfg)[:, :head_size]  # [R, V']
    if greedy_only:
        tokens, logprobs = sampling.greedy(logits, mask[slots], masked)  # [R], [R]
        tops = sampling.no_top_logprobs(*logits.shape)
    else:
        tokens, logprobs = sampling.sample(logits, params, positions, mask[slots], masked)  # [R], [R]
        tops = sampling.top_logprobs(logits, top_n)
    last = last.at[slots].set(jnp.where(active, tokens, last[slots]))
    return (last, tokens, logprobs, *tops)


def decode_step(
    embed_table: jax.Array,  # [V, E] (or its int8 form)
    final_norm: jax.Array,  # [E]
    lm_head: jax.Array,  # [E, V'] (with its panel copy, weights.PackedHead, where the kernels use it)
    layers: tuple,  # L layer weights (with the panel copies where the kernels use them)
    k_caches: tuple[jax.Array, ...],  # L x [K, N, P, D] page pools, donated
    v_caches: tuple[jax.Array, ...],
    last: jax.Array,  # [B] i32, each slot's last sampled token, donated
    mask: jax.Array,  # [B, V'] bool
    ints: jax.Array,  # [R, 9 + W] i32, the columns above and the rows' block tables
    *,
    cfg: ModelConfig,
    attend: int,
    kernels: bool,
    ragged: bool,
    head_size: int | None = None,
) -> tuple:
    """A decode step for the first R slots whose rows are all greedy and want no alternatives, as
    one executable: embed the slots' inputs (the token the host gives, or the slot's last sample,
    already on the device), every layer, the head and the greedy sampler (`decode_layers`, then
    `step_sample`'s greedy variant). -> (k_caches, v_caches, last, ids [R], logprobs [R], top ids
    [R, K], top logprobs [R, K])."""
    k_caches, v_caches, x = decode_layers(
        embed_table, layers, k_caches, v_caches, last, ints, None, cfg=cfg, attend=attend, kernels=kernels, ragged=ragged
    )
    r = ints.shape[0]
    floats = jnp.zeros((r, 3), jnp.float32)  # (greedy: the parameters are not read)
    return (k_caches, v_caches, *step_sample(x, final_norm, lm_head, mask, last, ints, floats, jnp.arange(r, dtype=jnp.int32),
                                             cfg=cfg, head_size=head_size, greedy_only=True))


def decode_layers(
    embed_table: jax.Array,  # [V, E] (or its int8 form)
    layers: tuple,  # L layer weights
    k_caches: tuple[jax.Array, ...],  # L x [K, N, P, D] page pools, donated
    v_caches: tuple[jax.Array, ...],
    last: jax.Array,  # [B] i32, each slot's last sampled token (read, not written)
    ints: jax.Array,  # [R, 9 + W] i32
    chunk: tuple | None = None,  # a prompt chunk riding along: ids [C] i32, (start, end) [2] i32, table [W] i32
    *,
    cfg: ModelConfig,
    attend: int,
    kernels: bool,
    ragged: bool,
) -> tuple:
    """A decode step up to the final hidden state: the slots' inputs embedded and every layer
    run; with `chunk`, that prompt chunk's KV written into its slot in the same pass
    (transformer.mixed_layers). -> (k_caches, v_caches, x [R, 1, E])."""
    r = ints.shape[0]
    active = ints[:, ACTIVE] > 0  # [R]
    positions = ints[:, POSITION]  # [R]
    tables = ints[:, TABLE:]  # [R, W]
    tokens = jnp.where(ints[:, USE_GIVEN] > 0, ints[:, GIVEN], last[:r])  # [R]
    x = transformer.embed(embed_table, tokens[:, None])  # [R, 1, E]
    if chunk is None:
        x, k_caches, v_caches = transformer.decode_layers(
            layers, k_caches, v_caches, x, tables, positions, active, cfg=cfg, attend=attend, kernels=kernels,
            ragged=ragged,
        )
    else:
        ids, at, table = chunk
        x, k_caches, v_caches = transformer.mixed_layers(
            layers, k_caches, v_caches, x, tables, positions, active, transformer.embed(embed_table, ids), table,
            at[0], at[1], cfg=cfg, attend=attend, kernels=kernels, ragged=ragged,
        )
    return k_caches, v_caches, x


def step_sample(
    x: jax.Array,  # [R, 1, E], the rows' final hidden states
    final_norm: jax.Array,
    lm_head: jax.Array,
    mask: jax.Array,  # [B, V'] bool
    last: jax.Array,  # [B] i32, donated where this is its own executable
    ints: jax.Array,  # [R, 9 + W] i32 (slot_sampling.pack, or pack_rows for prompts)
    floats: jax.Array,  # [R, 3] f32
    slots: jax.Array,  # [R] i32, the slot of each row (a decode step's row i is slot i)
    *,
    cfg: ModelConfig,
    head_size: int | None = None,
    greedy_only: bool = False,
) -> tuple:
    """The head and sampling of R rows, parameters from the packed host columns, the sample
    for row i at its slot's position POSITION + 1: the one sampler of a row bucket, for decode
    steps and prompts alike. -> (last, ids [R], logprobs [R], top ids [R, K], top logprobs [R, K])."""
    seed = jax.lax.bitcast_convert_type(ints[:, SEED_HI:SEED_LO + 1], jnp.uint32)  # [R, 2]
    params = SlotSampling(floats[:, TEMPERATURE], ints[:, TOP_K], floats[:, TOP_P], floats[:, MIN_P], seed)
    return head_and_sample(
        x, final_norm, lm_head, mask, last, slots, ints[:, ACTIVE] > 0, ints[:, MASKED] > 0,
        params, ints[:, POSITION] + 1, ints[:, TOP_N], cfg, head_size, greedy_only,
    )


def alternatives(ids: np.ndarray, logprobs: np.ndarray, wanted: np.ndarray) -> list[tuple[tuple[int, float], ...]]:
    """ids, logprobs [R, K], wanted [R] -> per row its first `wanted` (id, logprob) pairs."""
    return [tuple(zip(i[:n].tolist(), p[:n].tolist())) for i, p, n in zip(ids, logprobs, wanted.tolist())]


def fetch(samples: tuple[jax.Array, ...], top_n: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """A sampling call's (ids, logprobs, top ids, top logprobs) [R], [R], [R, K], [R, K] from the
    device -> ids, logprobs and per row its first top_n alternatives; the alternatives are fetched
    only when some row asks for them."""
    if not top_n.any():
        tokens, logprobs = jax.device_get(samples[:2])
        return tokens, logprobs, [()] * len(top_n)
    tokens, logprobs, top_ids, top_logprobs = jax.device_get(samples)
    return tokens, logprobs, alternatives(top_ids, top_logprobs, top_n)


@dataclass(frozen=True)
class Pending:
    """A dispatched decode step whose samples the host has not read yet."""

    slots: np.ndarray  # [N] the slots of the step's inputs, in input order
    top_n: np.ndarray  # [R] alternatives each row reports
    samples: tuple[jax.Array, ...]  # ids [R], logprobs [R], top ids [R, K], top logprobs [R, K], on the device


class Steps:
    """One model's jitted functions. Each is a function object of its own (functools.partial), so
    jit's caches, and so `compilations()`, are per model. `kernels`: the CPU kernels; `ragged`:
    the Pallas decode attention; `head_size`: V' where the head is padded (a mesh), else None;
    `options`: jit's keyword arguments (the backend's compiler options)."""

    def __init__(self, kernels: bool, ragged: bool, head_size: int | None, options: dict) -> None:
        def own(fn, **bound):
            return functools.partial(fn, **bound)

        caches, pools = ("k_caches", "v_caches"), ("k_pages", "v_pages")  # the steps' names, the layers'
        o = options
        self.embed = jax.jit(own(embed), **o)
        self.prefill_layers = jax.jit(
            own(transformer.prefill_layers, kernels=kernels), static_argnames=("cfg", "windows"), donate_argnames=pools, **o
        )
        self.packed_layers = jax.jit(
            own(transformer.packed_prefill_layers), static_argnames=("cfg", "windows"), donate_argnames=pools, **o
        )
        self.prompt_ends = jax.jit(own(prompt_ends), **o)  # per (prompt or packed size, row bucket)
        self.step = jax.jit(  # a greedy decode step as one executable (decode_step)
            own(decode_step, kernels=kernels, ragged=ragged, head_size=head_size),
            static_argnames=("cfg", "attend"), donate_argnames=(*caches, "last"), **o,
        )
        self.layers_step = jax.jit(  # a decode step up to the final hidden states, then step_sampler
            own(decode_layers, kernels=kernels, ragged=ragged),
            static_argnames=("cfg", "attend"), donate_argnames=caches, **o,
        )
        self.step_sampler = jax.jit(  # per row bucket, greedy and full: every sampling call
            own(step_sample, head_size=head_size), static_argnames=("cfg", "greedy_only"), donate_argnames="last", **o
        )
        self.verify = jax.jit(  # speculative decoding's verify step (engine.jax_backend.verify)
            own(verify_step.verify_step, kernels=kernels, ragged=ragged, head_size=head_size),
            static_argnames=("cfg", "attend"), donate_argnames=(*caches, "last"), **o,
        )
        self.write_mask = jax.jit(own(write_mask), donate_argnums=0, **o)
        self.write_masks = jax.jit(own(write_masks), donate_argnums=0, **o)  # compiled per row bucket

    def jitted(self) -> tuple:
        """Every jitted function (for counting compilations)."""
        return (
            self.embed, self.prefill_layers, self.packed_layers, self.prompt_ends, self.step, self.layers_step,
            self.step_sampler, self.verify, self.write_mask, self.write_masks,
        )
