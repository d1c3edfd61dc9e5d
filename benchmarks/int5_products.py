"""The batch-1 weight products of every layer of Gemma 3 270M, its Q5_0 blocks held in 5 bits (as
served) against the same blocks widened to int8 (as served before), interleaved in one process.

    python benchmarks/int5_products.py [--rounds 10] [--calls 50] [--rows 1]

Loads the pulled gemma-3-270m with `--weights int8` (engine.jax_backend.weights.load_int8), then
builds a second set of layers in which every 5-bit matrix is packed again in 8 bits (its rows:
the same integers, scales and offsets). One jitted function runs every layer's q/k/v, o, gate/up
and down products on one fixed row (the 18 layers' bytes, more than the caches hold, as a decode
step reads them); rounds alternate which set goes first. Prints per set the median wall and
process CPU (user + sys, every thread) milliseconds and minor page faults per call and the bytes
its matrices hold,
and the ratio of medians. The products of the two sets are checked equal, bit for bit.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=50, help="calls per set and round")
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from engine.jax_backend import cpu_kernels, quantize
    from engine.jax_backend.weights import load_int8
    from engine.model_store.registry import pull

    cpu_kernels.load()
    cpu_kernels.set_threads(cpu_kernels.status().kernels, cpu_kernels.available_cpus())
    layers = load_int8(pull("gemma-3-270m")).weights.layers
    fields = ("w_qkv", "w_o", "w_gate_up", "w_down")
    five = [tuple(getattr(layer, f) for f in fields) for layer in layers]

    def widened(m: quantize.Int8Matrix) -> quantize.Int8Matrix:
        if m.bits != 5:
            return m
        q, scale = (np.asarray(a) for a in m.rows())
        offset = None if m.offset is None else np.asarray(m.offsets())
        return quantize.pack(q, scale, offset, 8)

    eight = [tuple(widened(m) for m in layer) for layer in five]
    rng = np.random.default_rng(0)
    xs = {k: jnp.asarray(rng.standard_normal((args.rows, k)).astype(np.float32))
          for k in {m.shape[0] for layer in five for m in layer}}  # one row per input width

    @jax.jit
    def products(matrices):  # every layer's four products of a fixed row -> their outputs
        return [quantize.matmul(xs[m.shape[0]], m) for layer in matrices for m in layer]

    a, b = (jax.block_until_ready(products(s)) for s in (five, eight))
    assert all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(a, b)), "5-bit and int8 products differ"
    counts = {bits: sum(m.bits == bits for layer in five for m in layer) for bits in (4, 5, 8)}
    print(f"{len(five)} layers; matrices by bits as served: {counts}", flush=True)
    sets = {"5-bit": five, "int8-widened": eight}
    wall = {name: [] for name in sets}
    cpu = {name: [] for name in sets}
    faults = {name: [] for name in sets}
    for r in range(args.rounds):
        for name in (list(sets) if r % 2 == 0 else list(reversed(sets))):
            w0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(args.calls):
                jax.block_until_ready(products(sets[name]))
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.calls)
            wall[name].append((time.perf_counter() - w0) / args.calls * 1e3)
            cpu[name].append((time.process_time() - c0) / args.calls * 1e3)
    for name, s in sets.items():
        nbytes = sum(m.nbytes for layer in s for m in layer)
        print(f"{name:13s} {nbytes / 2**20:6.1f} MiB  wall {statistics.median(wall[name]):.3f} ms "
              f"({min(wall[name]):.3f}-{max(wall[name]):.3f})  cpu {statistics.median(cpu[name]):.3f} ms  "
              f"page faults {statistics.median(faults[name]):.0f} a call", flush=True)
    ratios = [e / f for e, f in zip(wall["int8-widened"], wall["5-bit"])]
    print(f"int8-widened / 5-bit wall per round: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
          f"cpu medians {statistics.median(cpu['int8-widened']) / statistics.median(cpu['5-bit']):.3f}", flush=True)


if __name__ == "__main__":
    main()
