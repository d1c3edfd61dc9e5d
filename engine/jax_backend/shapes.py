"""The shapes a model compiles: its ladders of buckets, and how a prompt is cut into them.

`warm_up` compiles every shape serving can use, so serving compiles nothing: per prompt (chunk)
bucket a prefill layer, whatever the chunk's offset; per (row bucket, attend bucket) a decode
step; one head and sampling for a prompt's last position. Row buckets are powers of two up to B
(from the backend's `min_rows`: 1 on CPU, 16 on an accelerator), attend buckets powers of two
from `min_attend` (128) up to the context, prompt buckets from `min_bucket` (16, or less where
the scheduler's step budget is smaller: `smallest_chunk`). Why these shapes (measured on the
project's CPU machine; docs/benchmarks.md, "Design measurements"):
- Decode runs every layer in one jitted call: one dispatch a step, and the host free while the
  device runs. Unrolling all the layers of the default model compiles in about twice the time of
  the 5-layer groups used before (docs/benchmarks.md, 'Figures behind code comments'), and the persistent
  compilation cache pays that once per machine. Prefill, compute-bound, runs one layer per call.
- With the CPU kernel the decode shapes are the row buckets alone (the kernel reads the live
  length), far fewer compilations than rows x attend buckets without it.
- On a GPU the Pallas kernel (engine.jax_backend.ragged_attention) reads each row's live length
  in place as well: one attend shape there too (not under tensor parallelism).
- Without either kernel (a mesh, bfloat16 on CPU, or a CPU that cannot build it), attend buckets
  start at 128 because fewer, longer reads are cheap at decode: the K/V of 128 positions is small
  next to the weights a step reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.jax_backend import backend_profile
from engine.jax_backend.backend_profile import PACKED_TOKENS, BackendProfile

MIN_BUCKET = 16  # smallest prompt (chunk) bucket
MAX_CHUNK = 512  # largest prompt chunk one prefill call runs; longer prompts run as several chunks
MIN_ATTEND = 128  # smallest decode attend bucket


def smallest_chunk(step_tokens: int | None, profile: BackendProfile | None = None) -> int:
    """The smallest prompt bucket for a scheduler's per-step prompt budget (`--max-step-tokens`;
    None: the backend's, `profile.step_tokens` (default: this process's profile); 0: no budget): MIN_BUCKET, or for a budget below
    it the power of two that holds one budget's chunk, so small chunks are not padded up to
    MIN_BUCKET (each halving adds one chunk shape to warm-up)."""
    if step_tokens is None:
        step_tokens = (profile or backend_profile.profile()).step_tokens
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


def bucket(buckets: tuple[int, ...], length: int) -> int:
    """The smallest of `buckets` (ascending) that holds `length`."""
    return next(b for b in buckets if b >= length)


def prompt_pieces(start: int, end: int, buckets: tuple[int, ...], context: int) -> list[tuple[int, int, int]]:
    """Prompt positions [start, end) as calls of the compiled chunk sizes `buckets` (ascending):
    (lo, hi, size) with real tokens [lo, hi) and lo + size <= `context`. Each piece takes the
    largest bucket that it fills (no padding) and the last the smallest that holds the rest,
    unless the rest fits one bucket no larger than those pieces together: then it is that one
    call (10 tokens over buckets 8, 16: one call of 16 rather than two of 8, the same rows for
    half the calls, and faster; docs/benchmarks.md, 'Figures behind code comments'). A last piece whose
    bucket would run past the context starts earlier instead, recomputing (identically) a few
    positions already written, so that every call stays inside the cache."""
    pieces, lo = [], start
    while lo < end:
        rest = end - lo
        whole = bucket(buckets, rest) if rest <= buckets[-1] else None
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


@dataclass(frozen=True)
class ShapeKnobs:
    """Compile-time knobs (fewer shapes warm up faster); None: the served choice."""

    min_bucket: int | None = None  # smallest prompt bucket; None: smallest_chunk(the step budget)
    min_attend: int = MIN_ATTEND  # smallest attended length of a decode step (unused with a kernel)
    min_rows: int | None = None  # smallest row bucket of a decode step; None: the backend's
    min_packed: int | None = None  # smallest packed prefill size; None: the backend's


@dataclass(frozen=True)
class Shapes:
    """Every ladder a model compiles for, each ascending."""

    prompt: tuple[int, ...]  # prompt chunk lengths (the last is the largest chunk)
    attend: tuple[int, ...]  # attended lengths of a decode step
    rows: tuple[int, ...]  # row counts (the first R slots) of a decode step
    default_step_tokens: int  # the scheduler's default prompt budget per step
    fused_chunk_tokens: int  # the longest chunk a decode step takes along (0: none)
    fused: tuple[int, ...]  # the compiled sizes of a chunk along with a decode step
    packed_prefill_tokens: int  # most prompt tokens in one packed prefill (0: none)
    packed: tuple[int, ...]  # the sequence lengths a packed prefill is compiled for
    packed_rows: tuple[int, ...]  # the row counts a packed prefill's sampling is compiled for

    @staticmethod
    def plan(
        batch: int, context: int, max_chunk: int, step_tokens: int | None, knobs: ShapeKnobs, profile: BackendProfile,
        *, one_attend: bool, kernels: bool, mesh: bool,
    ) -> Shapes:
        """The ladders for B = `batch` slots and a context of `context`. `one_attend`: a kernel reads
        each row's live keys (the context is the one attend shape). `step_tokens`: the longest
        chunk a decode step takes along; None: with the CPU kernels (one device) the backend's
        budget, else 0. No packed prefill with one slot or under a mesh (its calls keep to the
        shapes the partitioner has seen)."""
        if max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1, got {max_chunk}")
        prompt = length_buckets(min(context, max_chunk), knobs.min_bucket or smallest_chunk(step_tokens, profile))
        default_step_tokens = min(profile.step_tokens, prompt[-1])
        if step_tokens is None:
            step_tokens = default_step_tokens if kernels else 0
        if step_tokens < 0:
            raise ValueError(f"fused_chunk_tokens must be >= 0, got {step_tokens}")
        # a chunk along with a decode step is padded to the smallest of these compiled sizes that
        # holds it: the chunk buckets up to the one of fused_chunk_tokens
        fused_chunk_tokens = 0 if batch == 1 else min(step_tokens, prompt[-1])
        top = bucket(prompt, fused_chunk_tokens) if fused_chunk_tokens else 0
        rows = length_buckets(batch, knobs.min_rows or profile.min_rows)
        packed = [t for t in prompt if t <= PACKED_TOKENS] or [prompt[0]]
        packed = [t for t in packed if t >= (knobs.min_packed or profile.min_packed)] or packed[-1:]
        packed_prefill_tokens = 0 if batch == 1 or mesh else packed[-1]
        return Shapes(
            prompt=prompt,
            attend=(context,) if one_attend else length_buckets(context, knobs.min_attend),
            rows=rows,
            default_step_tokens=default_step_tokens,
            fused_chunk_tokens=fused_chunk_tokens,
            fused=tuple(c for c in prompt if c <= top),
            packed_prefill_tokens=packed_prefill_tokens,
            packed=tuple(packed) if packed_prefill_tokens else (),
            packed_rows=tuple(r for r in rows if r >= 2) if packed_prefill_tokens else (),
        )
