"""Decode speed of a model on this machine, in one run: tokens/s at several batch sizes,
model-bandwidth utilisation (MBU) at batch 1, and warm-up (compile) time.

    python benchmarks/decode.py [--model smollm2-135m-instruct] [--batches 1,8,32] [--rounds 5]
                                [--tensor-parallel 1,2,4]

With `--tensor-parallel N[,N...]` the same table is printed for the model split over each N
devices (engine.jax_backend.mesh; one model at a time). On a CPU host the N devices are forced CPU
devices sharing one memory and the same cores: the table shows that it works, not that it is
faster. MBU at N > 1 divides by N x the one-device bandwidth (right for GPUs, each with its own
memory; it understates the use of forced CPU devices).

MBU = (weight bytes + live KV bytes read per step) / step time / memory read bandwidth, the
bandwidth measured in the same run (a jitted sum over a 1 GiB float32 array, best of 3; XLA runs
it on every core). Weight bytes are what a step reads: the layers, the final norm and the head
(the embedding only gives R rows). Decode is memory-bound at small batch, so MBU is how close a
step is to the machine's ceiling.

The machine is shared and noisy (the bandwidth a neighbour leaves us moves by 1.5x within a
minute), so the run is interleaved: each round measures the bandwidth, then `--steps` decode steps
at every batch size, and each ratio (MBU, batch N / batch 1) is taken within one round. The
figures printed are medians over the rounds, with the range. Slots are prefilled once; every
step extends each of its slots by one position, and the KV bytes counted are the live ones.

Each batch size is timed two ways in every round: "read each step" dispatches a step and waits
for its samples before the next (the step's own time), and "host one step behind" dispatches
step N+1 before reading step N, as the engine does (engine.core.engine), timed over `--steps`
steps; their ratio is what the lag gains (host work the device no longer waits for).
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
from benchmarks.summary import median_range  # noqa: E402
from engine.jax_backend import mesh  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.core.kv_pages import KvPages  # noqa: E402
from engine.core.model import DecodeInput, SlotSetup  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402


class Bandwidth:
    """Best-of memory read bandwidth: a jitted sum over a float32 array that does not fit in cache."""

    def __init__(self, gib: float = 1.0) -> None:
        self.bytes = int(gib * (1 << 30))
        self._x = jnp.ones(self.bytes // 4, jnp.float32)
        self._total = jax.jit(jnp.sum)
        self._total(self._x).block_until_ready()

    def measure_gbs(self, repeats: int = 3) -> float:
        best = min(_timed(lambda: self._total(self._x).block_until_ready()) for _ in range(repeats))
        return self.bytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model: JaxModel) -> int:
    """Bytes of weights a decode step reads: everything but the embedding table."""
    w = model._weights
    return sum({id(x): x.nbytes for x in jax.tree_util.tree_leaves((w.layers, w.final_norm, w.lm_head))}.values())


def _rss_mb() -> float:
    """The process's resident memory now (Linux /proc), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e3
    return float("nan")


def kv_bytes_per_token(model: JaxModel) -> int:
    """Bytes of K and V one position holds across all layers."""
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * jnp.dtype(model.cache.k[0].dtype).itemsize


class Slots:
    """Slots 0..n-1 prefilled with random prompts; `step(batch)` decodes slots 0..batch-1 once.

    Each slot's KV pages come from the scheduler's allocator (engine.core.kv_pages), taken as the
    engine takes them: the prompt's at admission, one more as a step reaches a new page, so the
    attention reads the tables serving makes. (A model from before paged KV has no `kv`.)"""

    def __init__(self, model: JaxModel, n: int, prompt_len: int) -> None:
        setup = SlotSetup(SamplingParams(seed=0), frozenset())
        rng = np.random.default_rng(0)
        self.model = model
        kv = getattr(model, "kv", None)
        self.pages = KvPages(kv.num_pages, kv.page_size) if kv is not None else None
        self.last, self.length = {}, {}
        for slot in range(n):
            prompt = rng.integers(3, model.info.vocab_size, prompt_len).tolist()
            if self.pages is not None:
                self.pages.admit(slot, prompt)
                model.set_pages(slot, self.pages.pages(slot))
            self.last[slot] = model.prefill(slot, prompt, setup, False).token_id
            self.length[slot] = prompt_len

    def _inputs(self, batch: int) -> list[DecodeInput]:
        inputs = [DecodeInput(slot, None, self.length[slot], False) for slot in range(batch)]  # None: the last sample, on the device
        for slot in range(batch):
            self.length[slot] += 1
            if self.pages is not None and self.length[slot] % self.pages.page_size == 1:  # the step writes a new page
                if not self.pages.grow(slot, self.length[slot]):
                    raise RuntimeError("the benchmark's slots outgrew the KV pool")
                self.model.set_pages(slot, self.pages.pages(slot))
        return inputs

    def step(self, batch: int) -> float:
        """One decode step of the first `batch` slots, read before returning; -> its seconds."""
        inputs = self._inputs(batch)
        start = time.perf_counter()
        self.model.decode(inputs)
        return time.perf_counter() - start

    def pipelined(self, batch: int, steps: int) -> float:
        """`steps` decode steps of the first `batch` slots, each dispatched before the previous
        one is read; -> seconds per step."""
        start = time.perf_counter()
        self.model.dispatch(self._inputs(batch))
        for _ in range(steps - 1):
            self.model.dispatch(self._inputs(batch))
            self.model.collect()
        self.model.collect()
        return (time.perf_counter() - start) / steps

    def mean_length(self, batch: int) -> float:
        return sum(self.length[s] for s in range(batch)) / batch

    def release(self) -> None:
        for slot in self.last:
            self.model.release(slot)
            if self.pages is not None:
                self.pages.free(slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (1 first for MBU and ratios)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (bandwidth, then every batch size)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size and round")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-context-length", type=int, default=512)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--min-bucket", type=int, default=None, help="smallest prompt bucket (JaxModel.load)")
    parser.add_argument("--min-attend", type=int, default=None, help="smallest decode attend bucket (no kernels)")
    parser.add_argument("--no-kernels", action="store_true", help="plain JAX: no CPU kernels (attention, one-row products)")
    parser.add_argument("--tensor-parallel", default="1", help="comma-separated mesh sizes: one table per size")
    parser.add_argument("--weights", default="float32", choices=["float32", "int8", "fp8"],
                        help="int8: the CPU kernels' blocks (per-channel int8 with --no-kernels); fp8: e4m3 per channel")
    parser.add_argument("--cpu-threads", type=int, default=None, help="threads per CPU kernel call, weight product or attention (default: the CPUs available)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(n) for n in args.tensor_parallel.split(",")]
    mesh.request_cpu_devices(max(sizes))  # before JAX starts (a CPU host: forced devices; else a no-op)
    # Slot 0 takes every step: one untimed step per batch size, then 2 x `steps` per batch size and round.
    needed = args.prompt_len + len(batches) * (1 + 2 * args.rounds * args.steps)
    if needed >= args.max_context_length:
        parser.error(f"--max-context-length must exceed {needed} for these rounds and steps")

    model_dir = resolve_model(args.model, log=lambda line: print(line, file=sys.stderr))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}; backend {jax.default_backend()}")
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    bandwidth = Bandwidth()
    for size in sizes:
        table(args, model_dir, batches, bandwidth, size)
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


