"""The MoE block (engine.jax_backend.moe) against a dense SiLU-gated MLP of equal active
parameters on the CPU (issue 44's target: the grouped product not slower per active parameter
than the dense one by more than 1.5x).

    python benchmarks/moe.py [--hidden 1024] [--experts 8] [--top-k 2] [--expert-ffn 512]
        [--tokens 1,8,64,512] [--rounds 5] [--calls 10] [--sets 6] [--kernels on|off]
        [--cpu-threads N] [--json PATH]

The MoE block: X experts of F' features, k a token, the router and its top-k included. The dense
MLP: one gated MLP of k x F' features, so that a token multiplies as many weights in both (the
"active parameters"); the ratio MoE / dense time is then the ratio per active parameter. Each
round times every token count and both blocks in turn (`--calls` back-to-back calls, waited for
once), so that each ratio is taken within a round; the figures are the medians over the rounds,
with the range of the ratio. Weights float32 (the CPU's dtype), random, routing random. The
kernels run on as many threads as a served model's (the CPUs this process may use, or
`--cpu-threads`), as XLA's own products (the dense block's GEMM above 64 tokens) run on all of
them.

Each block has `--sets` sets of weights, and its back-to-back calls take them in turn, as a
model's layers do: a block whose weights would fit in the last-level cache (the dense one's are
12.6 MB here) is otherwise read from there on every call after the first, and the bigger MoE
block from memory. "experts read" is how many experts a call's routing reaches, on average over
the sets (the same inputs as timed); "per weight read" is the ratio over the weights each block
reads: ratio x k / experts read (the router left out).

What the ratio cannot reach at some token counts: at 8 tokens top-2 of 8 experts reaches nearly
every expert, so the MoE block reads about X / k times the dense block's weights where both are
bound by reading them, and no grouped product can read fewer; "per weight read" is the figure
that says whether the product itself loses. Exit status 0 (a missed target is reported, not
failed).
"""

from __future__ import annotations

import argparse
import json
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
from engine.jax_backend import cpu_kernels, layers, moe  # noqa: E402
from engine.jax_backend.weights import PanelWeights  # noqa: E402 (also registers ExpertWeights as a pytree)
from engine.model_store.checkpoint import ExpertWeights  # noqa: E402

TARGET = 1.5


def weights(e: int, x: int, f: int, k: int, seed: int = 0):
    """Random MoE weights (router [E, X], gate_up [X, E, 2F'], down [X, F', E]) and a dense MLP's
    of k x F' features (gate_up [E, 2kF'], down [kF', E])."""
    r = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(r.standard_normal(shape, np.float32) / np.sqrt(shape[-2]))  # noqa: E731
    experts = ExpertWeights(router=draw(e, x), gate_up=draw(x, e, 2 * f), down=draw(x, f, e))
    return experts, (draw(e, 2 * k * f), draw(k * f, e))


def dense_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, panels: PanelWeights | None) -> jax.Array:
    """The dense gated MLP as served (engine.jax_backend.layers.project: the panel kernel up to
    cpu_kernels.PANEL_ROWS rows when `panels`, XLA's GEMM above): x [T, E] -> [T, E]."""
    h = layers.project(x, gate_up, None if panels is None else panels.gate_up).reshape(x.shape[0], -1, 2)  # [T, F, 2]
    return layers.project(jax.nn.silu(h[..., 0]) * h[..., 1], down, None if panels is None else panels.down)


def packed(experts: ExpertWeights, gate_up: jax.Array, down: jax.Array) -> PanelWeights:
    """Both blocks' weights packed for the CPU kernels, as weights.with_panels packs a layer's."""
    each = jax.vmap(cpu_kernels.pack_panels)
    return PanelWeights(None, None, cpu_kernels.pack_panels(gate_up), cpu_kernels.pack_panels(down),
                        each(experts.gate_up), each(experts.down))


