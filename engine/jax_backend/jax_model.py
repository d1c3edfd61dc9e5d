"""`JaxModel`: the real model behind engine.core.model.Model, a JAX decoder with a slot-based KV cache.

Data flow: `load` reads a checkpoint (engine.model_store.checkpoint) and allocates the device state once: the
KV cache (L buffers of [B, K, S, D]) and each slot's banned-id row [B, V']. `prefill_chunk`
writes positions [start, end) of a prompt into a slot (the scheduler's chunked prefill; `prefill`
is the whole prompt as one chunk) as calls of the compiled chunk sizes (powers of two from
`min_bucket` up to `max_chunk`, 512): each piece the largest size it fills, the last the smallest
that holds the rest, or the rest as one call where that pads no more (`prompt_pieces`); each
call attends, blocked and causal, only to the slot's keys up to its end
(transformer.chunk_attention), so a prompt's cost grows with its length, not with the
context; the chunk that ends the prompt samples its first token. `decode` runs one token for the first R slots, R being the smallest row bucket above the
highest active slot (the scheduler fills the lowest free slot first, so live slots sit low), and
attends over the smallest attend bucket that covers every active position; on the CPU (float32)
the attention is a C++ kernel (engine.jax_backend.cpu_kernels) that reads each row's live keys in place, so
there is one attend bucket, the context, and no window is copied; and the weight products of up
to cpu_kernels.PANEL_ROWS rows (decode steps, short prompt chunks) run on a second kernel over
panel-packed copies of the projections, made once here (the [in, out] originals serve longer
prompt chunks). A decode step is one jitted executable: embed,
every layer, head and sampling (engine.jax_backend.sampling), with the cache buffers and the
slots' last samples donated and handed back written in place. On an accelerator (`split_sampler`)
it is two: the layers, then the head and sampling in one of two variants the host picks from the
rows' parameters, greedy (no draw, cuts or alternatives) or full, because a step there computes
every piece of sampling.sample whatever the rows need (no conditionals on the device). The host runs one step behind the
device: `dispatch` enqueues step N+1 with no wait (its inputs are the samples of step N, which
never leave the device, and host arrays packed into two transfers), and only then does `collect`
read step N's ids and logprobs; the scheduler decides on them while the device computes.
Per-slot sampling parameters live on the host and travel with each step as [R] columns.

Shapes and warm-up. `warm_up` compiles every shape serving can use, so serving compiles nothing
(`compilations()` lets tests check): per prompt (chunk) bucket a prefill layer, whatever the
chunk's offset; per (row bucket, attend
bucket) a decode step; one head and sampling for a prompt's last position. Row buckets are powers of
two up to B (from 1 on CPU, from 16 on an accelerator: MIN_ROWS), attend buckets powers of two from `min_attend` (128) up to the context, prompt
buckets from `min_bucket` (16). Why these shapes (measured on the project's CPU machine; the
figures are in docs/benchmarks.md, "Design measurements"):
- Decode runs every layer in one jitted call: one dispatch a step, and the host free while the
  device runs. Unrolling all 30 layers of the default model compiles in about twice the time of
  the 5-layer groups used before (3.4 s against 1.7 s a shape here), and the persistent
  compilation cache pays that once per machine. Prefill, compute-bound, runs one layer per call.
- With the CPU kernel the decode shapes are the row buckets alone (the kernel reads the live
  length), far fewer compilations than rows x attend buckets without it.
- On a GPU the Pallas kernel (engine.jax_backend.ragged_attention) reads each row's live length
  in place as well: one attend shape there too (not under tensor parallelism).
- Without either kernel (a mesh, bfloat16 on CPU, or a CPU that cannot build it), attend buckets start at 128 because
  fewer, longer reads are cheap at decode: the K/V of 128 positions is small next to the weights
  a step reads.

The service validates requests; here `ModelUsageError` guards the Model contract, because JAX
would clamp an out-of-range id or position silently instead of failing. Ids at or past the tokenizer's size
(padding rows of the embedding) have no head column, so no sampling mode can ever choose one.

Shapes: B slots, R rows in a step, T prompt tokens, S context, A attended positions, V embedding
rows, V' ids the tokenizer can produce, E hidden, K kv heads, D head dim, L layers.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import cpu_kernels, host_memory, memory_plan, mesh, quantize, ragged_attention, sampling, transformer
from engine.jax_backend.weights import Weights, default_dtype, load_checkpoint, load_int8, load_sharded, packed_head, with_panels
from engine.model_store.checkpoint import CheckpointError, ModelConfig, parse_config, tokenizer_size
from engine.core.model import ChunkInput, DecodeInput, ModelInfo, ModelUsageError, PromptInput, Sample, SlotSetup
from engine.core.prefix_cache import PrefixPool
from engine.jax_backend.sampling import SlotSampling

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # smallest prompt (chunk) bucket
MAX_CHUNK = 512  # largest prompt chunk one prefill call runs; longer prompts run as several chunks
# Most prompt tokens, all prompts together, in one packed prefill (Model.prefill_packed): the
# largest prompt bucket up to this. A burst of short prompts is then about one call instead of one
# each (on the first H200 run, 64 prompts of 3 tokens one call each took 0.45 s, 7 ms a call, of
# a 1.0 s window of 64 streams; docs/benchmarks.md, "GPU check").
PACKED_TOKENS = 256
# Smallest packed size compiled (the prompt buckets from it up to PACKED_TOKENS): on the CPU a
# prefill is arithmetic and padding costs its share, so every bucket; on an accelerator a pass of up
# to a few hundred token rows costs about what one row's does (the weights' read), and each size is
# compiled at every start without the cache, so only PACKED_TOKENS itself.
MIN_PACKED = {"cpu": 1}
ACCELERATOR_MIN_PACKED = PACKED_TOKENS
MIN_ATTEND = 128  # smallest decode attend bucket
# Smallest decode row bucket. On the CPU a step's products cost more with every row, so rows
# double from 1. On an accelerator a decode step reads every weight once whatever its rows, and up
# to ~100 rows the arithmetic hides under that read (an H200 reads a 1B model's 2.4 GB of bf16 in
# ~0.5 ms; 16 rows of it are 0.04 TFLOP, ~0.05 ms), so buckets below 16 rows would cost compiles
# and save nothing.
MIN_ROWS = {"cpu": 1}
ACCELERATOR_MIN_ROWS = 16
LAYERS_PER_CALL = 5  # decode; prefill runs one layer per call
PREFIX_BLOCK = 16  # positions per prefix-cache block (the unit of prefix matching)
# The scheduler's default prefill budget per step while others decode (Model.default_step_tokens),
# so that a decoding stream's gaps stay within a few steps while a long prompt is read
# (docs/benchmarks.md, "Long prompts"). On the CPU a chunk rides along with the decode step
# (`dispatch`), and 8 of its rows with a few decoding ones stay within one register block of the
# panel kernel (12 rows), whose cost there is the weights' read: on the default model, a stream's
# median gap while a 1,800-token prompt was read was 1.5x its steady gap (worst 3.9x), against
# 2.1x (4.9x) with 16 a step, which read the prompt in 7 s instead of 10.
STEP_TOKENS = {"cpu": 8}
ACCELERATOR_STEP_TOKENS = 512
# XLA:CPU hands matmuls with more than one row, batched attention products and reductions to
# YNNPACK by default; its own emitters and Eigen were faster for the decode shapes measured here
# (docs/benchmarks.md, "Design measurements"), so on CPU every call compiles with YNNPACK fusions off.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def cpu_kernel_state(
    requested: bool, dtype: jnp.dtype, build: cpu_kernels.BuildOptions, tensor_parallel: int = 1
) -> str:
    """Whether a model's decode steps use the CPU kernels, as `JaxModel.kernel_state` says it:
    "on: ...", "off: <reason>" or "not applicable: <reason>"; the log says the same (at WARNING
    when they would apply here but cannot be loaded, engine.jax_backend.cpu_kernels.status)."""
    if not requested:
        log.info("CPU decode kernels off: turned off by configuration; using plain JAX")
        return f"{cpu_kernels.OFF}: turned off by configuration"
    if tensor_parallel > 1 and jax.default_backend() == "cpu":
        # An XLA custom call is opaque to the SPMD partitioner; the kernels read whole packed
        # weights and whole cache rows, so under a mesh they would need shard_map wrappers.
        reason = f"tensor parallelism over {tensor_parallel} devices (the partitioner cannot split their custom calls)"
        log.info("CPU decode kernels off: %s; using plain JAX", reason)
        return f"{cpu_kernels.OFF}: {reason}"
    if jax.default_backend() == "cpu" and dtype != jnp.float32:
        log.info("CPU decode kernels not applicable: they are float32 only, the dtype is %s; using plain JAX", dtype)
        return f"{cpu_kernels.NOT_APPLICABLE}: the dtype is {dtype}, and they are float32 only"
    return cpu_kernels.status(build).state


def cpu_compiler_options() -> dict[str, str] | None:
    """CPU_COMPILER_OPTIONS on a CPU backend whose XLA still knows the (experimental) flag; None
    elsewhere, so a jaxlib that renamed or dropped it compiles with its defaults instead of failing."""
    if jax.default_backend() != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(np.float32(0)).compile()
    except Exception:  # XLA rejects unknown options at compile time
        return None
    return CPU_COMPILER_OPTIONS


def auto_weights(model_dir: Path, kernels_on: bool) -> str:
    """What `weights="auto"` (the servers' default) serves: "int8" where the CPU kernels run
    (`kernels_on`: the CPU backend, one device, float32, a library loaded; as `cpu_kernel_state`
    decides, and says why not) for a model that brings its own GGUF (a pulled model keeps it as
    model.gguf, whose Q8_0, Q4_0/1 and Q5_0/1 blocks are served as the file has them: the values
    float32 holds). There int8 decodes faster than float32 in less memory and passes the quality
    gates (docs/benchmarks.md, issue 15). Elsewhere "float32", also for a checkpoint with no GGUF
    (its int8 would be our own quantization of it, not gated on that model). Logs the choice."""
    from engine.model_store.gguf_convert import GGUF_NAME  # (gguf_convert imports the gguf package: only here)

    reasons = []
    if not kernels_on:
        reasons.append("the CPU kernels are off")
    if not (model_dir / GGUF_NAME).is_file():
        reasons.append(f"no {GGUF_NAME} in the model directory")
    choice = "float32" if reasons else "int8"
    log.info("weights auto: %s (%s)", choice, ", ".join(reasons) or f"the CPU kernels and the model's {GGUF_NAME}")
    return choice


def int8_layout(model_dir: Path, cfg) -> quantize.Int8Layout | None:
    """The formats `--weights int8` holds this directory's matrices in, for the memory check:
    from its model.gguf's header (engine.model_store.gguf_blocks), or None (no GGUF: 8 bits and a
    scale everywhere)."""
    from engine.model_store import gguf_blocks, gguf_convert  # (the gguf package: only here)

    path = model_dir / gguf_convert.GGUF_NAME
    return quantize.gguf_layout(gguf_blocks.block_formats(path), cfg) if path.is_file() else None


def default_step_tokens() -> int:
    """The default prefill budget per step on this backend (STEP_TOKENS)."""
    return STEP_TOKENS.get(jax.default_backend(), ACCELERATOR_STEP_TOKENS)


def smallest_chunk(step_tokens: int | None) -> int:
    """The smallest prompt bucket (`JaxModel.load`'s min_bucket) for a scheduler's per-step prompt
    budget (`--max-step-tokens`; None: this backend's default, `default_step_tokens()`; 0: no
    budget): MIN_BUCKET, or for a budget below it the power of two that holds one budget's chunk,
    so small chunks are not padded up to MIN_BUCKET (each halving adds one chunk shape to warm-up)."""
    if step_tokens is None:
        step_tokens = default_step_tokens()
    if not step_tokens or step_tokens >= MIN_BUCKET:
        return MIN_BUCKET
    return 1 << (step_tokens - 1).bit_length()


def length_buckets(max_length: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_length`, then `max_length` itself."""
    sizes, size = [], max(1, min(smallest, max_length))
    while size < max_length:
        sizes.append(size)
        size *= 2
    return (*sizes, max_length)


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise ModelUsageError(problem)


def _bucket(buckets: tuple[int, ...], length: int) -> int:
    return next(b for b in buckets if b >= length)


def prompt_pieces(start: int, end: int, buckets: tuple[int, ...], context: int) -> list[tuple[int, int, int]]:
    """Prompt positions [start, end) as calls of the compiled chunk sizes `buckets` (ascending):
    (lo, hi, size) with real tokens [lo, hi) and lo + size <= `context`. Each piece takes the
    largest bucket that it fills (no padding) and the last the smallest that holds the rest,
    unless the rest fits one bucket no larger than those pieces together: then it is that one
    call (10 tokens over buckets 8, 16: one call of 16 rather than two of 8, the same rows for
    half the calls; SmolLM2 on the CPU machine, medians of three interleaved runs: int8 19-20 ms
    against 24-26, float32 39 against 60-62). A last piece whose
    bucket would run past the context starts earlier instead, recomputing (identically) a few
    positions already written, so that every call stays inside the cache."""
    pieces, lo = [], start
    while lo < end:
        rest = end - lo
        whole = _bucket(buckets, rest) if rest <= buckets[-1] else None
        size = whole if whole is not None and whole <= _greedy_rows(buckets, rest) else _greedy_first(buckets, rest)
        hi = min(lo + size, end)
        pieces.append((min(lo, context - size), hi, size))
        lo = hi
    return pieces


def _greedy_first(buckets: tuple[int, ...], rest: int) -> int:
    """The first piece of `rest` tokens when split greedily: the largest bucket it fills, else
    (shorter than every bucket) the smallest."""
    fits = [b for b in buckets if b <= rest]
    return fits[-1] if fits else buckets[0]


def _greedy_rows(buckets: tuple[int, ...], rest: int) -> int:
    """The rows (padding included) of `rest` tokens split greedily into pieces."""
    rows = 0
    while rest > 0:
        size = _greedy_first(buckets, rest)
        rows += size
        rest -= size
    return rows


def _embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    return transformer.embed(table, tokens)  # [V, E], [R, T] -> [R, T, E]


def _last(x: jax.Array, length: jax.Array) -> jax.Array:
    """x [1, T, E], length [] -> the hidden state after the last real prompt token [1, 1, E]."""
    return jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)


