"""C++ kernels for the CPU decode step and prefill chunks, called from jitted code as XLA FFI custom calls.

Why: on XLA:CPU a decode step's attention copies each sliced cache window and then runs its
[G, D] x [D, A] products one small matmul at a time, where `decode_attention` here reads the live
keys in place; and the weight products of a few rows (decode steps, short prompt chunks), which
XLA:CPU streams from memory well below the bandwidth a step needs, run as `panel_matmul` here
over a copy of each projection packed in panels of 32 outputs (`pack_panels`; the copies are made
by engine.jax_backend.weights.with_panels), up to PANEL_ROWS rows.
`int8_matmul` is the product of `--weights int8` (engine.jax_backend.quantize: blocks of 8, 5 or 4 bits) for 1-64 rows.
`chunk_attention` is a prefill chunk's attention over its slot's cached keys: plain JAX runs it as
small blocked products far below the machine's GEMM speed, and near the end of a long prompt it is
a large part of a 16-token chunk, whose cost is what the streams decoding beside a chunked prefill
wait for (kernels/chunk_attention.cc).
It, the decode attention and both weight products split their work over the library's own thread pool (kernels/pool.h),
`set_threads` threads (JaxModel sets `available_cpus()`, or `--cpu-threads`). The figures
are in docs/benchmarks.md; the sources are in engine/jax_backend/kernels/, and each file's header
says what it computes and why.

Building. The library is built ahead of time: `python -m engine.jax_backend.cpu_kernels --build
[DIR]` compiles it (with g++, or `--cxx`, and XLA's FFI headers shipped in jaxlib) into DIR, by
default this package's kernels/ directory; the Dockerfile's build stage runs it, so the runtime
image carries the library and no compiler. Its file name is `library_name()`,
`tokenwire_kernels-<key>.so`, the key a hash of the sources, the flags and the jaxlib version, so
a library built for other sources or another jaxlib is never picked up.

Loading, and what is trusted. `status()` (and `load()`, its library) looks in this order:
1. the package's kernels/ directory (`BuildOptions.prebuilt_dir` in tests): trusted like the
   Python code beside it, if the file is owned by root or this user and writable by no one else;
2. `<cache>/kernels/<name>`, the developer's cache, only if its sha256 equals the one recorded in
   `<name>.sha256` beside it, the directory, the library and that record each this user's and
   writable by no one else (so a file another user wrote, or one merely given the right name, is
   never loaded); a file that fails this is logged at WARNING and built anew;
3. otherwise, with a C++ compiler, it builds the library now into a temporary file in that
   directory (created 0700; if it cannot be made, or is not this user's alone, in a private
   temporary directory, for this process only), hashes it, renames it into place and writes its
   sha256 record. The sources are compiled side by side, one compiler process each, then linked;
   the build holds a lock on the directory, so processes that start together on a fresh host
   build it once (the others wait, then load it as in 2).
What is hashed is what is loaded: a file is opened once, checked (fstat, sha256) through that
descriptor, and dlopened as /proc/self/fd/N, never again by name, so it cannot be swapped
between the check and the load (the descriptor stays open, so N names one library for good).
Nothing in a cache is trusted for its name alone, and a read-only cache is never written when
a prebuilt library is there (the image's case).

The first library loaded registers its handlers with XLA for the CPU platform, once per process
(every library of one name is the same code). The engine asks for `status()` when it builds a
model on the CPU backend; `state` says `on: ...`, `off: ...` (they would apply here but cannot be
loaded: logged at WARNING, with the reason) or `not applicable: ...` (GPU, not x86-64, a CPU
without AVX2, FMA and F16C: logged at INFO). Off or not applicable, the engine runs plain JAX. Nothing
here runs on the GPU path.

Shapes: R rows in a step, H query heads, K kv heads, D head dim, N pages in a pool (the null page 0
included), P positions a page, W pages a block table (engine.core.kv_pages; the layout is paged KV's,
issue 41).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from engine.jax_backend.backend_profile import profile
from engine.model_store.registry import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = ("decode_attention.cc", "chunk_attention.cc", "int8_matmul.cc", "panel_matmul.cc")
HEADERS = ("pool.h", "vec.h", "chunk_attention_unit.h", "decode_attention_unit.h", "int8_vnni.h",
           "int8_avx2.h")  # included by the sources; hashed into the library name with them
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread")
ATTENTION_TARGET = "tokenwire_decode_attention"
CHUNK_TARGET = "tokenwire_chunk_attention"
# The same two with a sliding window (an attribute): separate targets, so that a model without a
# window compiles to exactly the calls it did before windows existed.
WINDOW_ATTENTION_TARGET = "tokenwire_decode_attention_window"
WINDOW_CHUNK_TARGET = "tokenwire_chunk_attention_window"
# And with Gemma 2's soft-cap on the scores (attributes window, 0 for none, and softcap): again
# separate, so that an uncapped model's calls stay as they were.
CAPPED_ATTENTION_TARGET = "tokenwire_decode_attention_capped"
CAPPED_CHUNK_TARGET = "tokenwire_chunk_attention_capped"
# And with gpt-oss's attention sinks (an operand [H]; attributes window and softcap, 0 for none).
SINKS_ATTENTION_TARGET = "tokenwire_decode_attention_sinks"
SINKS_CHUNK_TARGET = "tokenwire_chunk_attention_sinks"
INT8_TARGET = "tokenwire_int8_matmul"
INT8_OFFSET_TARGET = "tokenwire_int8_matmul_offset"
INT4_TARGET = "tokenwire_int4_matmul"
INT5_TARGET = "tokenwire_int5_matmul"  # 5-bit blocks, signed (Q5_0), no offsets
INT5_OFFSET_TARGET = "tokenwire_int5_matmul_offset"  # 5-bit blocks, unsigned (Q5_1), with offsets
PANEL_TARGET = "tokenwire_panel_matmul"
EXPERT_PANEL_TARGET = "tokenwire_expert_panel_matmul"  # the same product, each row by its own expert's panels
PANEL = 32  # outputs per panel of a packed weight (panel_matmul)
# Most rows a product goes to panel_matmul with; XLA's GEMM above: up to here the kernel took less
# time than XLA, its lead shrinking as rows grow until both reach the machine's arithmetic speed
# (docs/benchmarks.md, 'Figures behind code comments').
PANEL_ROWS = 64
INT8_BLOCK = 32  # int8 weights: one float16 scale per 32 consecutive inputs of an output (Q8_0's blocks)
INT8_PANEL = 16  # int8 weights: outputs per panel (kernels/int8_matmul.cc; engine.jax_backend.quantize.Int8Matrix)
_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ON, OFF, NOT_APPLICABLE = "on", "off", "not applicable"  # what a state string starts with


@dataclass(frozen=True)
class BuildOptions:
    """Where the kernels are looked for and built; from the configuration built in `main`."""

    cache_dir: Path | None = None  # a library built here goes to <cache_dir>/kernels; None: the default cache
    compiler: str | None = None  # a C++ compiler command (CXX); None: g++, then clang++, on PATH
    prebuilt_dir: Path | None = None  # where a prebuilt library is looked for; None: this package's kernels/


@dataclass(frozen=True)
class Kernels:
    """A loaded library (kept alive for the process, with the descriptor it was loaded through)."""

    path: Path  # where it was found or built (a temporary file, gone once loaded, for a private build)
    library: ctypes.CDLL
    origin: str  # "prebuilt", "cached", "built" (into the cache) or "built for this process only"
    sha256: str
    fd: int


@dataclass(frozen=True)
class KernelStatus:
    """What `status()` found: the library, and the state for operators."""

    kernels: Kernels | None
    state: str  # "on: <origin> <path>", "off: <reason>" or "not applicable: <reason>"


class Untrusted(Exception):
    """A library (or its sha256 record) that is not loaded; the message says why."""


def decode_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, positions: jax.Array,
    window: int | None = None, softcap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of one query per row over its sequence's paged keys at positions
    0..positions[r]: q [R, H, D] f32, k_pages / v_pages [K, N, P, D] f32 (the layer's pools),
    tables [R, W] i32 (row r's position p is in page tables[r, p // P] at offset p % P), positions
    [R] i32 -> [R, H * D] f32. Equal (to float rounding) to the attention over the pages gathered
    into a window. Reads only the pages a row's positions need, in place; a position past the
    table is clamped into it (padding rows), and a table entry read that is not a page of the
    pools fails the call with InvalidArgument (kernels/decode_attention.cc says why). With a
    `window` (static, >= 1), only positions positions[r] - window + 1 .. positions[r] are seen
    (transformer.in_window), and the pages wholly before them are not read. With a `softcap`
    (static, > 0; Gemma 2) each scaled score s is softcap * tanh(s / softcap). With `sinks` [H]
    (gpt-oss) each head's sink logit joins its softmax's denominator, with no value. Needs `load()`
    to have succeeded."""
    r, h, d = q.shape
    operands = (q, k_pages, v_pages, jnp.asarray(tables, jnp.int32), jnp.asarray(positions, jnp.int32))
    out = jax.ShapeDtypeStruct((r, h * d), jnp.float32)
    if sinks is not None:
        return jax.ffi.ffi_call(SINKS_ATTENTION_TARGET, out)(*operands, sinks.astype(jnp.float32), **_sink_attrs(window, softcap))
    if softcap is not None:
        return jax.ffi.ffi_call(CAPPED_ATTENTION_TARGET, out)(*operands, **_capped(window, softcap))
    if window is None:
        return jax.ffi.ffi_call(ATTENTION_TARGET, out)(*operands)
    return jax.ffi.ffi_call(WINDOW_ATTENTION_TARGET, out)(*operands, window=_window(window))