def timed(call, x: jax.Array, sets: list[tuple], calls: int) -> float:
    """Seconds a call, over `calls` back-to-back calls waited for once, call i on x and weights
    sets[i % len(sets)]."""
    start = time.perf_counter()
    for i in range(calls):
        out = call(x, *sets[i % len(sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def experts_read(x: jax.Array, router: jax.Array, k: int) -> int:
    """How many experts the routing of x [T, E] reaches (each at least one row): the experts a
    call reads."""
    _, chosen = moe.route(x @ router, k, "softmax_renormalized")
    return len(np.unique(np.asarray(chosen)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--tokens", default="1,8,64,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--sets", type=int, default=6,
                   help="weight sets per block, taken in turn by its calls as layers are (1: one set, read from cache)")
    p.add_argument("--kernels", choices=["on", "off"], default="on", help="the CPU kernels, as served (off: XLA only)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="threads a kernel call uses (default 0: the CPUs this process may use, as served)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    counts = [int(t) for t in a.tokens.split(",")]
    drawn = [weights(a.hidden, a.experts, a.expert_ffn, a.top_k, seed=i) for i in range(a.sets)]
    if a.kernels == "on" and cpu_kernels.load() is None:
        print("the CPU kernels did not load (cpu_kernels.status() says why); --kernels off runs without them", file=sys.stderr)
        return 2
    threads = a.cpu_threads or cpu_kernels.available_cpus()
    if a.kernels == "on":
        cpu_kernels.set_threads(cpu_kernels.status().kernels, threads)  # as loading.cpu_kernels_for does
    panels = [packed(e, g, d) if a.kernels == "on" else None for e, (g, d) in drawn]
    sparse_sets = [(e, p) for (e, _), p in zip(drawn, panels, strict=True)]
    dense_sets = [(g, d, p) for (_, (g, d)), p in zip(drawn, panels, strict=True)]
    sparse = jax.jit(lambda x, w, p: moe.moe_mlp(x, w, a.top_k, "softmax_renormalized", panels=p))
    dense = jax.jit(dense_mlp)
    inputs = {t: jnp.asarray(np.random.default_rng(t).standard_normal((t, a.hidden), np.float32)) for t in counts}
    reached = {t: statistics.mean(experts_read(inputs[t], e.router, a.top_k) for e, _ in drawn) for t in counts}
    for t in counts:  # compile outside the timings
        jax.block_until_ready((sparse(inputs[t], *sparse_sets[0]), dense(inputs[t], *dense_sets[0])))
    times = {t: {"moe": [], "dense": []} for t in counts}
    for _ in range(a.rounds):
        for t in counts:
            calls = max(a.sets, a.calls * 8 // max(8, t))  # fewer calls for the long ones, each set at least once
            times[t]["moe"].append(timed(sparse, inputs[t], sparse_sets, calls))
            times[t]["dense"].append(timed(dense, inputs[t], dense_sets, calls))
    print(f"machine: {describe('jax', 'jaxlib', 'numpy')}; load average {os.getloadavg()[0]:.1f}")
    print(f"hidden {a.hidden}, {a.experts} experts of {a.expert_ffn} features, top-{a.top_k}; dense: {a.top_k * a.expert_ffn} features;"
          f" {a.sets} weight sets each; {a.rounds} rounds, float32, {jax.devices()[0].platform}, CPU kernels {a.kernels}"
          + (f" on {threads} threads" if a.kernels == "on" else ""))
    print(f"{'tokens':>6} {'moe ms':>9} {'dense ms':>9} {'ratio':>6} {'ratio range':>13} {'target':>7}"
          f" {'experts read':>12} {'per weight read':>15}")
    rows = []
    for t in counts:
        ratios = [m / d for m, d in zip(times[t]["moe"], times[t]["dense"], strict=True)]
        row = {"tokens": t, "moe_ms": 1e3 * statistics.median(times[t]["moe"]),
               "dense_ms": 1e3 * statistics.median(times[t]["dense"]), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios), "experts_read": reached[t]}
        row["per_weight_read"] = row["ratio"] * a.top_k / reached[t]
        rows.append(row)
        met = "met" if row["ratio"] <= TARGET else "missed"
        print(f"{t:>6} {row['moe_ms']:>9.3f} {row['dense_ms']:>9.3f} {row['ratio']:>6.2f} "
              f"{row['ratio_min']:>6.2f}-{row['ratio_max']:<6.2f} {met:>7} {reached[t]:>12.1f} {row['per_weight_read']:>15.2f}")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "threads": threads if a.kernels == "on" else None, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
