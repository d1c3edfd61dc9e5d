"""C++ kernels for the CPU decode step, called from jitted code as XLA FFI custom calls.

Why: on XLA:CPU a decode step's attention copies each sliced cache window and then runs its
[G, D] x [D, A] products one small matmul at a time, where `decode_attention` here reads the live
keys in place; and a one-row step's weight products, which XLA:CPU runs as one or two uneven
tasks, stream faster as `gemv` here, one contiguous row of an [out, in] copy of each projection
per output. The copies are made by engine.jax_backend.weights.with_one_row_copies. The figures
are in docs/benchmarks.md; the sources are in engine/jax_backend/kernels/, and each file's header
says what it computes and why.

Data flow: `load()` compiles the sources once per (source, compiler flags, jaxlib) into
`<cache>/kernels/<hash>.so` with the C++ compiler `BuildOptions` names and XLA's FFI headers (shipped in
jaxlib), loads it and registers its handlers with XLA for the CPU platform; the result is
memoised for the process. The engine calls `load()` when it builds a model on the CPU backend
and falls back to plain JAX when it returns None (no compiler, a CPU without AVX2 and FMA, a
failed build), logging why once. Nothing here runs on the GPU path.

Shapes: R rows in a step, H query heads, K kv heads, D head dim, B cache slots, S cache positions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from engine.model_store.registry import default_cache_dir

log = logging.getLogger(__name__)

SOURCES = ("decode_attention.cc", "gemv.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
ATTENTION_TARGET = "tokenwire_decode_attention"
GEMV_TARGET = "tokenwire_gemv"
_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"


@dataclass(frozen=True)
class BuildOptions:
    """Where and with what the kernels are built; from the configuration built in `main`."""

    cache_dir: Path | None = None  # the library goes to <cache_dir>/kernels; None: the default cache
    compiler: str | None = None  # a C++ compiler command (CXX); None: g++, then clang++, on PATH


@dataclass(frozen=True)
class Kernels:
    """A loaded, registered kernel library (kept alive for the process)."""

    path: Path
    library: ctypes.CDLL


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """Causal GQA attention of one query per row over its slot's cached keys at positions
    0..positions[r]: q [R, H, D] f32, caches [B, K, S, D] f32 (row r is slot r), positions [R] i32
    -> [R, H * D] f32. Equal (to float rounding) to transformer.decode_attention over the same
    window; needs `load()` to have succeeded."""
    r, h, d = q.shape
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct((r, h * d), jnp.float32))
    return call(q, k_cache, v_cache, positions.astype(jnp.int32))


def gemv(x: jax.Array, wt: jax.Array) -> jax.Array:
    """x @ wt.T for one row: x [..., K] f32 holding a single row (every leading dim 1), wt [N, K]
    f32 (a projection stored [out, in]) -> [..., N] f32. Equal to float rounding; needs `load()`."""
    n, k = wt.shape
    if x.size != k:  # checked while tracing, so it costs nothing per step
        raise ValueError(f"gemv takes one row of {k} values, got shape {x.shape}")
    call = jax.ffi.ffi_call(GEMV_TARGET, jax.ShapeDtypeStruct((1, n), jnp.float32))
    return call(x.reshape(1, k), wt).reshape(*x.shape[:-1], n)


@functools.cache
def load(build: BuildOptions = BuildOptions()) -> Kernels | None:
    """Build (once per `build`) and register the kernels; None, with the reason logged, when they
    cannot be used here."""
    reason = _unsupported(build.compiler)
    if reason:
        log.info("CPU decode kernels off: %s; using plain JAX", reason)
        return None
    try:
        path = _build(build)
        library = ctypes.cdll.LoadLibrary(str(path))
        handlers = {ATTENTION_TARGET: library.TokenwireDecodeAttention, GEMV_TARGET: library.TokenwireGemv}
        for target, handler in handlers.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        log.warning("CPU decode kernels off: %s; using plain JAX", _first_line(e))
        return None
    log.info("CPU decode kernels on (%s)", path)
    return Kernels(path, library)


def _unsupported(compiler: str | None) -> str | None:
    if jax.default_backend() != "cpu":
        return f"backend is {jax.default_backend()}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "the CPU lacks AVX2 or FMA"
    if _compiler(compiler) is None:
        return "no C++ compiler (set CXX, or install g++)"
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


def _build(build: BuildOptions) -> Path:
    """Compile into `<cache>/kernels/<hash>.so` unless it is there; a temporary file is renamed
    into place, so concurrent builders never load a half-written library."""
    compiler = _compiler(build.compiler)
    if compiler is None:  # _unsupported said so first; kept as an error for direct callers
        raise OSError("no C++ compiler (set CXX, or install g++)")
    include = jax.ffi.include_dir()
    sources = [_KERNEL_DIR / name for name in SOURCES]
    digest = hashlib.sha256()
    for part in (compiler, jaxlib.__version__, *FLAGS, *(s.read_text() for s in sources)):
        digest.update(part.encode())
    target = (build.cache_dir or default_cache_dir()) / "kernels" / f"{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, f"-I{include}", *map(str, sources), "-o", staged]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(staged, target)
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
    log.info("built the CPU decode kernels into %s", target)
    return target


def _first_line(e: BaseException) -> str:
    detail = getattr(e, "stderr", None) or str(e)
    lines = [line for line in str(detail).splitlines() if "error" in line] or str(detail).splitlines() or [""]
    return lines[0][:300]
