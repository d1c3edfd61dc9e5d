"""The CPU attention kernels over paged KV against the contiguous-cache kernels they replaced (issue 41).

Why: paging must not cost the decode step its speed (the issue's target: >= 0.97x at the served
shapes, SmolLM2-135M's H = 9, K = 3, D = 64 at 1, 8 and 32 rows of 64-512 live keys). This builds
the kernels of `--baseline-rev` (a git revision of this repository whose kernels read the
contiguous [B, K, S, D] cache; default: the last one before paging) into a temporary directory,
registers its two attentions under names of their own beside this tree's kernels, and times them
on the same keys, values and queries: the contiguous cache [R, K, S, D], and the same positions in
pools [K, N, P, D] through tables whose pages are in order (a row's pages one after another, as a
prompt's are when it is admitted to a fresh pool), interleaved (row r's page i is page i * R + r:
the rows' decode steps took pages in turn) and shuffled (scattered over the pool, as after a while
of serving; for a chunk, one sequence, only in order and shuffled); and, for decode, the tables
engine.core.kv_pages's allocators really make under a simulated serving workload
(benchmarks/kv_pages_layout.py, `served_tables`): "served free list" (the free list it had
first, `FreeListPages`) and "served runs" (`KvPages`, which hands out runs of adjacent pages),
its ids packed so that pages adjacent in the pool stay adjacent and no others become so.
Each timed call is one jitted step over `layers` layers, each layer its own buffers (so the
keys come from memory, not a cache level, as in a real step), chained through the queries so
that XLA runs them one after another.
Rounds interleave the layouts (alternating their order); the figures are medians per layer and
the ratios contiguous / paged (above 1: paged faster). All buffers are made by XLA (a jitted
copy), as the model's pools are.

The host is shared and noisy: compare ratios of one run, not absolute times across runs.

    python -m benchmarks.paged_attention_kernel [--rounds 16] [--calls 2] [--threads N] [--page-size 16]
        [--layouts "paged served free list,paged served runs"]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kv_pages_layout
from engine.jax_backend import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
DECODE_SHAPES = [(rows, keys) for rows in (1, 8, 32) for keys in (64, 128, 256, 512)]
CHUNK_STARTS = (240, 1000, 1784)  # a 16-token chunk's start: its keys are start + 16
CHUNK = 16
LAYER_BYTES = 256 << 20  # the layers of a call hold at least this much KV (per layout), far past the L3
LAYOUTS = ("contiguous", "paged in order", "paged interleaved", "paged shuffled", "paged served free list",
           "paged served runs")
SERVED = {"paged served free list": "free list", "paged served runs": "runs"}  # -> kv_pages_layout.ALLOCATORS
OLD_DECODE, OLD_CHUNK = "tokenwire_decode_attention_contiguous", "tokenwire_chunk_attention_contiguous"
REPO = Path(__file__).resolve().parent.parent


def build_baseline(rev: str, directory: Path) -> ctypes.CDLL:
    """The kernels library of git revision `rev`, compiled with this tree's flags; its two
    attentions registered as OLD_DECODE and OLD_CHUNK."""
    sources = directory / "kernels"
    sources.mkdir()
    for name in cpu_kernels.SOURCES + cpu_kernels.HEADERS:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:engine/jax_backend/kernels/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (sources / name).write_text(text)
    library = directory / "baseline.so"
    command = [cpu_kernels._compiler(None), *cpu_kernels.FLAGS, f"-I{jax.ffi.include_dir()}",
               *(str(sources / s) for s in cpu_kernels.SOURCES), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    loaded = ctypes.CDLL(str(library))
    loaded.TokenwireSetThreads.argtypes = [ctypes.c_int]
    jax.ffi.register_ffi_target(OLD_DECODE, jax.ffi.pycapsule(loaded.TokenwireDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(OLD_CHUNK, jax.ffi.pycapsule(loaded.TokenwireChunkAttention), platform="cpu")
    return loaded


def paged(cache: np.ndarray, page_size: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The cache [R, K, S, D] as a pool [K, N, P, D] (page 0 the null page) and tables [R, W] in
    one of the module docstring's layouts (the same tables for every call of a layout, so that K,
    V and every layer share them)."""
    rows, kv, length, d = cache.shape
    width = -(-length // page_size)
    pages = np.arange(rows * width)
    if layout in SERVED:
        order = _served(SERVED[layout], rows, length, page_size)  # [R, W]
    else:
        order = {
            "paged in order": pages.reshape(rows, width),
            "paged interleaved": pages.reshape(width, rows).T,
            "paged shuffled": np.random.default_rng(1).permutation(pages).reshape(rows, width),
        }[layout]
    tables = (order + 1).astype(np.int32)
    pool = np.zeros((kv, int(tables.max()) + 1, page_size, d), np.float32)
    padded = np.zeros((rows, kv, width * page_size, d), np.float32)
    padded[:, :, :length] = cache
    pool[:, tables] = padded.reshape(rows, kv, width, page_size, d).transpose(1, 0, 2, 3, 4)
    return pool, tables


@functools.cache
def _served(allocator: str, rows: int, keys: int, page_size: int) -> np.ndarray:
    """The served layouts' tables ([R, W], 0-based), made once a shape for every layer."""
    if page_size != kv_pages_layout.PAGE_SIZE:
        raise ValueError(f"the served layouts are simulated with pages of {kv_pages_layout.PAGE_SIZE}")
    return kv_pages_layout.served_tables(kv_pages_layout.ALLOCATORS[allocator], rows, keys)


def decode_steps(layers: int, paged_layout: bool):
    """A jitted step of `layers` decode attentions, each layer's output nudging the next's queries."""

    def step(q, ks, vs, tables, positions):  # q [R, H, D]
        out = jnp.zeros((), jnp.float32)
        for k, v in zip(ks, vs):
            if paged_layout:
                o = cpu_kernels.decode_attention(q, k, v, tables, positions)  # [R, H * D]
            else:
                call = jax.ffi.ffi_call(OLD_DECODE, jax.ShapeDtypeStruct((q.shape[0], q.shape[1] * q.shape[2]), jnp.float32))
                o = call(q, k, v, positions)
            q = q + 1e-6 * o.reshape(q.shape)
            out = out + o[0, 0]
        return out

    return jax.jit(step)


def chunk_steps(layers: int, paged_layout: bool):
    """A jitted step of `layers` chunk attentions, chained like `decode_steps`."""

    def step(q, ks, vs, table, start):  # q [C, H, D]
        out = jnp.zeros((), jnp.float32)
        for k, v in zip(ks, vs):
            if paged_layout:
                o = cpu_kernels.chunk_attention(q, k, v, table, start)  # [C, H * D]
            else:
                call = jax.ffi.ffi_call(OLD_CHUNK, jax.ShapeDtypeStruct((q.shape[0], q.shape[1] * q.shape[2]), jnp.float32))
                o = call(q, k, v, jnp.int32(0), start)
            q = q + 1e-6 * o.reshape(q.shape)
            out = out + o[0, 0]
        return out

    return jax.jit(step)


def interleaved(calls: dict[str, callable], rounds: int, per_round: int) -> dict[str, float]:
    """Median seconds a call of each, over `rounds` rounds that alternate which goes first."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()  # compile, and a first touch of the buffers
    names = list(calls)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(per_round):
                began = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def layers_for(bytes_per_layer: int) -> int:
    return int(np.clip(-(-LAYER_BYTES // bytes_per_layer), 2, 30))


def _layouts(rng, shape: tuple[int, ...], layers: int, page_size: int, layouts) -> dict[str, tuple[list, list, jax.Array]]:
    """Per layout: each layer's K and V buffers, and the tables (None for the contiguous cache)."""
    own = jax.jit(lambda x: x + 0.0)  # a buffer XLA made, as the model's pools are
    caches = [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)) for _ in range(layers)]
    out = {"contiguous": ([own(k) for k, _ in caches], [own(v) for _, v in caches], None)}
    for name in layouts[1:]:
        ks, vs = [], []
        for k, v in caches:
            k_pool, tables = paged(k, page_size, name)
            ks.append(own(k_pool))
            vs.append(own(paged(v, page_size, name)[0]))
        out[name] = (ks, vs, jnp.asarray(tables))
    return out


