"""The mixture-of-experts MLP block, shared by every MoE family (engine.jax_backend.families).

Data flow for T tokens, X experts, k experts a token:
1. `route`: the router's logits [T, X] (plus a bias where a family has one) -> each token's k
   experts [T, k] and their weights [T, k] in float32, by the config's routing
   (engine.model_store.checkpoint.ROUTINGS).
2. The T * k (token, expert) pairs are sorted by expert, so each expert's rows are contiguous.
3. `grouped_product` multiplies each expert's rows by that expert's matrix, for gate/up and then
   for down, with the gated activation between: a grouped product, never a loop over experts
   nor every token through every expert.
4. The rows go back to their pairs' order, are weighted and summed over each token's k.

The grouped product takes one of four forms, picked while tracing from the weights, the row
count and the backend (all compute the same products, in float32 sums):
- with the CPU kernels on (float32, one device: engine.jax_backend.loading), their grouped
  product (cpu_kernels.expert_panel_matmul) over each expert packed in panels
  (weights.with_panels): each expert with rows streams its own weights once per block of rows,
  in place, and an expert no row chose is not read;
- few rows (at most X pairs: decode steps): each row multiplies its own expert's matrix,
  gathered per row, so a step reads only the experts its tokens chose;
- on an accelerator: `jax.lax.ragged_dot`, the backend's own grouped GEMM;
- on the CPU, more rows: XLA:CPU runs ragged_dot as a masked product against every expert (X
  times the work), so the rows are padded per expert to whole blocks of `block_rows(...)` rows
  and each block multiplies its expert's matrix in one batched product (the padding and the
  per-block weight copies are the cost; benchmarks/moe.py measures it against a dense MLP).

What a family configures: the routing, biases (ExpertWeights: the router's, added to its
logits, and each expert's gate_up and down biases, added to its rows' products), and the gated
activation `glu(gate, up)` (SiLU-gated for Qwen3-MoE and Mixtral; gpt-oss's clamped SwiGLU,
engine.jax_backend.families.gpt_oss). A family without biases adds no operation.

Under tensor parallelism (engine.jax_backend.mesh) each expert's features are split over the
devices as the dense MLP's are: every device computes every expert's share of its features, the
router is replicated, and the one all-reduce is after down, where the dense MLP has it.

Shapes: T tokens, M = T * k routed rows, E hidden, X experts, k experts a token, F' an expert's
features.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from engine.jax_backend import cpu_kernels
from engine.jax_backend.backend_profile import profile
from engine.model_store.checkpoint import ExpertWeights

Glu = Callable[[jax.Array, jax.Array], jax.Array]


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up: Qwen3-MoE's and Mixtral's experts (as the dense SiLU-gated MLP)."""
    return jax.nn.silu(gate) * up


def route(logits: jax.Array, k: int, routing: str) -> tuple[jax.Array, jax.Array]:
    """logits [T, X] -> (weights [T, k] float32, experts [T, k] int32), by `routing`
    (engine.model_store.checkpoint.ROUTINGS)."""
    logits = logits.astype(jnp.float32)
    if routing == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)  # [T, k] each
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, X]
    top, experts = jax.lax.top_k(probs, k)
    if routing == "softmax_renormalized":
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    elif routing != "softmax":
        raise ValueError(f"unknown routing {routing!r}")
    return top, experts.astype(jnp.int32)