def table(args: argparse.Namespace, model_dir: Path, batches: list[int], bandwidth: Bandwidth, size: int) -> None:
    """Load the model over `size` devices, warm it up, and print its table."""
    knobs = {k: v for k, v in vars(args).items() if k in ("min_bucket", "min_attend") and v}
    model = JaxModel.load(
        model_dir, max_batch_size=max(batches), max_context_length=args.max_context_length, dtype=args.dtype,
        kernels=not args.no_kernels, tensor_parallel=size, weights=args.weights, cpu_threads=args.cpu_threads, **knobs,
    )
    compile_s = _timed(model.warm_up)
    print(f"-- tensor parallel {size}: {size} {jax.default_backend()} device(s)")
    print(
        f"model {model.info.model_id}: {weight_bytes(model) / 1e6:.0f} MB of weights read per step, "
        f"max_batch_size {model.info.max_batch_size}, context {model.info.max_context_length}, "
        f"weights {args.weights}, CPU kernels {'on' if model.kernels else 'off'} ({model.cpu_threads} threads), "
        f"process RSS {_rss_mb():.0f} MB; buckets: rows {model.row_buckets}, "
        f"attend {model.attend_buckets}, prompt {model.buckets}; "
        f"warm-up (compiles {model.compilations()} shapes): {compile_s:.1f} s"
    )
    compiled = model.compilations()
    slots = Slots(model, max(batches), args.prompt_len)
    for batch in batches:  # one untimed step each: first calls pay for buffer set-up
        slots.step(batch)
    seconds: dict[int, list[float]] = {b: [] for b in batches}
    behind: dict[int, list[float]] = {b: [] for b in batches}
    mbu, gbs = [], []
    for _ in range(args.rounds):
        gbs.append(bandwidth.measure_gbs())
        for batch in batches:
            seconds[batch].append(statistics.median(slots.step(batch) for _ in range(args.steps)))
            behind[batch].append(slots.pipelined(batch, args.steps))
        if 1 in seconds:
            step_bytes = weight_bytes(model) + slots.mean_length(1) * kv_bytes_per_token(model)
            mbu.append(step_bytes / seconds[1][-1] / (size * gbs[-1] * 1e9))
    slots.release()
    print(f"memory read bandwidth (jitted sum, 1 GiB f32), per round: {median_range(gbs, '{:.1f}')} GB/s")
    for batch in batches:
        tok_s = [batch / s for s in seconds[batch]]
        line = f"batch {batch:3d}: step {median_range([s * 1e3 for s in seconds[batch]], '{:.2f}')} ms, "
        line += f"{median_range(tok_s, '{:.1f}')} tok/s"
        if batch == 1 and mbu:
            line += f", MBU {median_range(mbu, '{:.2f}')}"
        gain = [s / p for s, p in zip(seconds[batch], behind[batch])]
        line += f"; host one step behind: {median_range([batch / p for p in behind[batch]], '{:.1f}')} tok/s"
        line += f" ({median_range(gain, '{:.2f}')}x read each step)"
        print(line)
    if 1 in seconds:
        for batch in batches[1:]:
            ratios = [batch * s1 / sb for s1, sb in zip(seconds[1], seconds[batch])]
            print(f"throughput batch {batch} / batch 1, per round: {median_range(ratios, '{:.1f}')}x")
    print(f"compilations after warm-up: {model.compilations() - compiled}")


if __name__ == "__main__":
    main()
