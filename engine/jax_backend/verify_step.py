"""The verify step of speculative decoding (issue 45) as one pure, jitted function of its arrays.

A verify step feeds each of R sequences its last sample and up to K guessed ids, K + 1 tokens at
consecutive positions, and samples after each of them. It runs as a decode step over R x (K + 1)
rows, one row per fed token (`transformer.decode_layers`): every row writes its key and value at
its position through its sequence's block table before any row attends, and a row attends to its
table's positions up to its own, so the K + 1 rows of one sequence see each other causally with
no attention code of their own. Each row is thus computed exactly as the decode step that fed the
same token at the same position would compute it: on the CPU the kernels' products of up to
PANEL_ROWS rows give each row the bits it has alone (engine.jax_backend.cpu_kernels), and the
attention kernel reads each row's keys in place. What it costs over a decode step: K + 1 rows
through the weights instead of one (at a few rows, about one read of the weights either way) and
each row reading its sequence's keys (at long contexts a chunk-shaped kernel would read them once
per sequence instead).

Sampling is each row's own, as plain decoding would sample at that position (`sampling.sample`,
with the draw keyed by the sampled token's position), and acceptance compares: guess j is taken
while the sample after token j equals it. For a sampled row that is rejection sampling for a
one-hot proposal with a shared draw: the guess is accepted with exactly its target probability,
and when it is not, the sample is the target's draw conditioned on not being the guess, i.e. the
target with the guess removed and renormalised. So a verify returns what plain decoding returns
with the same seed, id for id, wherever the logits are the same bits (engine.jax_backend.verify).

Shapes: B slots, R rows (sequences) of a verify step, K guesses per row (the step's compiled
count; a row's own count may be fewer), F = R x (K + 1) fed tokens, W block table width, V' head
columns, E hidden, M = MAX_TOP_LOGPROBS alternatives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.jax_backend import sampling, transformer
from engine.jax_backend.sampling import SlotSampling
from engine.jax_backend.slot_sampling import (
    ACTIVE, MASKED, MIN_P, POSITION, SEED_HI, SEED_LO, TABLE, TEMPERATURE, TOP_K, TOP_N, TOP_P,
)
from engine.model_store.checkpoint import ModelConfig

# Columns of a verify step's `guessed` [R, 2 + K] i32 host input: the row's slot, its number of
# guesses, then the guesses (0 past that number).
SLOT, COUNT, GUESSES = range(3)


def fed_rows(ints: jax.Array, guessed: jax.Array, last: jax.Array) -> tuple[jax.Array, ...]:
    """The F fed tokens of a verify step, row-major (sequence r's token j at r * (K + 1) + j):
    -> (tokens [R, K + 1], positions [R, K + 1], fed [R, K + 1] bool). Token 0 is the slot's
    last sample (on the device since the step that drew it), token j > 0 its guess j - 1; a token
    past a row's own count (or of an idle row) is not fed: it writes into the null page, and what
    it computes is never read. Its position is the row's first, so it stays inside the context."""
    k1 = guessed.shape[1] - GUESSES + 1
    slots, counts = guessed[:, SLOT], guessed[:, COUNT]  # [R], [R]
    tokens = jnp.concatenate([last[slots][:, None], guessed[:, GUESSES:]], axis=1)  # [R, K + 1]
    j = jnp.arange(k1, dtype=jnp.int32)[None, :]  # [1, K + 1]
    fed = (ints[:, ACTIVE, None] > 0) & (j <= counts[:, None])  # [R, K + 1]
    positions = ints[:, POSITION, None] + jnp.where(fed, j, 0)  # [R, K + 1]
    return tokens, positions, fed


def accepted(samples: jax.Array, guessed: jax.Array) -> jax.Array:
    """How many guesses each row accepts: the length of the run of guesses each equal to the
    sample drawn before it, samples [R, K + 1] and guessed [R, 2 + K] -> m [R] in 0..count."""
    guesses = guessed[:, GUESSES:]  # [R, K]
    j = jnp.arange(guesses.shape[1], dtype=jnp.int32)[None, :]  # [1, K]
    agree = (samples[:, :-1] == guesses) & (j < guessed[:, COUNT, None])  # [R, K]
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)  # [R]


def repeated(column: jax.Array, k1: int) -> jax.Array:
    """A per-row column [R, ...] -> per fed token [F, ...] (each row's value K + 1 times)."""
    return jnp.repeat(column, k1, axis=0, total_repeat_length=column.shape[0] * k1)


def verify_step(
    embed_table: jax.Array,  # [V, E] (or its int8 form)
    final_norm: jax.Array,  # [E]
    lm_head: jax.Array,  # [E, V'] (with its panel copy where the kernels use it)
    layers: tuple,  # L layer weights
    k_caches: tuple[jax.Array, ...],  # L x [K, N, P, D] page pools, donated
    v_caches: tuple[jax.Array, ...],
    last: jax.Array,  # [B] i32, each slot's last sampled token, donated
    mask: jax.Array,  # [B, V'] bool
    ints: jax.Array,  # [R, 9 + W] i32, a decode step's columns (slot_sampling.pack's) per row
    floats: jax.Array,  # [R, 3] f32
    guessed: jax.Array,  # [R, 2 + K] i32: slot, count, guesses
    *,
    cfg: ModelConfig,
    attend: int,
    kernels: bool,
    ragged: bool,
    head_size: int | None = None,
) -> tuple:
    """One verify step (module docstring) as one executable. -> (k_caches, v_caches, last [B]
    with each active row's last accepted sample s_m at its slot, samples [R, K + 1], their raw
    logprobs [R, K + 1], accepted m [R], top ids [F, M], top logprobs [F, M])."""
    r, k1 = guessed.shape[0], guessed.shape[1] - GUESSES + 1
    tokens, positions, fed = fed_rows(ints, guessed, last)  # [R, K + 1] each
    x = transformer.embed(embed_table, tokens.reshape(-1, 1))  # [F, 1, E]
    tables = repeated(ints[:, TABLE:], k1)  # [F, W]
    x, k_caches, v_caches = transformer.decode_layers(
        layers, k_caches, v_caches, x, tables, positions.reshape(-1), fed.reshape(-1), cfg=cfg, attend=attend,
        kernels=kernels, ragged=ragged,
    )
    logits = transformer.logits(x[:, 0], final_norm, lm_head, cfg)[:, :head_size]  # [F, V']
    seed = jax.lax.bitcast_convert_type(ints[:, SEED_HI:SEED_LO + 1], jnp.uint32)  # [R, 2]
    params = SlotSampling(*(repeated(c, k1) for c in (
        floats[:, TEMPERATURE], ints[:, TOP_K], floats[:, TOP_P], floats[:, MIN_P], seed)))  # [F] each
    slots = guessed[:, SLOT]  # [R]
    samples, logprobs = sampling.sample(  # each at the position of the token it draws, as decode draws it
        logits, params, positions.reshape(-1) + 1, repeated(mask[slots], k1), repeated(ints[:, MASKED] > 0, k1)
    )  # [F], [F]
    tops = sampling.top_logprobs(logits, jnp.where(fed.reshape(-1), repeated(ints[:, TOP_N], k1), 0))
    samples, logprobs = samples.reshape(r, k1), logprobs.reshape(r, k1)  # [R, K + 1]
    m = accepted(samples, guessed)  # [R]
    after = jnp.take_along_axis(samples, m[:, None], axis=1)[:, 0]  # [R], s_m
    last = last.at[slots].set(jnp.where(ints[:, ACTIVE] > 0, after, last[slots]))
    return (k_caches, v_caches, last, samples, logprobs, m, *tops)
