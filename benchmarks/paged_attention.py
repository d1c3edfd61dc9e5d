"""The paged decode-attention kernel against the contiguous one it replaced (issue 41's GPU
target: the paged step's attention at most 1.1x the contiguous kernel's time), one layer's
decode attention at the Llama-3.1-8B shape by default.

    python benchmarks/paged_attention.py [--batch 64] [--context 4096] [--page 16]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--dtype bfloat16]
        [--rounds 5] [--steps 20] [--jax-kernel] [--json PATH]
    python benchmarks/paged_attention.py --smoke   # a tiny shape on the CPU, Pallas interpret mode

A script of its own, not a phase of scripts/gpu_check: the check's phases measure whole models
against a plan and a report; this is one kernel against another, and needs only JAX and numpy
(the GPU machine's preinstalled JAX runs it as is). Its run time on a GPU is not measured yet
(none was lent while it was written); a few compiles and 2 x 5 x 20 calls per kernel.
`--jax-kernel` also times `jax.experimental.pallas.ops.gpu.paged_attention` (q pre-scaled, as it
applies no 1/sqrt(D)); its difference from the contiguous kernel is reported, not checked.

Both kernels read the same keys and values: random pages in a pool of B x context / P + 1 pages
(page 0 the null page), handed to the rows in a shuffled order as a pool is after many
admissions and frees, and the contiguous cache [B, K, S, D] gathered from them. Two cases: every
row at the full context ("full"), and lengths spread evenly from 1 to the context ("ragged").
Each round times every case and kernel in turn (`--steps` back-to-back calls, waited for once),
so that each ratio is taken within a round; the figures are medians over the rounds. "GB/s" is
the live K and V bytes read per call over its time (the kernel's floor is that read).

Each case also checks that the two kernels agree (bfloat16: 8e-3 absolute + relative, what
tests/test_ragged_attention.py allows against float32; float32: 1e-5), so a fast wrong kernel
does not pass. Exit status: 0 when they agree (a missed speed target is reported, not failed);
1 when they do not; 2 without a GPU unless --smoke.

The contiguous kernel (`contiguous_attention`) is a copy of engine.jax_backend.ragged_attention
as it was before pages (commit 0357086), kept here for this comparison only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from engine.jax_backend import ragged_attention  # noqa: E402

TARGET = 1.1  # the issue's bound on paged / contiguous time
AGREE = {"bfloat16": 8e-3, "float32": 1e-5}  # absolute and relative, see the module docstring


@dataclass(frozen=True)
class Config:
    batch: int = 64
    context: int = 4096
    page: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    rounds: int = 5
    steps: int = 20


SMOKE = Config(batch=3, context=64, page=16, heads=6, kv_heads=2, head_dim=16, dtype="float32", rounds=1, steps=1)


# -- the contiguous kernel, as it was ----------------------------------------------------------

MIN_GROUP, BLOCK_K, TARGET_PROGRAMS, MAX_SPLITS = 16, 64, 256, 16  # its constants then


def _contiguous_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k: int, scale: float, precision):
    """One (row, kv head, split) over the row's own slot: k_ref/v_ref [S / splits, D] in place."""
    span = k_ref.shape[0]
    live = jnp.clip(lengths_ref[()] - pl.program_id(2) * span, 0, span)
    q = q_ref[...]  # [Gp, D]

    def body(i, carry):
        o, m, l = carry
        at = pl.multiple_of(i * block_k, block_k)
        seen = at + jnp.arange(block_k) < live  # [Bk]
        s = _dot(q, k_ref[pl.ds(at, block_k), :], 1, precision) * scale  # [Gp, Bk]
        s = jnp.where(seen[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        v = jnp.where(seen[:, None], v_ref[pl.ds(at, block_k), :], 0)  # [Bk, D]
        return o * corr[:, None] + _dot(p.astype(v.dtype), v, 0, precision), m_new, l * corr + p.sum(axis=1)

    gp, d = q.shape
    init = (jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    o_ref[...], m_ref[...], l_ref[...] = jax.lax.fori_loop(0, pl.cdiv(live, block_k), body, init)


def _dot(a, b, b_contracting: int, precision):
    dims = (((1,), (b_contracting,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _contiguous_splits(rows: int, kv_heads: int, blocks: int) -> int:
    splits = 1
    while rows * kv_heads * splits < TARGET_PROGRAMS and splits < MAX_SPLITS and blocks % (2 * splits) == 0:
        splits *= 2
    return splits


def _contiguous_combine(o, m, l):
    """Partials o [splits, R, K, Gp, D], m and l [splits, R, K, Gp] -> [R, K, Gp, D] float32."""
    top = jax.lax.optimization_barrier(m.max(axis=0))  # [R, K, Gp]
    w = jnp.exp(m - top[None])  # [splits, R, K, Gp]
    denom = (l * w).sum(axis=0)
    return (o * w[..., None]).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]


def _triton_params():
    from jax.experimental.pallas import triton as plgpu  # GPU-only, imported when lowering for a GPU

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


@functools.partial(jax.jit, static_argnames="interpret")
def contiguous_attention(q, k_cache, v_cache, lengths, interpret: bool):
    """q [R, H, D] over caches [R, K, S, D], lengths [R] -> [R, H * D] (S a multiple of 64)."""
    r, h, d = q.shape
    _, kv, s, _ = k_cache.shape
    g = h // kv
    gp = max(MIN_GROUP, pl.next_power_of_2(g))
    splits = _contiguous_splits(r, kv, s // BLOCK_K)
    span = s // splits
    qg = jnp.pad(q.reshape(r, kv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))  # [R, K, Gp, D]
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_contiguous_kernel, block_k=BLOCK_K, scale=1.0 / math.sqrt(d), precision=precision)
    partial = lambda *tail: jax.ShapeDtypeStruct((splits, r, kv, *tail), jnp.float32)  # noqa: E731
    o, m, l = pl.pallas_call(
        kernel,
        grid=(r, kv, splits),
        in_specs=[
            pl.BlockSpec((None,), lambda i, k, j: (i,)),
            pl.BlockSpec((None, None, gp, d), lambda i, k, j: (i, k, 0, 0)),
            pl.BlockSpec((None, None, span, d), lambda i, k, j: (i, k, j, 0)),
            pl.BlockSpec((None, None, span, d), lambda i, k, j: (i, k, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, k, j: (j, i, k, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, k, j: (j, i, k, 0)),
        ],
        out_shape=[partial(gp, d), partial(gp), partial(gp)],
        compiler_params=None if interpret else _triton_params(),
        interpret=interpret,
        name="contiguous_decode_attention",
    )(lengths, qg, k_cache, v_cache)
    return _contiguous_combine(o, m, l)[:, :, :g].reshape(r, h * d).astype(q.dtype)


# -- the measurement ---------------------------------------------------------------------------


def inputs(cfg: Config, seed: int = 0) -> dict:
    """The query, the pool (page 0 null, the rest shuffled over the rows' tables), the same KV
    as contiguous caches, and each case's lengths."""
    width = cfg.context // cfg.page
    pages = 1 + cfg.batch * width
    tables = np.random.default_rng(seed).permutation(np.arange(1, pages, dtype=np.int32)).reshape(cfg.batch, width)
    # One compiled program; "rbg" random bits compile in a fifth of threefry's time on a CPU.
    data = _random_kv(jnp.asarray(tables), jax.random.key(seed, impl="rbg"), cfg, pages)
    cases = {
        "full": np.full(cfg.batch, cfg.context, np.int32),
        "ragged": np.linspace(1, cfg.context, cfg.batch).astype(np.int32),
    }
    return {**data, "tables": jnp.asarray(tables), "cases": {name: jnp.asarray(n) for name, n in cases.items()}}


@functools.partial(jax.jit, static_argnames=("cfg", "pages"))
def _random_kv(tables: jax.Array, key: jax.Array, cfg: Config, pages: int) -> dict:
    """tables [B, W] -> q [B, H, D], k/v pages [K, N, P, D] and k/v caches [B, K, S, D] holding
    the same values, in the config's dtype."""
    dtype = jnp.dtype(cfg.dtype)
    keys = jax.random.split(key, 3)
    pool = (cfg.kv_heads, pages, cfg.page, cfg.head_dim)
    k_pages, v_pages = (jax.random.normal(k, pool, jnp.float32).astype(dtype) for k in keys[1:])
    return {
        "q": jax.random.normal(keys[0], (cfg.batch, cfg.heads, cfg.head_dim), jnp.float32).astype(dtype),
        "k_pages": k_pages, "v_pages": v_pages,
        "k_cache": ragged_attention.gather_pages(k_pages, tables),  # [B, K, S, D]
        "v_cache": ragged_attention.gather_pages(v_pages, tables),
    }


def kernels(data: dict, interpret: bool, jax_kernel: bool) -> dict:
    """name -> (lengths -> the layer's attention output [B, H * D]), each kernel over the same KV;
    with `jax_kernel`, JAX's own paged kernel too, as it would be called for us (q scaled by
    1/sqrt(D) first, since it applies no scale; splits that divide the table, at most its 16)."""
    paged = jax.jit(ragged_attention.decode_attention, static_argnames="interpret")
    q, tables = data["q"], data["tables"]
    fns = {
        "paged": lambda lengths: paged(q, data["k_pages"], data["v_pages"], tables, lengths, interpret=interpret),
        "contiguous": lambda lengths: contiguous_attention(q, data["k_cache"], data["v_cache"], lengths,
                                                           interpret=interpret),
    }
    if jax_kernel:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

        b, h, d = q.shape
        splits = math.gcd(16, tables.shape[1])
        scaled = (q.astype(jnp.float32) / math.sqrt(d)).astype(q.dtype)  # [B, H, D]
        fns["jax paged_attention"] = lambda lengths: jax_paged.paged_attention(
            scaled, data["k_pages"], data["v_pages"], tables, lengths, k_splits=splits, interpret=interpret,
        ).reshape(b, h * d)
    return fns


def _time(fn, lengths, steps: int) -> float:
    """Seconds per call: `steps` calls dispatched back to back, waited for once."""
    start = time.perf_counter()
    for _ in range(steps):
        out = fn(lengths)
    out.block_until_ready()
    return (time.perf_counter() - start) / steps


def run(cfg: Config, interpret: bool, jax_kernel: bool = False) -> dict:
    """Every kernel on every case: first once, to compile and to compare with the contiguous
    kernel, then `cfg.rounds` interleaved rounds of timing. -> the result (JSON-serialisable)."""
    data = inputs(cfg)
    fns = kernels(data, interpret, jax_kernel)
    tol = AGREE[cfg.dtype]
    result = {"config": asdict(cfg), "device": str(jax.devices()[0].device_kind), "interpret": interpret, "cases": {}}
    for name, lengths in data["cases"].items():
        outs = {k: np.asarray(fn(lengths), np.float32) for k, fn in fns.items()}
        result["cases"][name] = {k: {
            "max_abs_diff": float(np.abs(out - outs["contiguous"]).max()),
            "agree": bool(np.allclose(out, outs["contiguous"], atol=tol, rtol=tol)), "s": [], "ratio": [],
        } for k, out in outs.items()}
    for _ in range(cfg.rounds):
        for name, lengths in data["cases"].items():
            times = {k: _time(fn, lengths, cfg.steps) for k, fn in fns.items()}
            for k, t in times.items():
                result["cases"][name][k]["s"].append(t)
                result["cases"][name][k]["ratio"].append(t / times["contiguous"])
    itemsize = jnp.dtype(cfg.dtype).itemsize
    for name, lengths in data["cases"].items():
        live_bytes = int(np.asarray(lengths).sum()) * cfg.kv_heads * cfg.head_dim * itemsize * 2  # K and V
        for row in result["cases"][name].values():
            row["median_s"] = statistics.median(row["s"])
            row["gb_per_s"] = live_bytes / row["median_s"] / 1e9
            row["median_ratio"] = statistics.median(row["ratio"])
        paged = result["cases"][name]["paged"]
        paged["target_met"] = paged["median_ratio"] <= TARGET
    result["ok"] = all(case["paged"]["agree"] for case in result["cases"].values())
    return result


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Paged vs contiguous decode attention on {result['device']}{' (interpret mode)' if result['interpret'] else ''}: "
        f"B={cfg['batch']}, context {cfg['context']}, page {cfg['page']}, H={cfg['heads']}, K={cfg['kv_heads']}, "
        f"D={cfg['head_dim']}, {cfg['dtype']}; medians of {cfg['rounds']} rounds x {cfg['steps']} calls",
        "",
        "| lengths | kernel | ms | / contiguous (paged: target <= 1.1) | GB/s of live KV | vs contiguous: max diff |",
        "|---|---|---|---|---|---|",
    ]
    for name, case in result["cases"].items():
        for kernel, row in case.items():
            verdict = ""
            if "target_met" in row:
                verdict = " met" if row["target_met"] else f" missed by {row['median_ratio'] / TARGET - 1:.1%}"
            agree = "" if kernel == "contiguous" else f"{row['max_abs_diff']:.1e}{'' if row['agree'] else ' (too far)'}"
            lines.append(f"| {name} | {kernel} | {row['median_s'] * 1e3:.3f} | {row['median_ratio']:.3f}{verdict} "
                         f"| {row['gb_per_s']:.3g} | {agree} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny float32 shape in Pallas interpret mode (any machine)")
    for field, value in asdict(Config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    parser.add_argument("--jax-kernel", action="store_true",
                        help="also time jax.experimental.pallas.ops.gpu.paged_attention (its difference is reported, not checked)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    base = SMOKE if args.smoke else Config()
    cfg = Config(**{f: getattr(args, f) if getattr(args, f) is not None else v for f, v in asdict(base).items()})
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print("paged_attention: needs a GPU (JAX sees only the CPU); --smoke runs a tiny shape in interpret mode",
              file=sys.stderr)
        return 2
    if cfg.dtype not in AGREE or cfg.context % cfg.page or cfg.context % BLOCK_K:
        parser.error(f"--dtype is bfloat16 or float32, and --context a multiple of --page and of {BLOCK_K}")
    result = run(cfg, interpret=not on_gpu, jax_kernel=args.jax_kernel)
    print(markdown(result), end="")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