def bench_decode(rng, rows: int, keys: int, page_size: int, rounds: int, per_round: int,
                 layouts: tuple[str, ...] = LAYOUTS) -> tuple[int, dict[str, float]]:
    layers = layers_for(2 * rows * KV_HEADS * keys * HEAD_DIM * 4)
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM), np.float32))
    positions = jnp.full((rows,), keys - 1, jnp.int32)
    data = _layouts(rng, (rows, KV_HEADS, keys, HEAD_DIM), layers, page_size, layouts)
    steps = {name: decode_steps(layers, name != "contiguous") for name in layouts}
    dummy = jnp.zeros((rows, 1), jnp.int32)
    calls = {
        name: (lambda name=name: jax.block_until_ready(
            steps[name](q, data[name][0], data[name][1], dummy if data[name][2] is None else data[name][2], positions)))
        for name in layouts
    }
    medians = interleaved(calls, rounds, per_round)
    return layers, {name: t / layers for name, t in medians.items()}


def bench_chunk(rng, start: int, page_size: int, rounds: int, per_round: int) -> tuple[int, dict[str, float]]:
    keys = start + CHUNK
    layers = layers_for(2 * KV_HEADS * keys * HEAD_DIM * 4)
    q = jnp.asarray(rng.standard_normal((CHUNK, HEADS, HEAD_DIM), np.float32))
    layouts = ("contiguous", "paged in order", "paged shuffled")
    data = _layouts(rng, (1, KV_HEADS, keys, HEAD_DIM), layers, page_size, layouts)
    steps = {name: chunk_steps(layers, name != "contiguous") for name in layouts}
    lo, dummy = jnp.int32(start), jnp.zeros((1,), jnp.int32)
    calls = {
        name: (lambda name=name: jax.block_until_ready(
            steps[name](q, data[name][0], data[name][1], dummy if data[name][2] is None else data[name][2][0], lo)))
        for name in layouts
    }
    medians = interleaved(calls, rounds, per_round)
    return layers, {name: t / layers for name, t in medians.items()}