def chunk_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array, start: jax.Array,
    window: int | None = None, softcap: float | None = None, sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention of one sequence's prefill chunk over its paged keys: q [C, H, D] f32
    (the queries at positions start..start+C-1), k_pages / v_pages [K, N, P, D] f32 (the chunk's
    own keys already written), table [W] i32 (position p: page table[p // P], offset p % P) and
    start [] i32 -> [C, H * D] f32; query i sees positions 0..start+i. Equal (to float rounding)
    to transformer.chunk_attention over the pages gathered into a window; reads only positions
    [0, start + C), in place, each key block loaded once for the G x 8 (AVX2) or G x 16 (AVX-512)
    queries of a kv head and tile of chunk positions (kernels/chunk_attention.cc says why, and
    what happens to a position past the table or a table entry outside the pools). D must be a
    multiple of 8 (`chunk_attention_applies`). With a `window` (static, >= 1), query i sees only
    positions start + i - window + 1 .. start + i (transformer.in_window), and the key blocks
    wholly before the first query's window are not read. `softcap` and `sinks` as in
    `decode_attention`. Needs `load()` to have succeeded."""
    c, h, d = q.shape
    if not chunk_attention_applies(d):  # checked while tracing
        raise ValueError(f"chunk_attention takes a head dim that is a multiple of 8, got {d}")
    operands = (q, k_pages, v_pages, jnp.asarray(table, jnp.int32), jnp.asarray(start, jnp.int32))
    out = jax.ShapeDtypeStruct((c, h * d), jnp.float32)
    if sinks is not None:
        return jax.ffi.ffi_call(SINKS_CHUNK_TARGET, out)(*operands, sinks.astype(jnp.float32), **_sink_attrs(window, softcap))
    if softcap is not None:
        return jax.ffi.ffi_call(CAPPED_CHUNK_TARGET, out)(*operands, **_capped(window, softcap))
    if window is None:
        return jax.ffi.ffi_call(CHUNK_TARGET, out)(*operands)
    return jax.ffi.ffi_call(WINDOW_CHUNK_TARGET, out)(*operands, window=_window(window))


def _window(window: int) -> np.int64:
    """A sliding window as the kernels' attribute (checked while tracing)."""
    if window < 1:
        raise ValueError(f"a sliding window must be >= 1 position, got {window}")
    return np.int64(window)


def _capped(window: int | None, softcap: float) -> dict[str, np.generic]:
    """The capped targets' attributes: the window (0: none) and the cap (checked while tracing)."""
    if not softcap > 0:
        raise ValueError(f"a soft-cap must be > 0, got {softcap}")
    return {"window": np.int64(0) if window is None else _window(window), "softcap": np.float32(softcap)}


def _sink_attrs(window: int | None, softcap: float | None) -> dict[str, np.generic]:
    """The sinks targets' attributes: the window and the cap, 0 for none (checked while tracing)."""
    return {
        "window": np.int64(0) if window is None else _window(window),
        "softcap": np.float32(0.0) if softcap is None else _capped(None, softcap)["softcap"],
    }


def chunk_attention_applies(head_dim: int) -> bool:
    """Whether `chunk_attention` takes this head dim (its value micro-kernels take 4 or 8 columns at a time)."""
    return head_dim % 8 == 0


def int8_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, n: int, offset: jax.Array | None = None,
                high: jax.Array | None = None) -> jax.Array:
    """x [..., K] f32 @ W.T, W [N, K] given as integer blocks in panels of INT8_PANEL outputs
    (engine.jax_backend.quantize.Int8Matrix): packed [ceil(N / 16), K / 2, 16, 2] int8 (8 bits)
    or [ceil(N / 16), K / 4, 16, 2] uint8 (4 or 5 bits, two inputs' low nibbles a byte), high
    [ceil(N / 16), K / 4, 2] uint32 (5 bits: the fifth bits; None for 4 or 8), scale
    [ceil(N / 16), K / INT8_BLOCK, 16] f16 and optionally offset (a value added to every weight of
    a block) in scale's shape and dtype -> [..., N] f32; needs `load()` to have succeeded. 4-bit
    blocks need the offset; 5-bit ones are signed (-16..15) without it, unsigned (0..31) with it.
    The weights are read once per call however many rows x has (kernels/int8_matmul.cc)."""
    nibbles = packed.dtype == jnp.uint8
    panels, groups, width, two = packed.shape
    k = groups * (4 if nibbles else 2)
    if x.shape[-1] != k or k % INT8_BLOCK or width != INT8_PANEL or two != 2 or panels != -(-n // INT8_PANEL):  # checked while tracing
        raise ValueError(f"int8_matmul takes rows of {k} values (a multiple of {INT8_BLOCK}) and {n} outputs, got x {x.shape}, packed {packed.shape}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"int8_matmul takes an offset of scale's shape {scale.shape}, got {offset.shape}")
    if high is not None and (not nibbles or high.shape != (panels, groups, 2) or high.dtype != jnp.uint32):
        raise ValueError(f"int8_matmul takes fifth bits uint32 [{panels}, {groups}, 2] beside nibbles, got {high.dtype} {high.shape}")
    if nibbles and high is None and offset is None:
        raise ValueError("int8_matmul takes 4-bit blocks with an offset")
    rows = x.size // k
    if high is not None:
        target = INT5_TARGET if offset is None else INT5_OFFSET_TARGET
    else:
        target = INT4_TARGET if nibbles else INT8_TARGET if offset is None else INT8_OFFSET_TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    operands = (x.reshape(rows, k).astype(jnp.float32), packed) + (() if high is None else (high,)) + (scale,)
    operands += () if offset is None else (offset.astype(scale.dtype),)
    return call(*operands).reshape(*x.shape[:-1], n)


@jax.jit
def pack_panels(w: jax.Array) -> jax.Array:
    """A weight [K, N] ([in, out]) as `panel_matmul` reads it: [ceil(N / PANEL), K, PANEL],
    panel j holding outputs PANEL * j .. PANEL * j + PANEL - 1 (zeros past N). Jitted: at load,
    one program per weight shape that pads and moves the weight in one pass (op by op, each
    of the three was a program and a pass of its own)."""
    k, n = w.shape
    panels = -(-n // PANEL)
    padded = jnp.pad(w, ((0, 0), (0, panels * PANEL - n)))
    return padded.reshape(k, panels, PANEL).transpose(1, 0, 2)


def panel_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., K] f32 @ W [K, N], W given as `pack_panels(W)` -> [..., N] f32. Each output is
    summed over K in order, so a row's result does not depend on the call's other rows; the
    weights are read once per call for up to 12 rows (kernels/panel_matmul.cc); needs `load()`."""
    count, k, width = panels.shape
    if x.shape[-1] != k or width != PANEL or not (count - 1) * PANEL < n <= count * PANEL:  # checked while tracing
        raise ValueError(f"panel_matmul takes rows of {k} values and {n} outputs, got x {x.shape}, panels {panels.shape}")
    rows = x.size // k
    call = jax.ffi.ffi_call(PANEL_TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    return call(x.reshape(rows, k).astype(jnp.float32), panels).reshape(*x.shape[:-1], n)


def expert_panel_matmul(x: jax.Array, panels: jax.Array, sizes: jax.Array, n: int) -> jax.Array:
    """Rows x [R, K] f32 sorted by expert (sizes [X] i32 rows each, summing to R) times each one's
    own expert's W [K, N], the experts given as `pack_panels` of each, stacked: panels [X,
    ceil(N / 32), K, 32] -> [R, N] f32 (engine.jax_backend.moe's grouped product on the CPU).
    Reads only the experts with rows, in place (kernels/panel_matmul.cc); needs `load()`."""
    experts, count, k, width = panels.shape
    if x.ndim != 2 or x.shape[-1] != k or width != PANEL or not (count - 1) * PANEL < n <= count * PANEL:  # checked while tracing
        raise ValueError(f"expert_panel_matmul takes rows of {k} values and {n} outputs, got x {x.shape}, panels {panels.shape}")
    call = jax.ffi.ffi_call(EXPERT_PANEL_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x.astype(jnp.float32), panels, jnp.asarray(sizes, jnp.int32))


def panel_matmul_isa(kernels: Kernels, avx512: bool = True) -> str:
    """Let `panel_matmul` use AVX-512 where the CPU has it (the default), or cap it at AVX2;
    -> the instruction set it now uses (process-wide; tests run both)."""
    return "avx512" if kernels.library.TokenwirePanelMatmulIsa(int(avx512)) else "avx2"


def int8_matmul_isa(kernels: Kernels, vnni: bool = True) -> str:
    """Let `int8_matmul` use AVX-512 VNNI where the CPU has it (the default), or keep it on the
    AVX2 path; both quantize the activations to int16 blocks and give the same bits; -> the path
    it now uses (process-wide; tests run both)."""
    return "avx512vnni" if kernels.library.TokenwireInt8MatmulIsa(int(vnni)) else "avx2"


def set_threads(kernels: Kernels, threads: int) -> None:
    """How many threads each weight product (panel_matmul, int8_matmul) and each attention (decode, chunk) runs on,
    the caller included; process-wide (the library's one pool, kernels/pool.h)."""
    kernels.library.TokenwireSetThreads(max(1, threads))


def chunk_attention_isa(kernels: Kernels, avx512: bool = True) -> str:
    """Let `chunk_attention` use AVX-512 where the CPU has it (the default), or cap it at AVX2;
    -> the instruction set it now uses, "avx512" or "avx2" (process-wide; tests run both)."""
    return "avx512" if kernels.library.TokenwireChunkAttentionIsa(int(avx512)) else "avx2"


def decode_attention_isa(kernels: Kernels, avx512: bool = True) -> str:
    """Let `decode_attention` use AVX-512 where the CPU has it (the default), or cap it at AVX2;
    -> the instruction set it now uses, "avx512" or "avx2" (process-wide; tests run both)."""
    return "avx512" if kernels.library.TokenwireDecodeAttentionIsa(int(avx512)) else "avx2"


def threads(kernels: Kernels) -> int:
    """The threads each kernel call may use, as `set_threads` left them."""
    return int(kernels.library.TokenwireThreads())


def last_threads(kernels: Kernels) -> int:
    """How many threads took part in the pool's last job: a weight product or an attention (for tests)."""
    return int(kernels.library.TokenwireLastThreads())


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (/sys/fs/cgroup/cpu.max, rounded up) when there is one. The default kernel thread count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def load(build: BuildOptions = BuildOptions()) -> Kernels | None:
    """The registered kernels, or None (the reason logged once, and in `status(build).state`)."""
    return status(build).kernels


@functools.cache
def status(build: BuildOptions = BuildOptions()) -> KernelStatus:
    """Find (or build) and register the kernels, once per `build`; logs the outcome once."""
    reason = _not_applicable()
    if reason:
        log.info("CPU decode kernels not applicable: %s; using plain JAX", reason)
        return KernelStatus(None, f"{NOT_APPLICABLE}: {reason}")
    kernels, problem = _find_or_build(build)
    if kernels is None:
        log.warning("CPU decode kernels off: %s; using plain JAX (slower decode steps)", problem)
        return KernelStatus(None, f"{OFF}: {problem}")
    log.info("CPU decode kernels on: %s %s (sha256 %s)", kernels.origin, kernels.path, kernels.sha256[:16])
    return KernelStatus(kernels, f"{ON}: {kernels.origin} {kernels.path}")


def library_name() -> str:
    """The library's file name for these sources, flags and jaxlib."""
    digest = hashlib.sha256()
    parts = [jaxlib.__version__.encode(), *(f.encode() for f in FLAGS), *((_KERNEL_DIR / s).read_bytes() for s in SOURCES + HEADERS)]
    for part in parts:
        digest.update(len(part).to_bytes(8, "little") + part)
    return f"tokenwire_kernels-{digest.hexdigest()[:16]}.so"


def build_library(directory: Path, compiler: str | None = None) -> Path:
    """Compile the library into `directory` (created if missing) as `library_name()`, readable by
    all and writable by its owner only; -> its path. Raises OSError or CalledProcessError."""
    found = _compiler(compiler)
    if found is None:
        raise OSError(f"no C++ compiler ({compiler or 'g++ or clang++'} not found)")
    directory.mkdir(parents=True, exist_ok=True)
    staged = _compile(found, directory)
    try:
        target = directory / library_name()
        os.replace(staged, target)
    finally:
        if staged.exists():
            staged.unlink()
    return target


def _find_or_build(build: BuildOptions) -> tuple[Kernels | None, str]:
    """The kernels from the first place (module docstring) that has them, or None and why not."""
    name = library_name()
    prebuilt = (build.prebuilt_dir or _KERNEL_DIR) / name
    if prebuilt.exists():
        try:
            return _load_fd(_open_trusted(prebuilt, owners={0, os.geteuid()}), prebuilt, "prebuilt"), ""
        except (OSError, AttributeError, Untrusted) as e:
            log.warning("not loading the prebuilt CPU kernels %s: %s", prebuilt, _first_line(e))
    cache = (build.cache_dir or default_cache_dir()) / "kernels"
    if (found := _cached(cache, name, warn=True)) is not None:
        return found, ""
    compiler = _compiler(build.compiler)
    if compiler is None:
        return None, (
            f"no prebuilt library ({name} in {prebuilt.parent}) and no C++ compiler to build one "
            "(install g++ or set CXX; an image builds it with `python -m engine.jax_backend.cpu_kernels --build`)"
        )
    with _building(cache):
        if (found := _cached(cache, name, warn=False)) is not None:  # built by another process meanwhile
            return found, ""
        try:
            return _build_and_load(compiler, cache, name), ""
        except (OSError, subprocess.CalledProcessError, AttributeError, Untrusted) as e:
            if isinstance(e, subprocess.CalledProcessError):  # the state keeps one line; the log keeps it all
                log.warning("building the CPU kernels failed: %s exited with %d; its output:\n%s",
                            compiler, e.returncode, _output(e))
            return None, f"no prebuilt library, and building one failed: {_first_line(e)}"


def _cached(cache: Path, name: str, warn: bool) -> Kernels | None:
    """The library in the cache, if it is there and its record vouches for it; else None."""
    if not (cache / name).exists():
        return None
    try:
        return _load_fd(_open_cached(cache, name), cache / name, "cached")
    except (OSError, AttributeError, Untrusted) as e:
        if warn:
            log.warning("not loading the cached CPU kernels %s: %s; building them anew", cache / name, _first_line(e))
        return None


@contextlib.contextmanager
def _building(cache: Path) -> Iterator[None]:
    """An exclusive lock on the cache's kernels directory while the library is built there, so
    that processes starting at once on a fresh host (replicas, a test run's workers) compile it
    once: the others wait, then load what the first built. Where the directory cannot be made, is
    not this user's alone, or cannot be opened, no lock: each builds its own, as before (and the
    build says why it does not cache)."""
    fd = None
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        _require_private(cache)  # else someone else could hold the lock
        fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # (flock on the directory: no file left)
    except (OSError, Untrusted):
        pass
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _open_trusted(path: Path, owners: set[int]) -> int:
    """A descriptor on `path` if it is a regular file owned by one of `owners` and writable by no
    one else; Untrusted otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    problem = (
        "not a regular file" if not stat.S_ISREG(st.st_mode)
        else f"owned by uid {st.st_uid}, not {' or '.join(map(str, sorted(owners)))}" if st.st_uid not in owners
        else f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o022
        else None
    )
    if problem:
        os.close(fd)
        raise Untrusted(problem)
    return fd


def _open_cached(cache: Path, name: str) -> int:
    """A descriptor on `cache/name` if its content has the sha256 recorded in `cache/name.sha256`,
    both owned by this user and writable by no one else, in a directory of this user's that no
    one else can write; Untrusted otherwise."""
    me = {os.geteuid()}
    _require_private(cache)  # else another user could have put (hard links to) files of ours there
    try:
        record = _open_trusted(cache / f"{name}.sha256", me)
    except FileNotFoundError:
        raise Untrusted("no sha256 record beside it") from None
    except Untrusted as e:
        raise Untrusted(f"its sha256 record is {e}") from None
    with os.fdopen(record, "rb") as f:
        expected = f.read(200).decode(errors="replace").strip()
    fd = _open_trusted(cache / name, me)
    digest = _sha256(fd)
    if digest != expected:
        os.close(fd)
        raise Untrusted(f"its sha256 {digest[:16]}... is not the recorded {expected[:16]}...")
    return fd


def _build_and_load(compiler: str, cache: Path, name: str) -> Kernels:
    """Compile into a temporary file in `cache` (or, when that directory cannot be made or is not
    this user's alone, in a private temporary directory), hash it, publish it with its sha256
    record when in the cache, and load what was hashed."""
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        _require_private(cache)
        work, private = cache, None
    except (OSError, Untrusted) as e:
        log.info("CPU kernels: not caching them in %s (%s); building them for this process only", cache, _first_line(e))
        private = Path(tempfile.mkdtemp(prefix="tokenwire-kernels-"))  # 0700, this user's
        work = private
    try:
        staged = _compile(compiler, work)
        try:
            fd = os.open(staged, os.O_RDONLY | os.O_CLOEXEC)
            digest = _sha256(fd)
            if private is not None:
                return _load_fd(fd, staged, "built for this process only", digest)
            os.replace(staged, cache / name)
            _write_replacing(cache / f"{name}.sha256", digest + "\n")
            log.info("built the CPU decode kernels into %s", cache / name)
            return _load_fd(fd, cache / name, "built", digest)
        finally:
            if staged.exists():
                staged.unlink()
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _require_private(directory: Path) -> None:
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Untrusted(f"{directory} is not a directory of uid {os.geteuid()} that no one else can write")


def _compile(compiler: str, directory: Path) -> Path:
    """Compile the sources into a new temporary file in `directory`, mode 0644; -> its path.
    Each source is compiled on its own, all at once on the CPUs this process may use, then linked:
    the objects and the library are the ones one `compiler ... *.cc` gives, in a fraction of its
    time (it compiles them one after the other; about 30 s on a 2-core machine). The file is
    removed if the compile fails."""
    fd, staged = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=directory)
    os.close(fd)
    objects = None
    try:
        objects = Path(tempfile.mkdtemp(prefix=".objects-", dir=directory))
        compile_flags = [f for f in FLAGS if f != "-shared"]
        commands = [[compiler, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(_KERNEL_DIR / s),
                     "-o", str(objects / f"{Path(s).stem}.o")] for s in SOURCES]
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(commands), len(os.sched_getaffinity(0)))) as pool:
            for done in pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands):
                done.check_returncode()  # the first failing source's, with its compiler output
        link = [compiler, *FLAGS, *(str(objects / f"{Path(s).stem}.o") for s in SOURCES), "-o", staged]
        subprocess.run(link, check=True, capture_output=True, text=True)
        os.chmod(staged, 0o644)
    except BaseException:
        os.unlink(staged)
        raise
    finally:
        if objects is not None:
            shutil.rmtree(objects, ignore_errors=True)
    return Path(staged)


_REGISTERED: list[ctypes.CDLL] = []  # the library whose handlers XLA calls (one per process)
_LOCK = threading.Lock()


def _load_fd(fd: int, path: Path, origin: str, digest: str | None = None) -> Kernels:
    """dlopen the file behind `fd` (checked by the caller) and register its handlers if no library
    has been yet. The descriptor stays open: glibc knows a library by the name it was opened
    with, so /proc/self/fd/N must not come to mean another file."""
    try:
        digest = digest or _sha256(fd)
        library = ctypes.CDLL(f"/proc/self/fd/{fd}")
        handlers = {
            ATTENTION_TARGET: library.TokenwireDecodeAttention, CHUNK_TARGET: library.TokenwireChunkAttention,
            WINDOW_ATTENTION_TARGET: library.TokenwireDecodeAttentionWindow,
            WINDOW_CHUNK_TARGET: library.TokenwireChunkAttentionWindow,
            CAPPED_ATTENTION_TARGET: library.TokenwireDecodeAttentionCapped,
            CAPPED_CHUNK_TARGET: library.TokenwireChunkAttentionCapped,
            SINKS_ATTENTION_TARGET: library.TokenwireDecodeAttentionSinks,
            SINKS_CHUNK_TARGET: library.TokenwireChunkAttentionSinks,
            INT8_TARGET: library.TokenwireInt8Matmul, INT8_OFFSET_TARGET: library.TokenwireInt8MatmulOffset,
            INT4_TARGET: library.TokenwireInt4Matmul, INT5_TARGET: library.TokenwireInt5Matmul,
            INT5_OFFSET_TARGET: library.TokenwireInt5MatmulOffset,
            PANEL_TARGET: library.TokenwirePanelMatmul, EXPERT_PANEL_TARGET: library.TokenwireExpertPanelMatmul,
        }
        library.TokenwireSetThreads.argtypes = [ctypes.c_int]
        library.TokenwireChunkAttentionIsa.argtypes = [ctypes.c_int]
        library.TokenwireDecodeAttentionIsa.argtypes = [ctypes.c_int]
        library.TokenwirePanelMatmulIsa.argtypes = [ctypes.c_int]
        library.TokenwireInt8MatmulIsa.argtypes = [ctypes.c_int]
    except BaseException:
        os.close(fd)
        raise
    with _LOCK:
        if not _REGISTERED:
            for target, handler in handlers.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
            _REGISTERED.append(library)
    return Kernels(path, library, origin, digest, fd)


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while block := os.read(fd, 1 << 20):
        h.update(block)
    return h.hexdigest()


def _write_replacing(path: Path, text: str) -> None:
    fd, staged = tempfile.mkstemp(prefix=".writing-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(staged, 0o644)
        os.replace(staged, path)
    except BaseException:
        os.unlink(staged)
        raise


def _not_applicable() -> str | None:
    backend = profile()
    if not backend.cpu:
        return f"the backend is {backend.name}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if not {"avx2", "fma", "f16c"} <= _cpu_flags():
        return "the CPU lacks AVX2, FMA or F16C"
    return None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler(requested: str | None) -> str | None:
    return shutil.which(requested or "") or shutil.which("g++") or shutil.which("clang++")


def _output(e: subprocess.CalledProcessError) -> str:
    """Everything a failed compile printed, stderr then stdout."""
    return "\n".join(part.rstrip("\n") for part in (e.stderr, e.stdout) if part) or "(nothing)"


def _first_line(e: BaseException) -> str:
    detail = getattr(e, "stderr", None) or str(e)
    lines = [line for line in str(detail).splitlines() if "error" in line] or str(detail).splitlines() or [""]
    return lines[0][:300]


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.jax_backend.cpu_kernels --build [DIR] [--cxx CXX]`: build the library into
    DIR (default: this package's kernels/, where `load()` looks first). Exit 0 with the path
    printed, or with "not applicable" on a machine that is not x86-64; 1 when the build fails."""
    parser = argparse.ArgumentParser(prog="python -m engine.jax_backend.cpu_kernels", description=main.__doc__)
    parser.add_argument("--build", nargs="?", const=_KERNEL_DIR, type=Path, metavar="DIR", required=True,
                        help=f"where to put {library_name()} (default: {_KERNEL_DIR})")
    parser.add_argument("--cxx", help="the C++ compiler (default: g++, then clang++, on PATH)")
    args = parser.parse_args(argv)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(f"CPU decode kernels not applicable: {platform.machine()} is not x86-64; nothing built")
        return 0
    try:
        path = build_library(args.build, args.cxx)
        library = ctypes.CDLL(str(path))  # the library just built here: check that it loads, with its symbols
        symbols = (
            "TokenwireDecodeAttention", "TokenwireDecodeAttentionWindow", "TokenwireChunkAttention",
            "TokenwireChunkAttentionWindow", "TokenwireDecodeAttentionCapped", "TokenwireChunkAttentionCapped",
            "TokenwireDecodeAttentionSinks", "TokenwireChunkAttentionSinks",
            "TokenwireChunkAttentionIsa",
            "TokenwireInt8Matmul", "TokenwireInt8MatmulOffset", "TokenwireInt4Matmul", "TokenwireInt8MatmulIsa", "TokenwirePanelMatmul", "TokenwirePanelMatmulIsa",
            "TokenwireExpertPanelMatmul", "TokenwireSetThreads", "TokenwireThreads",
        )
        for symbol in symbols:
            getattr(library, symbol)
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        detail = _output(e) if isinstance(e, subprocess.CalledProcessError) else str(e)
        print(f"building the CPU decode kernels failed: {detail}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