def moe_mlp(x: jax.Array, w: ExpertWeights, k: int, routing: str, glu: Glu = silu_glu, panels=None) -> jax.Array:
    """The MoE MLP of the normed stream x [..., E] -> [..., E] (in x's dtype). `panels`: the
    layer's weights.PanelWeights when the CPU kernels are on (its experts packed for
    cpu_kernels.expert_panel_matmul), else None."""
    lead, e = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, e)  # [T, E]
    t, n_experts = x.shape[0], w.router.shape[-1]
    logits = jnp.matmul(x, w.router, preferred_element_type=jnp.float32).astype(x.dtype)  # [T, X], rounded as the model's dtype
    if w.router_bias is not None:
        logits = logits + w.router_bias
    weights, experts = route(logits, k, routing)  # [T, k] each
    flat = experts.reshape(-1)  # [M]: pair t * k + j is token t's j-th expert
    order = jnp.argsort(flat, stable=True)  # [M]: the pairs sorted by expert
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [X]: rows per expert
    rows = x[order // k]  # [M, E]: each sorted pair's token
    sorted_experts = flat[order]  # [M]
    packed = (None, None) if panels is None else (panels.experts_gate_up, panels.experts_down)
    gate_up = grouped_product(rows, w.gate_up, sizes, sorted_experts, packed[0])  # [M, 2F'] float32, interleaved
    if w.gate_up_bias is not None:
        gate_up = gate_up + w.gate_up_bias[sorted_experts]  # [M, 2F']: each row its expert's
    gate_up = gate_up.astype(x.dtype)
    gate_up = gate_up.reshape(gate_up.shape[0], -1, 2)  # [M, F', 2]
    hidden = glu(gate_up[..., 0], gate_up[..., 1])  # [M, F']
    out = grouped_product(hidden, w.down, sizes, sorted_experts, packed[1])  # [M, E] float32
    if w.down_bias is not None:
        out = out + w.down_bias[sorted_experts]  # [M, E]
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(t, k, e)  # [T, k, E]: back in pair order
    mixed = jnp.einsum("tke,tk->te", unsorted, weights)  # [T, E] float32
    return mixed.astype(x.dtype).reshape(*lead, e)


def grouped_product(rows: jax.Array, w: jax.Array, sizes: jax.Array, experts: jax.Array, panels: jax.Array | None = None) -> jax.Array:
    """rows [M, in] sorted by expert (sizes [X] rows each; experts [M] each row's) times its
    expert's matrix of w [X, in, out] -> [M, out] float32 (module docstring for the forms);
    `panels` [X, ceil(out / 32), in, 32]: w packed for the CPU kernel, which then takes it."""
    m, n_experts = rows.shape[0], w.shape[0]
    if panels is not None:
        return cpu_kernels.expert_panel_matmul(rows, panels, sizes, w.shape[2])
    if m <= n_experts:
        return jnp.einsum("mi,mio->mo", rows, w[experts], preferred_element_type=jnp.float32)
    if not profile().cpu:
        return jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32)
    return _blocked_product(rows, w, sizes, block_rows(m, n_experts))


def copied_experts(m: int, n_experts: int) -> int:
    """How many expert matrices grouped_product gathers for M routed rows on the CPU (the memory
    plan counts them among the temporaries; an accelerator's ragged_dot gathers fewer)."""
    return m if m <= n_experts else -(-m // block_rows(m, n_experts)) + n_experts


def block_rows(m: int, n_experts: int) -> int:
    """Rows per block of the CPU's blocked product for M rows over X experts: about half an
    expert's even share (a power of two, 8 to 128), so the padding (under a block per expert)
    stays a fraction of M while the blocks stay GEMM-sized."""
    return max(8, min(128, 1 << max(0, (m // (2 * n_experts)).bit_length() - 1)))


def _blocked_product(rows: jax.Array, w: jax.Array, sizes: jax.Array, b: int) -> jax.Array:
    """rows [M, in] grouped by expert, each expert's group padded to whole blocks of b rows; block
    n multiplies w[expert of block n] -> [M, out] float32. At most ceil(M / b) + X blocks."""
    m, n_experts = rows.shape[0], w.shape[0]
    n_blocks = -(-m // b) + n_experts  # a static bound: sum over experts of ceil(size / b)
    blocks = (sizes + b - 1) // b  # [X]
    block_start = jnp.cumsum(blocks) - blocks  # [X]: each expert's first block
    row_start = jnp.cumsum(sizes) - sizes  # [X]: each expert's first row in `rows`
    expert = jnp.repeat(jnp.arange(n_experts, dtype=jnp.int32), sizes, total_repeat_length=m)  # [M]
    slot = block_start[expert] * b + jnp.arange(m) - row_start[expert]  # [M]: each row's padded place
    padded = jnp.zeros((n_blocks * b, rows.shape[1]), rows.dtype).at[slot].set(rows)  # [NB * b, in]
    owner = jnp.searchsorted(jnp.cumsum(blocks), jnp.arange(n_blocks), side="right")  # [NB]
    owner = jnp.minimum(owner, n_experts - 1)  # blocks past the last expert's hold only zeros
    out = jnp.einsum(
        "nbi,nio->nbo", padded.reshape(n_blocks, b, -1), w[owner], preferred_element_type=jnp.float32
    )  # [NB, b, out]
    return out.reshape(n_blocks * b, -1)[slot]  # [M, out]