def _row(label: str, keys: int, layers: int, t: dict[str, float]) -> str:
    """A table row: the contiguous kernel's time, then each paged layout's and its ratio."""
    base = t["contiguous"]
    paged_ = [name for name in LAYOUTS[1:] if name in t]
    cells = "".join(f" {t[name] * 1e6:>9.1f} {base / t[name]:>6.3f}" for name in paged_)
    return f"{label:>11} {keys:>5} {layers:>6} {base * 1e6:>9.1f}{cells}"


def _header(first: str, t: dict[str, float]) -> str:
    names = {"paged in order": "order", "paged interleaved": "inter", "paged shuffled": "shuffle",
             "paged served free list": "flist", "paged served runs": "runs"}
    cells = "".join(f" {names[name] + ' us':>9} {'c/' + names[name][:4]:>6}" for name in LAYOUTS[1:] if name in t)
    return f"{first:>11} {'keys':>5} {'layers':>6} {'contig us':>9}{cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paged_attention_kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="0357086", help="a revision with the contiguous kernels (default: main before issue 41)")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2, help="timed calls a layout a round")
    parser.add_argument("--threads", type=int, default=cpu_kernels.available_cpus())
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--isa", choices=("avx512", "avx2"), default="avx512", help="cap both builds at this ISA")
    parser.add_argument("--only", choices=("decode", "chunk"), help="one kernel only")
    parser.add_argument("--rows", default="1,8,32", help="the decode batches to time (comma-separated)")
    parser.add_argument("--keys", default="64,128,256,512", help="the decode keys to time (comma-separated)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS[1:]), help="the paged decode layouts to time (comma-separated)")
    args = parser.parse_args(argv)
    kernels = cpu_kernels.load()
    if kernels is None:
        print(f"no kernels: {cpu_kernels.status().state}")
        return 1
    with tempfile.TemporaryDirectory(prefix="paged-bench-") as tmp:
        old = build_baseline(args.baseline_rev, Path(tmp))
    wide = args.isa == "avx512"
    for library in (kernels.library, old):
        library.TokenwireSetThreads(args.threads)
        library.TokenwireDecodeAttentionIsa(int(wide))
        library.TokenwireChunkAttentionIsa(int(wide))
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, page size {args.page_size}, ISA cap {args.isa}, baseline {args.baseline_rev}; "
          f"medians of {args.rounds} interleaved rounds x {args.calls} calls, per layer")
    if args.only in (None, "decode"):
        batches, lengths = {int(r) for r in args.rows.split(",")}, {int(k) for k in args.keys.split(",")}
        layouts = ("contiguous", *(name for name in LAYOUTS[1:] if name in args.layouts.split(",")))
        shapes = [(rows, keys) for rows, keys in DECODE_SHAPES if rows in batches and keys in lengths]
        for i, (rows, keys) in enumerate(shapes):
            layers, t = bench_decode(rng, rows, keys, args.page_size, args.rounds, args.calls, layouts)
            print((_header("decode rows", t) + "\n" if i == 0 else "") + _row(str(rows), keys, layers, t), flush=True)
    if args.only in (None, "chunk"):
        for i, start in enumerate(CHUNK_STARTS):
            layers, t = bench_chunk(rng, start, args.page_size, args.rounds, args.calls)
            print((_header("chunk start", t) + "\n" if i == 0 else "") + _row(str(start), start + CHUNK, layers, t), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
