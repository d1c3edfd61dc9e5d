"""Where a verify step's time goes (speculative decoding, issue 45): the parts of one pass over the
real model (the default one, int8 from its GGUF, the CPU kernels) at F = 1 fed row (a decode
step) and at F = K + 1 rows (a verify step of K guesses for one sequence), each timed alone.

    python benchmarks/verify_breakdown.py [--guesses 4] [--rounds 20] [--context 250]

The parts, each its own jitted function:
  * layers: every layer (`transformer.decode_layers`, caches donated): the step less its head;
  * products: the same layers' weight products alone (`quantize.matmul`, four a layer);
  * attention: the decode attention kernel alone, once a layer, over `--context` keys;
  * head: the final norm, the head's product and the sampling a verify step runs.
What the layers cost beyond their products and attention is the rest of each layer (norms,
RoPE, the KV writes, residuals) and the calls between the kernels. The rounds interleave (each
times every part once, F = 1 and F = K + 1 alike), so a shared machine's noise falls on all;
printed: the median milliseconds of each, and F = K + 1 over F = 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from engine.jax_backend import cpu_kernels, quantize, sampling, transformer  # noqa: E402
from engine.jax_backend.jax_model import JaxModel  # noqa: E402
from engine.jax_backend.sampling import SlotSampling  # noqa: E402
from engine.model_store.registry import resolve_model  # noqa: E402

PRODUCTS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def parts(model: JaxModel, rows: int, context: int, state: dict) -> dict:
    """The timed callables for `rows` fed rows of one sequence at positions context.. (see the
    module docstring); `state` holds the donated caches between calls."""
    cfg, e = model.config, model.config.hidden_size
    width = model._slots.tables.shape[1]
    tables = jnp.asarray(np.tile(np.arange(1, width + 1, dtype=np.int32), (rows, 1)))  # [F, W]
    positions = jnp.asarray(context + np.arange(rows, dtype=np.int32))  # [F]
    x = jnp.full((rows, 1, e), 0.01, jnp.float32)  # [F, 1, E]
    layers = state["layers"]

    def run_layers() -> None:
        state["k"], state["v"], y = layers(state["k"], state["v"], x, tables, positions, jnp.ones(rows, bool))
        y.block_until_ready()

    wide = jnp.full((rows, cfg.ffn_size), 0.01, jnp.float32)  # [F, FFN]
    q = jnp.ones((rows, cfg.n_heads, cfg.head_dim), jnp.float32)  # [F, H, D]
    return {
        "layers": run_layers,
        "products": lambda: state["products"](x[:, 0], wide).block_until_ready(),
        "attention": lambda: state["attention"](q, state["k"][0], state["v"][0], tables, positions).block_until_ready(),
        "head": lambda: jax.block_until_ready(state["head"](x[:, 0])),
    }


def jitted(model: JaxModel) -> dict:
    cfg = model.config

    def layers(k, v, x, tables, positions, active):
        x, k, v = transformer.decode_layers(model._decode_weights, k, v, x, tables, positions, active, cfg=cfg,
                                            attend=model.shapes.attend[-1], kernels=True, ragged=False)
        return k, v, x

    def products(x, wide):  # x [F, E], wide [F, FFN]
        total = 0.0
        for w in model._decode_weights:
            for name in PRODUCTS:
                total = total + quantize.matmul(wide if name == "w_down" else x, getattr(w, name)).sum()
        return total

    def attention(q, k_pool, v_pool, tables, positions):
        for _ in model._decode_weights:  # once a layer, each call fed by the last
            out = cpu_kernels.decode_attention(q, k_pool, v_pool, tables, positions, None, None)  # [F, H * D]
            q = q + 1e-6 * out.reshape(q.shape)
        return q

    def head(x):  # x [F, E]
        logits = transformer.logits(x, model._weights.final_norm, model._lm_head, cfg)  # [F, V']
        f = logits.shape[0]
        params = SlotSampling(jnp.zeros(f), jnp.zeros(f, jnp.int32), jnp.ones(f), jnp.zeros(f),
                              jnp.zeros((f, 2), jnp.uint32))  # greedy, as the benchmarks' requests
        ids = sampling.sample(logits, params, jnp.arange(f), jnp.zeros(logits.shape, bool), jnp.zeros(f, bool))
        return ids, sampling.top_logprobs(logits, jnp.zeros(f, jnp.int32))

    return {"layers": jax.jit(layers, donate_argnums=(0, 1)), "products": jax.jit(products),
            "attention": jax.jit(attention), "head": jax.jit(head), "k": tuple(model._k), "v": tuple(model._v)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model directory or registered name")
    parser.add_argument("--guesses", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--context", type=int, default=250, help="the sequence's position (keys attended)")
    a = parser.parse_args()
    model_dir = resolve_model(a.model, log=lambda line: print(line, file=sys.stderr))
    model = JaxModel.load(model_dir, max_batch_size=1, max_context_length=1024, weights="int8")
    if not model.kernels or not model.int8:
        sys.exit("needs the CPU kernels and int8 weights")
    state = jitted(model)
    cases = {(name, rows): run for rows in (1, a.guesses + 1)
             for name, run in parts(model, rows, a.context, state).items()}
    for run in cases.values():  # compile each
        run()
    times: dict = {case: [] for case in cases}
    for _ in range(a.rounds):
        for case, run in cases.items():
            start = time.perf_counter()
            run()
            times[case].append(time.perf_counter() - start)
    ms = {case: 1e3 * statistics.median(t) for case, t in times.items()}
    print(f"{a.rounds} rounds, {a.context} keys, load average {os.getloadavg()[0]:.1f}")
    f = a.guesses + 1
    for name in ("layers", "products", "attention", "head"):
        print(f"{name:10s} F=1 {ms[name, 1]:6.2f} ms  F={f} {ms[name, f]:6.2f} ms  x{ms[name, f] / ms[name, 1]:.2f}")
    rest = {rows: ms["layers", rows] - ms["products", rows] - ms["attention", rows] for rows in (1, f)}
    print(f"{'rest':10s} F=1 {rest[1]:6.2f} ms  F={f} {rest[f]:6.2f} ms  (layers less products and attention)")


if __name__ == "__main__":
    main()