def _ends(x: jax.Array, ends: jax.Array) -> jax.Array:
    """x [1, T, E], ends [B] (one past each packed prompt's last token; 1 for unused rows) -> the
    hidden state after each prompt's last token [B, 1, E]."""
    return x[0, ends - 1][:, None]


def _rows_head_and_sample(x: jax.Array, final_norm: jax.Array, lm_head, mask, last, slots: jax.Array, *rest, **bound):
    """`_head_and_sample` of the first R rows of x [B, 1, E], R = len(slots): a packed prefill's
    samples, compiled per row bucket (x's shape is always [B, 1, E])."""
    return _head_and_sample(x[: slots.shape[0]], final_norm, lm_head, mask, last, slots, *rest, **bound)


def _write_mask(mask: jax.Array, row: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(mask, row[None], (slot, 0))  # [B, V'] with row [V'] at slot


def _load_blocks(
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D], donated
    v_caches: tuple[jax.Array, ...],
    k_pool: tuple[jax.Array, ...],  # L x [N, K, P, D]: N pool blocks of P positions
    v_pool: tuple[jax.Array, ...],
    slot: jax.Array,  # []
    pool_blocks: jax.Array,  # [M] the pool block of prefix block i, the first `count` used
    count: jax.Array,  # []
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Write pool block pool_blocks[i] at the slot's positions [i*P, (i+1)*P), for i < count."""
    p = k_pool[0].shape[2]

    def one(i, kv):
        at = (slot, 0, i * p, 0)
        put = lambda cache, pool: jax.lax.dynamic_update_slice(cache, pool[pool_blocks[i]][None], at)  # noqa: E731
        return tuple(map(put, kv[0], k_pool)), tuple(map(put, kv[1], v_pool))

    return jax.lax.fori_loop(0, count, one, (k_caches, v_caches))


def _save_blocks(
    k_pool: tuple[jax.Array, ...],  # L x [N, K, P, D], donated
    v_pool: tuple[jax.Array, ...],
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D]
    v_caches: tuple[jax.Array, ...],
    slot: jax.Array,  # []
    blocks: jax.Array,  # [M] prefix block numbers, the first `count` used
    pool_blocks: jax.Array,  # [M] the pool block each goes to
    count: jax.Array,  # []
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Copy the slot's positions [b*P, (b+1)*P) into pool block pool_blocks[i], b = blocks[i]."""
    _, k, p, d = k_pool[0].shape

    def one(i, pools):
        take = lambda pool, cache: jax.lax.dynamic_update_slice(  # noqa: E731
            pool, jax.lax.dynamic_slice(cache, (slot, 0, blocks[i] * p, 0), (1, k, p, d)), (pool_blocks[i], 0, 0, 0)
        )
        return tuple(map(take, pools[0], k_caches)), tuple(map(take, pools[1], v_caches))

    return jax.lax.fori_loop(0, count, one, (k_pool, v_pool))


def _head_and_sample(
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


# Columns of a decode step's packed host inputs: one [R, 9] i32 and one [R, 3] f32 array cross to
# the device per step, not eleven small ones.
GIVEN, USE_GIVEN, POSITION, ACTIVE, MASKED, TOP_K, TOP_N, SEED_HI, SEED_LO = range(9)
TEMPERATURE, TOP_P, MIN_P = range(3)


def _decode_step(
    embed_table: jax.Array,  # [V, E] (or its int8 form)
    final_norm: jax.Array,  # [E]
    lm_head: jax.Array,  # [E, V'] (with its panel copy, weights.PackedHead, where the kernels use it)
    layers: tuple,  # L layer weights (with the panel copies where the kernels use them)
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D], donated
    v_caches: tuple[jax.Array, ...],
    last: jax.Array,  # [B] i32, each slot's last sampled token, donated
    mask: jax.Array,  # [B, V'] bool
    ints: jax.Array,  # [R, 9] i32, the columns above
    floats: jax.Array,  # [R, 3] f32, the columns above
    chunk: tuple[jax.Array, jax.Array] | None = None,  # a prompt chunk riding along: ids [C] i32, (slot, start) [2] i32
    *,
    cfg: ModelConfig,
    attend: int,
    kernels: bool,
    ragged: bool,
    head_size: int | None = None,
) -> tuple:
    """One whole decode step for the first R slots as one executable: embed the slots' inputs
    (the token the host gives, or the slot's last sample, already on the device), every layer,
    head and sampling; with `chunk`, that prompt chunk's KV written into its slot in the same
    pass (transformer.mixed_layers). -> (k_caches, v_caches, last, ids [R], logprobs [R], top ids
    [R, K], top logprobs [R, K])."""
    k_caches, v_caches, x = _decode_layers(
        embed_table, layers, k_caches, v_caches, last, ints, chunk, cfg=cfg, attend=attend, kernels=kernels, ragged=ragged
    )
    return (k_caches, v_caches, *_step_sample(x, final_norm, lm_head, mask, last, ints, floats, cfg=cfg, head_size=head_size))


def _decode_layers(
    embed_table: jax.Array,  # [V, E] (or its int8 form)
    layers: tuple,  # L layer weights
    k_caches: tuple[jax.Array, ...],  # L x [B, K, S, D], donated
    v_caches: tuple[jax.Array, ...],
    last: jax.Array,  # [B] i32, each slot's last sampled token (read, not written)
    ints: jax.Array,  # [R, 9] i32
    chunk: tuple[jax.Array, jax.Array] | None = None,
    *,
    cfg: ModelConfig,
    attend: int,
    kernels: bool,
    ragged: bool,
) -> tuple:
    """A decode step up to the final hidden state: the slots' inputs embedded and every layer
    run (with `chunk` along, as `_decode_step`). -> (k_caches, v_caches, x [R, 1, E])."""
    r = ints.shape[0]
    active = ints[:, ACTIVE] > 0  # [R]
    positions = ints[:, POSITION]  # [R]
    tokens = jnp.where(ints[:, USE_GIVEN] > 0, ints[:, GIVEN], last[:r])  # [R]
    x = transformer.embed(embed_table, tokens[:, None])  # [R, 1, E]
    if chunk is None:
        x, k_caches, v_caches = transformer.decode_layers(
            layers, k_caches, v_caches, x, positions, active, cfg=cfg, attend=attend, kernels=kernels, ragged=ragged
        )
    else:
        ids, at = chunk
        x, k_caches, v_caches = transformer.mixed_layers(
            layers, k_caches, v_caches, x, positions, active, transformer.embed(embed_table, ids), at[0], at[1],
            cfg=cfg, attend=attend, kernels=kernels, ragged=ragged,
        )
    return k_caches, v_caches, x


def _step_sample(
    x: jax.Array,  # [R, 1, E], the rows' final hidden states
    final_norm: jax.Array,
    lm_head: jax.Array,
    mask: jax.Array,  # [B, V'] bool
    last: jax.Array,  # [B] i32, donated where this is its own executable
    ints: jax.Array,  # [R, 9] i32
    floats: jax.Array,  # [R, 3] f32
    *,
    cfg: ModelConfig,
    head_size: int | None = None,
    greedy_only: bool = False,
) -> tuple:
    """A decode step's head and sampling for its R rows (row i is slot i), parameters from the
    packed host columns. -> (last, ids [R], logprobs [R], top ids [R, K], top logprobs [R, K])."""
    r = ints.shape[0]
    seed = jax.lax.bitcast_convert_type(ints[:, SEED_HI:SEED_LO + 1], jnp.uint32)  # [R, 2]
    params = SlotSampling(floats[:, TEMPERATURE], ints[:, TOP_K], floats[:, TOP_P], floats[:, MIN_P], seed)
    return _head_and_sample(
        x, final_norm, lm_head, mask, last, jnp.arange(r, dtype=jnp.int32), ints[:, ACTIVE] > 0, ints[:, MASKED] > 0,
        params, ints[:, POSITION] + 1, ints[:, TOP_N], cfg, head_size, greedy_only,
    )


def _alternatives(ids: np.ndarray, logprobs: np.ndarray, wanted: np.ndarray) -> list[tuple[tuple[int, float], ...]]:
    """ids, logprobs [R, K], wanted [R] -> per row its first `wanted` (id, logprob) pairs."""
    return [tuple(zip(i[:n].tolist(), p[:n].tolist())) for i, p, n in zip(ids, logprobs, wanted.tolist())]


def _fetch(samples: tuple[jax.Array, ...], top_n: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """A sampling call's (ids, logprobs, top ids, top logprobs) [R], [R], [R, K], [R, K] from the
    device -> ids, logprobs and per row its first top_n alternatives; the alternatives are fetched
    only when some row asks for them."""
    if not top_n.any():
        tokens, logprobs = jax.device_get(samples[:2])
        return tokens, logprobs, [()] * len(top_n)
    tokens, logprobs, top_ids, top_logprobs = jax.device_get(samples)
    return tokens, logprobs, _alternatives(top_ids, top_logprobs, top_n)


@dataclass(frozen=True)
class _Pending:
    """A dispatched decode step whose samples the host has not read yet."""

    slots: np.ndarray  # [N] the slots of the step's inputs, in input order
    top_n: np.ndarray  # [R] alternatives each row reports
    samples: tuple[jax.Array, ...]  # ids [R], logprobs [R], top ids [R, K], top logprobs [R, K], on the device


class JaxModel:
    """A loaded checkpoint plus its device state; implements engine.core.model.Model."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,
        info: ModelInfo,
        dtype: jnp.dtype,
        min_bucket: int = MIN_BUCKET,
        min_attend: int = MIN_ATTEND,
        kernels: bool = True,
        kernel_build: cpu_kernels.BuildOptions = cpu_kernels.BuildOptions(),
        max_chunk: int = MAX_CHUNK,
        prefix_cache_tokens: int = 0,
        plan: mesh.Plan | None = None,
        cpu_threads: int | None = None,
        min_rows: int | None = None,
        fused_chunk_tokens: int | None = None,
        min_packed: int | None = None,
        split_sampler: bool | None = None,
    ) -> None:
        b, s = info.max_batch_size, info.max_context_length
        self.info = info
        self.config = config
        self._weights = weights
        self.plan = plan  # tensor parallelism: where each array lives on the mesh; None: one device
        self._head_size = weights.lm_head.shape[1] if plan is None else plan.head_size  # V'
        cache_sharding = None if plan is None else plan.cache
        cache = transformer.init_cache(config, b, s, dtype, cache_sharding)
        self._k, self._v = list(cache.k), list(cache.v)  # per layer; each call swaps in new buffers
        self._mask = jnp.zeros((b, self._head_size), bool, device=None if plan is None else plan.replicated)
        self._last = jnp.zeros(b, jnp.int32, device=None if plan is None else plan.replicated)  # [B] last samples
        self._pending: collections.deque[_Pending] = collections.deque()  # dispatched steps, oldest first
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self.prefix_pool = PrefixPool(PREFIX_BLOCK, prefix_cache_tokens // PREFIX_BLOCK)
        pool = transformer.init_cache(config, self.prefix_pool.blocks, PREFIX_BLOCK, dtype, cache_sharding)  # pool blocks as "slots"
        self._k_pool, self._v_pool = pool.k, pool.v
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        self._prompt_buckets = length_buckets(min(s, max_chunk), min_bucket)
        self.default_step_tokens = min(default_step_tokens(), self._prompt_buckets[-1])
        # The CPU attention kernel reads each row's live keys itself: one attend shape is enough.
        # For operators: "on: <origin> <path>", "off: <reason>" or "not applicable: <reason>".
        self.kernel_state = cpu_kernel_state(kernels, dtype, kernel_build, 1 if plan is None else plan.size)
        self.kernels = self.kernel_state.split(":", 1)[0] == cpu_kernels.ON
        self.int8 = isinstance(weights.embed, quantize.Int8Matrix)  # --weights int8 (engine.jax_backend.quantize)
        if self.int8 and not self.kernels:
            raise ValueError(f"int8 weights need the CPU kernels, which are {self.kernel_state}")
        self.cpu_threads = 1  # threads per kernel call (weight product or attention): the CPUs this process may use, or as configured
        if self.kernels:
            self.cpu_threads = cpu_threads or cpu_kernels.available_cpus()
            cpu_kernels.set_threads(cpu_kernels.status(kernel_build).kernels, self.cpu_threads)
        # On a GPU, decode attention is the ragged Pallas kernel (engine.jax_backend.ragged_attention),
        # which reads each row's live length too; not under a mesh, whose partitioner cannot split it.
        self.ragged = not self.kernels and plan is None and ragged_attention.applies(config.head_dim, s)
        self._attend_buckets = (s,) if self.kernels or self.ragged else length_buckets(s, min_attend)
        if fused_chunk_tokens is None:  # with the CPU kernels (one device): the scheduler's default budget
            fused_chunk_tokens = self.default_step_tokens if self.kernels else 0
        if fused_chunk_tokens < 0:
            raise ValueError(f"fused_chunk_tokens must be >= 0, got {fused_chunk_tokens}")
        # a chunk that rides along with a decode step (dispatch) is padded to the smallest of these
        # compiled sizes that holds it: the chunk buckets up to the one of fused_chunk_tokens
        self.fused_chunk_tokens = 0 if b == 1 else min(fused_chunk_tokens, self._prompt_buckets[-1])
        top = _bucket(self._prompt_buckets, self.fused_chunk_tokens) if self.fused_chunk_tokens else 0
        self._fused_sizes = tuple(c for c in self._prompt_buckets if c <= top)
        self._row_buckets = length_buckets(b, min_rows or MIN_ROWS.get(jax.default_backend(), ACCELERATOR_MIN_ROWS))
        # Packed prefill (prefill_packed): not with one slot, and not under a mesh (its calls keep to
        # the shapes the partitioner has seen); its sizes are the prompt buckets up to PACKED_TOKENS.
        packed = [t for t in self._prompt_buckets if t <= PACKED_TOKENS] or [self._prompt_buckets[0]]
        smallest = min_packed or MIN_PACKED.get(jax.default_backend(), ACCELERATOR_MIN_PACKED)
        packed = [t for t in packed if t >= smallest] or packed[-1:]
        self.packed_prefill_tokens = 0 if b == 1 or plan is not None else packed[-1]
        self._packed_sizes = tuple(packed) if self.packed_prefill_tokens else ()
        self._packed_rows = tuple(r for r in self._row_buckets if r >= 2) if self.packed_prefill_tokens else ()
        # The decode step's head and sampling as their own executable, in two variants the host
        # picks per step (`_launch`): on an accelerator by default, where the one-executable step
        # computes every piece of sampling.sample for rows that need none (docs/benchmarks.md, "GPU check").
        self.split_sampler = jax.default_backend() != "cpu" if split_sampler is None else split_sampler
        # split: the greedy sampler for a step whose rows are all greedy (False: never; a switch for
        # measurements on one host: every process of a multi-host group must pick alike)
        self.greedy_variant = True
        self.sampler_calls: collections.Counter[str] = collections.Counter()  # split: steps per variant
        layers = weights.layers
        self._lm_head = weights.lm_head
        if self.kernels and not self.int8:  # panel copies for products of a few rows (cpu_kernels.panel_matmul)
            layers = tuple(with_panels(layer) for layer in layers)
            self._lm_head = packed_head(weights.lm_head)
        self._decode_weights = layers  # every layer: one decode step reads them all, a prefill call one
        self._length = np.zeros(b, np.int64)  # positions written per slot; 0 = free slot
        self._filling = np.zeros(b, bool)  # prefilled in part: more chunks to come before it may decode
        self._temperature = np.zeros(b, np.float32)
        self._top_k = np.zeros(b, np.int32)
        self._top_p = np.ones(b, np.float32)
        self._min_p = np.zeros(b, np.float32)
        self._seed = np.zeros((b, 2), np.uint32)
        self._top_n = np.zeros(b, np.int32)  # alternatives each slot's samples report
        caches = ("k_caches", "v_caches")
        o = dict(compiler_options=cpu_compiler_options())
        if jax.default_backend() == "cpu":  # each call's scratch reuses the last one's pages
            host_memory.keep_scratch_resident()

        def own(fn, **bound):  # a function object of this model's: jit caches, and so compilations(), are per model
            return functools.partial(fn, **bound)

        self._embed = jax.jit(own(_embed), **o)
        self._prefill_layers = jax.jit(
            own(transformer.prefill_layers, kernels=self.kernels), static_argnames="cfg", donate_argnames=caches, **o
        )
        self._packed_layers = jax.jit(
            own(transformer.packed_prefill_layers), static_argnames="cfg", donate_argnames=caches, **o
        )
        self._packed_ends = jax.jit(own(_ends), **o)
        head_size = None if plan is None else self._head_size
        self._step = jax.jit(
            own(_decode_step, kernels=self.kernels, ragged=self.ragged, head_size=head_size),
            static_argnames=("cfg", "attend"), donate_argnames=(*caches, "last"), **o,
        )
        self._layers_step = jax.jit(  # split_sampler: the step up to the final hidden states, then _step_sampler
            own(_decode_layers, kernels=self.kernels, ragged=self.ragged),
            static_argnames=("cfg", "attend"), donate_argnames=caches, **o,
        )
        self._step_sampler = jax.jit(
            own(_step_sample, head_size=head_size), static_argnames=("cfg", "greedy_only"), donate_argnames="last", **o
        )
        self._last_hidden = jax.jit(own(_last), **o)
        self._write_mask = jax.jit(own(_write_mask), donate_argnums=0, **o)
        self._sample = jax.jit(
            own(_head_and_sample, head_size=head_size), static_argnames="cfg", donate_argnames="last", **o
        )
        self._packed_sample = jax.jit(
            own(_rows_head_and_sample, head_size=head_size), static_argnames="cfg", donate_argnames="last", **o
        )
        self._load_blocks = jax.jit(own(_load_blocks), donate_argnums=(0, 1), **o)
        self._save_blocks = jax.jit(own(_save_blocks), donate_argnums=(0, 1), **o)
        self._jitted = (
            self._embed, self._prefill_layers, self._step, self._last_hidden, self._write_mask, self._sample,
            self._load_blocks, self._save_blocks, self._packed_layers, self._packed_ends, self._packed_sample,
            self._layers_step, self._step_sampler,
        )

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        *,
        max_batch_size: int = 8,
        max_context_length: int | None = None,
        dtype: str | None = None,
        model_id: str | None = None,
        min_bucket: int | None = MIN_BUCKET,
        min_attend: int = MIN_ATTEND,
        kernels: bool = True,
        kernel_build: cpu_kernels.BuildOptions = cpu_kernels.BuildOptions(),
        max_chunk: int = MAX_CHUNK,
        prefix_cache_tokens: int = 0,
        tensor_parallel: int = 1,
        weights: str = "float32",
        cpu_threads: int | None = None,
        memory_limit_bytes: int | None = None,
        min_rows: int | None = None,
        fused_chunk_tokens: int | None = None,
        min_packed: int | None = None,
        split_sampler: bool | None = None,
    ) -> JaxModel:
        """Read a Hugging Face directory; context defaults to min(max_position_embeddings, 2048).

        Compile-time knobs (fewer shapes warm up faster; see the module docstring for figures):
        `min_bucket` is the smallest prompt bucket (None: as the scheduler's budget needs it,
        `smallest_chunk(fused_chunk_tokens)`, with the backend's default budget when that is
        None too; decided once the backend has its devices), `min_attend` the smallest attended length of a
        decode step (both then double up to the context; unused with the kernel), `min_rows` the
        smallest row bucket of a decode step (default: 1 on CPU, ACCELERATOR_MIN_ROWS elsewhere),
        `min_packed` the smallest packed prefill size (the prompt buckets from it up to
        PACKED_TOKENS; default: every one on CPU, only PACKED_TOKENS elsewhere; MIN_PACKED).
        `kernels`: use the CPU decode kernels where they apply (CPU backend,
        float32, and a library is found or built here; `self.kernels` says whether they are on, and
        `self.kernel_state` says it for operators: "on: <origin> <path>", "off: <reason>" or
        "not applicable: <reason>"): attention, and the
        weight products of up to cpu_kernels.PANEL_ROWS rows on panel-packed copies of the
        projections (held in memory besides the originals); False forces plain JAX and makes no copies. `kernel_build` says where they
        are looked for and built, and with which compiler. `max_chunk`: the largest prompt chunk
        one prefill call runs (capped at the context); prompt buckets are powers of two from
        `min_bucket` up to it, and a longer prompt, or a chunk the scheduler hands over, runs as
        several calls of those shapes. `prefix_cache_tokens`: positions of prompt KV kept for
        automatic prefix caching (rounded down to whole blocks of PREFIX_BLOCK; each holds
        2 x layers x kv heads x head dim values, as a slot's position does); 0: none.
        `tensor_parallel`: the devices one model is split over (engine.jax_backend.mesh); a size
        the model's dimensions or the devices refuse raises mesh.TensorParallelError.
        `weights`: "float32" (the dtype's own), "int8" (engine.jax_backend.quantize: weight-only
        int8 with float32 activations, CPU kernels only; ValueError elsewhere) or "auto"
        (`auto_weights`: int8 where it runs and the model brings its GGUF). `cpu_threads`:
        threads per CPU kernel call, weight product or attention (default: the CPUs this process may use).
        `memory_limit_bytes`: the memory check's limit per device instead of what the device
        offers (engine.jax_backend.memory_plan); a configuration that cannot fit raises
        memory_plan.MemoryPlanError (a ValueError, one line) before any weight is read.
        `fused_chunk_tokens`: the longest prompt chunk a decode step takes along (`dispatch`;
        the scheduler's budget per step, `--max-step-tokens`, is what it hands over); a chunk is
        padded to the smallest prompt bucket that holds it, and each row bucket compiles a decode
        step for each prompt bucket up to the one of fused_chunk_tokens (one, with the defaults).
        Default: with the CPU kernels on, the default budget (`default_step_tokens`); otherwise 0,
        none, each chunk its own calls (with XLA's attention the chunk's step copied its cache
        buffers; on an accelerator it is untried).
        `split_sampler`: a decode step as two executables, the layers and then the head and
        sampling, the latter in a greedy and a full variant that the host picks per step (the
        greedy one when every row is greedy and wants no alternatives: no draw, candidates,
        exact select or top_logprobs). Default: on an accelerator, whose one-executable step
        computes all of those every step (no conditionals there); off on the CPU, whose step
        skips them with conditionals already.
        """
        model_dir = Path(model_dir)
        plan = None
        if weights not in (*quantize.WEIGHTS, quantize.AUTO):
            raise ValueError(f"weights must be one of {', '.join((*quantize.WEIGHTS, quantize.AUTO))}, got {weights!r}")
        if weights == "int8" and tensor_parallel > 1:
            raise ValueError("int8 weights run on one device: they cannot be combined with tensor parallelism")
        if weights == "int8" and jnp.dtype(dtype or default_dtype()) != jnp.float32:
            raise ValueError(f"int8 weights run with float32 activations, not {dtype}")
        # The sizes are checked on config.json, and the memory they take against the device,
        # before any weight is placed (engine.jax_backend.memory_plan).
        cfg = parse_config(json.loads((model_dir / "config.json").read_text()))
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_context_length is not None and not 1 <= max_context_length <= cfg.max_position_embeddings:
            raise ValueError(
                f"max_context_length must be in 1..{cfg.max_position_embeddings} (the model's "
                f"max_position_embeddings), got {max_context_length}"
            )
        context = max_context_length or min(cfg.max_position_embeddings, 2048)
        if cfg.sliding_window is not None and cfg.sliding_window < context:
            raise CheckpointError(
                f"{cfg.architecture}: sliding_window {cfg.sliding_window} < context {context} is not supported"
            )
        if tensor_parallel > 1 and not jax.distributed.is_initialized():
            mesh.request_cpu_devices(tensor_parallel)  # (as load_sharded does) before the backend starts below
        if min_bucket is None:  # (this asks for the backend: after the devices are set)
            min_bucket = smallest_chunk(fused_chunk_tokens)
        dtype_ = jnp.dtype(dtype or default_dtype())
        kernels_on = (  # as cpu_kernel_state will decide in __init__
            kernels and tensor_parallel == 1 and jax.default_backend() == "cpu"
            and dtype_ == jnp.float32 and cpu_kernels.load(kernel_build) is not None
        )
        if weights == quantize.AUTO:
            weights = auto_weights(model_dir, kernels_on)
        settings = memory_plan.Settings(
            max_batch_size, context, max_chunk, prefix_cache_tokens, PREFIX_BLOCK, dtype_.itemsize,
            int8=weights == "int8",
            int8_layout=int8_layout(model_dir, cfg) if weights == "int8" else None,
            panel_copies=kernels_on and weights != "int8",
            devices=tensor_parallel,
        )
        if memory_limit_bytes:
            limit = memory_plan.MemoryLimit(memory_limit_bytes, "the limit stated by configuration")
        else:
            limit = memory_plan.device_limit(jax.local_devices()[0])
        head_size = tokenizer_size(model_dir, cfg.vocab_size)
        if limit is None:
            log.info("memory check skipped: %s reports no memory limit", jax.local_devices()[0])
        else:
            need = memory_plan.check(cfg, head_size, settings, limit, jax.default_backend())
            log.info(
                "memory plan per device: weights %s + KV cache %s + prefix pool %s + temporaries %s = %s of %s, %s",
                *map(memory_plan.gib, (need.weights, need.kv_cache, need.prefix_pool, need.temporaries, need.total, limit.bytes)),
                limit.source,
            )
        if weights == "int8":
            ckpt = load_int8(model_dir)
            cfg = ckpt.config
        elif tensor_parallel == 1:
            ckpt = load_checkpoint(model_dir, dtype)
            cfg = ckpt.config
        else:
            ckpt, cfg, plan = load_sharded(model_dir, dtype, tensor_parallel)
        info = ModelInfo(
            model_id=model_id or model_dir.name,
            vocab_size=cfg.vocab_size,
            max_context_length=context,
            max_batch_size=max_batch_size,
            eos_token_ids=ckpt.eos_token_ids,
        )
        return cls(
            cfg, ckpt.weights, info, dtype_, min_bucket, min_attend, kernels, kernel_build, max_chunk,
            prefix_cache_tokens, plan, cpu_threads, min_rows=min_rows, fused_chunk_tokens=fused_chunk_tokens,
            min_packed=min_packed, split_sampler=split_sampler,
        )

    @property
    def buckets(self) -> tuple[int, ...]:
        """Prompt chunk lengths compiled for, in increasing order (the last is the largest chunk)."""
        return self._prompt_buckets

    @property
    def attend_buckets(self) -> tuple[int, ...]:
        """Attended lengths a decode step is compiled for, in increasing order."""
        return self._attend_buckets

    @property
    def fused_chunk_sizes(self) -> tuple[int, ...]:
        """The compiled sizes of a chunk along with a decode step (empty: none), increasing."""
        return self._fused_sizes

    @property
    def packed_prefill_sizes(self) -> tuple[int, ...]:
        """The sequence lengths a packed prefill is compiled for (empty: none), increasing."""
        return self._packed_sizes

    @property
    def packed_prefill_rows(self) -> tuple[int, ...]:
        """The row counts a packed prefill's sampling is compiled for (empty: none), increasing."""
        return self._packed_rows

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """Row counts (the first R slots) a decode step is compiled for, in increasing order."""
        return self._row_buckets

    @property
    def cache(self) -> transformer.KVCache:
        """The current KV cache; each step consumes (donates) its buffers and installs the next."""
        return transformer.KVCache(tuple(self._k), tuple(self._v))

    def decode_hlo(self, rows: int, attend: int, chunk: bool = False) -> str:
        """The compiled decode step (with `chunk`, the one that takes a chunk along; with
        split_sampler, its layers' executable) as HLO text (cached once warmed up), so tests can
        check that it is one executable whose cache buffers are aliased to the output and never
        copied."""
        return self._lower_step(rows, attend, chunk).compile().as_text()

    def _lower_step(self, rows: int, attend: int, chunk: bool = False):
        ints, floats = self._put(self._pack([], rows))
        along = self._put(self._chunk_arrays(0, [0] * self._fused_sizes[-1], 0)) if chunk else None
        if self.split_sampler:
            return self._layers_step.lower(*self._layers_args(ints, along), cfg=self.config, attend=attend)
        return self._step.lower(*self._step_args(ints, floats, along), cfg=self.config, attend=attend)

    def _step_args(self, ints, floats, along) -> tuple:
        """The one-executable decode step's positional arguments (`_decode_step`)."""
        w = self._weights
        return (w.embed, w.final_norm, self._lm_head, self._decode_weights, tuple(self._k), tuple(self._v), self._last,
                self._mask, ints, floats, along)

    def _layers_args(self, ints, along) -> tuple:
        """The split step's layers' positional arguments (`_decode_layers`)."""
        return (self._weights.embed, self._decode_weights, tuple(self._k), tuple(self._v), self._last, ints, along)

    def compilations(self) -> int:
        """How many (function, shape) variants this model has compiled so far."""
        return sum(f._cache_size() for f in self._jitted)

    def warm_up(self) -> None:
        """Compile every shape serving can use: each prompt bucket (one prefill layer; all
        layers share its shape), a prompt's head and sampling, and a decode step for each (rows,
        attend) pair, run with every row idle. Only with no request in flight: writes slot 0."""
        if self._length.any():
            raise ModelUsageError("warm_up with requests in flight")
        for t in self._prompt_buckets:
            x = self._embed(self._weights.embed, np.zeros((1, t), np.int32))
            self._prefill_through(x, np.int32(0), np.int32(0), layers=1)
            last = self._last_hidden(x, np.int32(1))
        self._mask = self._write_mask(self._mask, np.zeros(self._head_size, bool), np.int32(0))
        zero = np.zeros(1, np.int32)
        self._run_sample(last, zero, np.zeros(1, bool), self._params(slice(0, 1)), zero, zero)
        for rows in self._row_buckets:  # a step with every row idle writes nothing and samples for nobody
            for attend in self._attend_buckets:
                for variant in (True, False) if self.split_sampler else (None,):  # split: both samplers
                    self._launch(np.zeros(0, np.int64), *self._pack([], rows), attend, greedy_only=variant)
                    self.collect()
                for size in self._fused_sizes:  # and with a chunk along (padding, into slot 0, released below)
                    self._launch(np.zeros(0, np.int64), *self._pack([], rows), attend, self._chunk_arrays(0, [0] * size, 0))
                    self.collect()
        for t in self._packed_sizes:  # packed prefill: one layer per size (padding into slot 0), the ends
            x = self._embed(self._weights.embed, np.zeros((1, t), np.int32))
            x = self._packed_through(x, *self._packed_arrays([], [], t, 0), layers=1)
            ends = self._packed_ends(x, np.ones(self.info.max_batch_size, np.int32))
        for rows in self._packed_rows:  # and its samples, every row idle
            self._packed_rows_sample(ends, np.zeros(rows, np.int32), np.zeros(rows, bool), np.zeros(rows, bool),
                                     np.zeros(rows, np.int32))
        if self.prefix_pool.blocks:  # copies of 0 blocks: only the compiles
            self._copy_into_slot(0, [])
            self._copy_into_pool(0, [], [])
        self.release(0)

    def prefill(self, slot: int, prompt_token_ids: Sequence[int], setup: SlotSetup, masked: bool) -> Sample:
        sample = self.prefill_chunk(slot, prompt_token_ids, 0, len(prompt_token_ids), setup, masked)
        assert sample is not None  # the chunk ends the prompt
        return sample

    def prefill_chunk(
        self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int, setup: SlotSetup, masked: bool
    ) -> Sample | None:
        n = len(prompt_token_ids)
        self._check_chunk(slot, prompt_token_ids, start, end)
        if start == 0:
            self._take(slot, setup)
        x, last = None, 0
        for lo, hi, size in self._pieces(start, end):  # each one compiled shape: [lo, lo + size) in the context
            tokens = np.zeros(size, np.int32)
            tokens[: hi - lo] = prompt_token_ids[lo:hi]
            x = self._embed(self._weights.embed, tokens[None])  # [1, C, E]
            x = self._prefill_through(x, np.int32(slot), np.int32(lo))
            last = hi - lo  # the last real token's index in the piece, plus one
        self._length[slot] = end
        if end < n:
            return None
        self._filling[slot] = False
        row = slice(slot, slot + 1)
        token, logprob, top = self._run_sample(
            self._last_hidden(x, np.int32(last)), np.array([slot], np.int32), np.array([masked]), self._params(row),
            np.array([n], np.int32), self._top_n[row],
        )
        return Sample(int(token[0]), float(logprob[0]), top[0])

    def prefill_packed(self, prompts: Sequence[PromptInput]) -> list[Sample]:
        """The prompts end to end in one sequence of the smallest packed size that holds them
        (transformer.packed_prefill_layers, one call per layer for all of them), then one head
        and sampling call for every prompt's last position."""
        m = len(prompts)
        _require(0 < m <= self.info.max_batch_size and self.packed_prefill_tokens > 0, f"a packed prefill of {m} prompts")
        slots = [p.slot for p in prompts]
        _require(len(set(slots)) == m, "a slot twice in one packed prefill")
        total = sum(len(p.prompt_token_ids) for p in prompts)
        _require(total <= self.packed_prefill_tokens, f"{total} prompt tokens in one packed prefill")
        for p in prompts:
            self._check_chunk(p.slot, p.prompt_token_ids, 0, len(p.prompt_token_ids))
        for p in prompts:
            self._take(p.slot, p.setup)
        size = _bucket(self._packed_sizes, total)
        tokens = np.zeros((1, size), np.int32)
        tokens[0, :total] = [t for p in prompts for t in p.prompt_token_ids]
        x = self._embed(self._weights.embed, tokens)  # [1, T, E]
        x = self._packed_through(x, *self._packed_arrays(slots, [len(p.prompt_token_ids) for p in prompts], size, 0))
        ends = np.ones(self.info.max_batch_size, np.int32)
        ends[:m] = np.cumsum([len(p.prompt_token_ids) for p in prompts])
        for p in prompts:
            self._length[p.slot] = len(p.prompt_token_ids)
            self._filling[p.slot] = False
        rows = _bucket(self._packed_rows, m) if m > 1 else _bucket(self._packed_rows, 2)
        # rows past the prompts sample for nobody, at a slot none of them holds (so the write of
        # each row's sample into `last` never meets another row's at the same slot)
        idle = next((s for s in range(self.info.max_batch_size) if s not in set(slots)), 0)  # none: no idle rows
        row_slots = np.full(rows, idle, np.int32)
        row_slots[:m] = slots
        active = np.zeros(rows, bool)
        active[:m] = True
        masked = np.zeros(rows, bool)
        masked[:m] = [p.masked for p in prompts]
        positions = np.zeros(rows, np.int32)
        positions[:m] = [len(p.prompt_token_ids) for p in prompts]
        token, logprob, top = self._packed_rows_sample(self._packed_ends(x, ends), row_slots, active, masked, positions)
        return [Sample(int(token[i]), float(logprob[i]), top[i]) for i in range(m)]

    def _packed_arrays(
        self, slots: Sequence[int], lengths: Sequence[int], size: int, pad_slot: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per token of a packed sequence of `size`: its slot, its position in its prompt and its
        prompt's index; the padding continues the last prompt (or, with none, is prompt 0 of
        `pad_slot` from position 0)."""
        slot_of, position, prompt = np.zeros(size, np.int32), np.zeros(size, np.int32), np.zeros(size, np.int32)
        at = 0
        for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
            slot_of[at : at + n], position[at : at + n], prompt[at : at + n] = slot, np.arange(n), i
            at += n
        last_slot, last_n, last_i = (slots[-1], lengths[-1], len(slots) - 1) if slots else (pad_slot, 0, 0)
        slot_of[at:], position[at:], prompt[at:] = last_slot, last_n + np.arange(size - at), last_i
        return slot_of, position, prompt

    def _packed_through(
        self, x: jax.Array, slots: np.ndarray, positions: np.ndarray, prompts: np.ndarray, layers: int | None = None
    ) -> jax.Array:
        """A packed sequence x [1, T, E] through the first `layers` layers (None: all), one call a
        layer with its cache buffers donated, as `_prefill_through`."""
        for i, layer in enumerate(self._decode_weights[:layers]):
            x, self._k[i : i + 1], self._v[i : i + 1] = self._packed_layers(
                (layer,), (self._k[i],), (self._v[i],), x, slots, positions, prompts, cfg=self.config
            )
        return x

    def _packed_rows_sample(
        self, x: jax.Array, slots: np.ndarray, active: np.ndarray, masked: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[tuple[int, float], ...]]]:
        """Head and sampling of the first len(slots) rows of x [B, 1, E]; -> ids, logprobs and
        each row's alternatives (fetched only when a row asks for them)."""
        w = self._weights
        top_n = np.where(active, self._top_n[slots], 0).astype(np.int32)
        self._last, *samples = self._packed_sample(
            x, w.final_norm, self._lm_head, self._mask, self._last, slots, active, masked, self._params(slots),
            positions, top_n, cfg=self.config,
        )
        return _fetch(tuple(samples), top_n)

    def _check_chunk(self, slot: int, prompt_token_ids: Sequence[int], start: int, end: int) -> None:
        """A chunk [start, end) of a prompt this slot can take next (prefill_chunk, dispatch)."""
        n, s_ = len(prompt_token_ids), self.info.max_context_length
        _require(1 <= n < s_, f"a prompt of {n} tokens in a context of {s_}")
        _require(0 <= start < end <= n, f"a chunk [{start}, {end}) of a prompt of {n} tokens")
        if start == 0:
            _require(self._length[slot] == 0 and not self._filling[slot], f"slot {slot} is in use")
        else:
            _require(self._filling[slot] and self._length[slot] == start, f"a chunk at {start} is not slot {slot}'s next one")
        ids = np.asarray(prompt_token_ids[start:end], np.int64)
        _require(0 <= ids.min() and ids.max() < self.config.vocab_size, "a prompt id outside the vocabulary")

    def _take(self, slot: int, setup: SlotSetup) -> None:
        """A free slot starts a request: its sampling parameters and masked ids."""
        v = self.config.vocab_size
        _require(all(0 <= t < v for t in setup.masked_token_ids), "a masked id outside the vocabulary")
        s = setup.sampling
        _require(s.seed is not None, "no seed (the engine sets one for every request)")
        self._temperature[slot], self._top_k[slot] = s.temperature, s.top_k
        self._top_p[slot], self._min_p[slot] = s.top_p, s.min_p
        self._seed[slot] = sampling.seed_words(s.seed)
        self._top_n[slot] = min(s.top_logprobs, sampling.MAX_TOP_LOGPROBS)
        mask_row = np.zeros(self._head_size, bool)
        mask_row[[t for t in setup.masked_token_ids if t < self._head_size]] = True  # others are never sampled
        self._mask = self._write_mask(self._mask, mask_row, np.int32(slot))
        self._filling[slot] = True

    def load_prefix(self, slot: int, pool_blocks: Sequence[int], setup: SlotSetup) -> None:
        n = len(pool_blocks) * PREFIX_BLOCK
        _require(self._length[slot] == 0 and not self._filling[slot], f"slot {slot} is in use")
        _require(0 < n < self.info.max_context_length, f"a prefix of {n} positions in a context of {self.info.max_context_length}")
        _require(all(0 <= p < self.prefix_pool.blocks for p in pool_blocks), "a pool block outside the prefix pool")
        self._take(slot, setup)
        self._copy_into_slot(slot, pool_blocks)
        self._length[slot] = n

    def save_prefix(self, slot: int, blocks: Sequence[tuple[int, int]]) -> None:
        if not blocks:
            return
        numbers, pool_blocks = zip(*blocks)
        _require(self._length[slot] >= (max(numbers) + 1) * PREFIX_BLOCK, f"a block of slot {slot} not yet written")
        _require(all(0 <= p < self.prefix_pool.blocks for p in pool_blocks), "a pool block outside the prefix pool")
        self._copy_into_pool(slot, numbers, pool_blocks)

    def _block_index(self, values: Sequence[int]) -> np.ndarray:
        """Block numbers padded to one shape, the most blocks a context holds, so that every copy
        of any length runs the one compiled loop."""
        index = np.zeros(self.info.max_context_length // PREFIX_BLOCK, np.int32)
        index[: len(values)] = values
        return index

    def _copy_into_slot(self, slot: int, pool_blocks: Sequence[int]) -> None:
        k, v = self._load_blocks(
            tuple(self._k), tuple(self._v), self._k_pool, self._v_pool, np.int32(slot),
            self._block_index(pool_blocks), np.int32(len(pool_blocks)),
        )
        self._k, self._v = list(k), list(v)

    def _copy_into_pool(self, slot: int, numbers: Sequence[int], pool_blocks: Sequence[int]) -> None:
        self._k_pool, self._v_pool = self._save_blocks(
            self._k_pool, self._v_pool, tuple(self._k), tuple(self._v), np.int32(slot),
            self._block_index(numbers), self._block_index(pool_blocks), np.int32(len(pool_blocks)),
        )

    def _pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        return prompt_pieces(start, end, self._prompt_buckets, self.info.max_context_length)

    def decode(self, inputs: Sequence[DecodeInput]) -> list[Sample]:
        _require(not self._pending, "decode with a dispatched step not yet collected")
        self.dispatch(inputs)
        return self.collect()

    def dispatch(self, inputs: Sequence[DecodeInput], chunk: ChunkInput | None = None) -> None:
        """Enqueue one decode step and return without waiting for it: the device runs it while
        the host reads the previous step (`collect`). An input whose token_id is None feeds the
        slot's last sample, which never left the device. A `chunk` (at most fused_chunk_tokens,
        padded to their compiled size) is prefilled in the same executable
        (transformer.mixed_layers), its slot then awaiting its next chunk as after prefill_chunk."""
        _require(bool(inputs), "a decode step with no inputs")
        slots = np.fromiter((i.slot for i in inputs), np.int64, len(inputs))
        given = np.fromiter((i.position for i in inputs), np.int64, len(inputs))
        ids = [i.token_id for i in inputs if i.token_id is not None]
        _require(len(np.unique(slots)) == len(slots), "a slot twice in one step")
        _require((self._length[slots] > 0).all() and not self._filling[slots].any(), "a slot that was not prefilled")
        _require((given == self._length[slots]).all(), "a position that is not the slot's next one")
        _require(given.max() < self.info.max_context_length, "a position past the context")
        _require(all(0 <= t < self.config.vocab_size for t in ids), "a token id outside the vocabulary")
        rows = _bucket(self._row_buckets, int(slots.max()) + 1)
        attend = _bucket(self._attend_buckets, int(given.max()) + 1)
        arrays = None
        if chunk is not None:
            c = chunk
            _require(0 < c.end - c.start <= self.fused_chunk_tokens, f"a chunk of {c.end - c.start} tokens along with a step")
            _require(c.slot not in set(slots.tolist()), f"slot {c.slot} both decodes and prefills in one step")
            size = _bucket(self._fused_sizes, c.end - c.start)
            _require(c.start + size <= self.info.max_context_length, "a chunk along with a step past the context")
            self._check_chunk(c.slot, c.prompt_token_ids, c.start, c.end)
            _require(c.end < len(c.prompt_token_ids), "a prompt's last chunk along with a step (it samples)")
            if c.start == 0:
                self._take(c.slot, c.setup)
            arrays = self._chunk_arrays(c.slot, c.prompt_token_ids[c.start : c.end], c.start, size)
        self._launch(slots, *self._pack(inputs, rows), attend, arrays)
        self._length[slots] += 1
        if chunk is not None:
            self._length[chunk.slot] = chunk.end

    def collect(self) -> list[Sample]:
        """The samples of the oldest dispatched step, one per input in input order; waits for
        the device to finish it."""
        _require(bool(self._pending), "collect with no step dispatched")
        step = self._pending.popleft()
        tokens, logprobs, tops = _fetch(step.samples, step.top_n)
        slots = step.slots.tolist()
        return [Sample(t, p, tops[s]) for s, t, p in zip(slots, tokens[slots].tolist(), logprobs[slots].tolist())]

    def _pack(self, inputs: Sequence[DecodeInput], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A step's host inputs for the first `rows` slots as the two packed arrays the step
        reads (columns GIVEN.. and TEMPERATURE..); rows with no input are idle (greedy, no cuts)."""
        ints, floats = np.zeros((rows, 9), np.int32), np.zeros((rows, 3), np.float32)
        floats[:, TOP_P] = 1.0
        for i in inputs:
            s = i.slot
            ints[s, GIVEN] = 0 if i.token_id is None else i.token_id
            ints[s, USE_GIVEN] = i.token_id is not None
            ints[s, POSITION], ints[s, ACTIVE], ints[s, MASKED] = i.position, 1, i.masked
            ints[s, TOP_K], ints[s, TOP_N] = self._top_k[s], self._top_n[s]
            floats[s] = self._temperature[s], self._top_p[s], self._min_p[s]
        ints[:, SEED_HI:SEED_LO + 1] = self._seed[:rows].view(np.int32)
        return ints, floats

    def _chunk_arrays(
        self, slot: int, ids: Sequence[int], start: int, size: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """A chunk's ids padded to `size` (default: its length), and (slot, start): what the step
        takes along."""
        tokens = np.zeros(size or len(ids), np.int32)
        tokens[: len(ids)] = ids
        return tokens, np.array([slot, start], np.int32)

    def _launch(
        self, slots: np.ndarray, ints: np.ndarray, floats: np.ndarray, attend: int,
        chunk: tuple[np.ndarray, np.ndarray] | None = None, greedy_only: bool | None = None,
    ) -> None:
        """Enqueue a decode step: one executable, or with split_sampler the layers and then the
        sampler variant `greedy_only` says (None: greedy where every row is greedy and wants no
        alternatives, and greedy_variant allows it)."""
        along = None if chunk is None else self._put(chunk)
        if not self.split_sampler:
            k, v, self._last, *samples = self._step(
                *self._step_args(*self._put((ints, floats)), along), cfg=self.config, attend=attend
            )
        else:
            ints_d, floats_d = self._put((ints, floats)) if self.plan else jax.device_put((ints, floats))  # once for both calls
            k, v, x = self._layers_step(*self._layers_args(ints_d, along), cfg=self.config, attend=attend)
            if greedy_only is None:
                greedy_only = self.greedy_variant and not (floats[:, TEMPERATURE] > 0).any() and not (ints[:, TOP_N] > 0).any()
            self.sampler_calls["greedy" if greedy_only else "full"] += 1
            self._last, *samples = self._step_sampler(
                x, self._weights.final_norm, self._lm_head, self._mask, self._last, ints_d, floats_d, cfg=self.config,
                greedy_only=bool(greedy_only),
            )
        self._k, self._v = list(k), list(v)
        self._pending.append(_Pending(slots, ints[:, TOP_N].copy(), tuple(samples)))

    def release(self, slot: int) -> None:
        self._length[slot] = 0
        self._filling[slot] = False
        self._temperature[slot], self._top_k[slot], self._top_p[slot], self._min_p[slot] = 0.0, 0, 1.0, 0.0
        self._seed[slot] = 0
        self._top_n[slot] = 0

    def _put(self, tree):
        """Per-step host inputs for the step: as they are on one device (the jitted call copies
        numpy arrays itself, ~0.3 ms a step less host work than a device_put first, measured at
        batch 1 on the CPU, where that work takes cores from the step), onto every device of the
        mesh, replicated, under tensor parallelism."""
        return tree if self.plan is None else self.plan.put(tree)

    def _prefill_through(self, x: jax.Array, slot: np.int32, start: np.int32, layers: int | None = None) -> jax.Array:
        """A prompt piece x [1, C, E] at `start` of `slot` through the first `layers` layers (None:
        all), one jitted call per layer with its cache buffers donated, the returned buffers
        installed; -> hidden states."""
        for i, layer in enumerate(self._decode_weights[:layers]):
            x, self._k[i : i + 1], self._v[i : i + 1] = self._prefill_layers(
                (layer,), (self._k[i],), (self._v[i],), x, slot, start, cfg=self.config
            )
        return x

    def _run_sample(
        self, x: jax.Array, slots: np.ndarray, masked: np.ndarray, params: SlotSampling, positions: np.ndarray,
        top_n: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[tuple[int, float], ...]]]:
        """Head and sampling for a prompt's last position (the row of slot `slots[0]`), which
        also becomes the slot's first decode input on the device. -> sampled ids [R], their
        logprobs [R], and per row its top_n alternatives (fetched from the device only when some
        row asks for them)."""
        w = self._weights
        self._last, *samples = self._sample(
            x, w.final_norm, self._lm_head, self._mask, self._last, slots, np.ones(len(slots), bool), masked, params,
            positions, top_n, cfg=self.config,
        )
        return _fetch(tuple(samples), top_n)

    def _params(self, rows: slice) -> SlotSampling:
        """The rows' sampling parameters (a prompt's last position; a decode step packs its own)."""
        return SlotSampling(self._temperature[rows], self._top_k[rows], self._top_p[rows], self._min_p[rows], self._seed[rows])
