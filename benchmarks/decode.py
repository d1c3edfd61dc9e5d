"""Decode speed of a model on this machine, in one run: tokens/s at several batch sizes,
model-bandwidth utilisation (MBU) at batch 1, and warm-up (compile) time.

    python benchmarks/decode.py [--model smollm2-135m-instruct] [--batches 1,8,32] [--steps 32]

MBU = (weight bytes + live KV bytes read per step) / step time / memory read bandwidth, the
bandwidth measured in the same run (a jitted sum over a 1 GiB float32 array). Weight bytes are
what a step reads: the layers, the final norm and the head (the embedding only gives R rows).
Decode is memory-bound at small batch, so MBU is how close a step is to the machine's ceiling.
The machine is shared and noisy: compare ratios from one run, not figures across runs; the load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from engine.jax_model import JaxModel  # noqa: E402
from engine.model import DecodeInput, SlotSetup  # noqa: E402
from engine.model_registry import resolve_model  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of memory read bandwidth: a jitted sum over a float32 array that does not fit in cache."""
    x = jnp.ones(int(gib * (1 << 30)) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(repeats))
    del x
    return gib * (1 << 30) / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model: JaxModel) -> int:
    """Bytes of weights a decode step reads: everything but the embedding table."""
    w = model._weights
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves((w.layers, w.final_norm, w.lm_head)))


def kv_bytes_per_token(model: JaxModel) -> int:
    """Bytes of K and V one position holds across all layers."""
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * jnp.dtype(model.cache.k[0].dtype).itemsize


def step_seconds(model: JaxModel, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """Median decode step time with `batch` active slots; returns (seconds, mean live length)."""
    setup = SlotSetup(SamplingParams(seed=0), frozenset())
    rng = np.random.default_rng(0)
    last = {}
    for slot in range(batch):
        prompt = rng.integers(3, model.info.vocab_size, prompt_len).tolist()
        last[slot] = model.prefill(slot, prompt, setup, False).token_id
    times = []
    for step in range(steps):
        inputs = [DecodeInput(slot, last[slot], prompt_len + step, False) for slot in range(batch)]
        start = time.perf_counter()
        samples = model.decode(inputs)
        times.append(time.perf_counter() - start)
        last = {i.slot: s.token_id for i, s in zip(inputs, samples)}
    for slot in range(batch):
        model.release(slot)
    return statistics.median(times[2:]), prompt_len + steps / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-context-length", type=int, default=512)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--min-bucket", type=int, default=None, help="smallest prompt bucket (JaxModel.load)")
    parser.add_argument("--min-attend", type=int, default=None, help="smallest decode attend bucket")
    parser.add_argument("--layers-per-call", type=int, default=None, help="layers one jitted decode call runs")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}; backend {jax.default_backend()}")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    bandwidth = read_bandwidth_gbs()
    print(f"memory read bandwidth (jitted sum, 1 GiB f32): {bandwidth:.1f} GB/s")
    knobs = {k: v for k, v in vars(args).items() if k in ("min_bucket", "min_attend", "layers_per_call") and v}
    model = JaxModel.load(
        model_dir, max_batch_size=max(batches), max_context_length=args.max_context_length, dtype=args.dtype, **knobs
    )
    compile_s = _timed(model.warm_up)
    print(
        f"model {model.info.model_id}: {weight_bytes(model) / 1e6:.0f} MB of weights read per step, "
        f"max_batch_size {model.info.max_batch_size}, context {model.info.max_context_length}; "
        f"buckets: rows {model.row_buckets}, attend {model.attend_buckets}, prompt {model.buckets}; "
        f"warm-up (compiles {model.compilations()} shapes): {compile_s:.1f} s"
    )
    compiled = model.compilations()
    rates = {}
    for batch in batches:
        seconds, live = step_seconds(model, batch, args.prompt_len, args.steps)
        rates[batch] = batch / seconds
        step_bytes = weight_bytes(model) + batch * live * kv_bytes_per_token(model)
        mbu = step_bytes / seconds / (bandwidth * 1e9)
        print(
            f"batch {batch:3d}: step {seconds * 1e3:7.2f} ms, {rates[batch]:7.1f} tok/s, "
            f"{step_bytes / 1e6:.0f} MB read per step, MBU {mbu:.2f}"
        )
    if 1 in rates:
        for batch in batches[1:]:
            print(f"throughput batch {batch} / batch 1: {rates[batch] / rates[1]:.1f}x")
    print(f"compilations after warm-up: {model.compilations() - compiled}")
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
