"""Tensor parallelism: one model over N devices through a `jax.sharding.Mesh` and XLA's SPMD
partitioner (GSPMD), Megatron-style.

What lives where, on the mesh's one axis `tp` of N devices (a spec names the sharded axis):
- q/k/v projections split by kv-head group (w_qkv's columns; engine.model_store.checkpoint lays
  them out per kv head, so N contiguous parts are N sets of whole groups), o by rows (the heads),
  gate/up by columns (features, interleaved, so again whole features), down by rows;
- an MoE layer's experts split by feature as the dense MLP is (`Plan.expert_shardings`), its router
  replicated (gpt-oss's expert biases: gate_up's split with its columns, down's replicated);
- attention sinks (gpt-oss, one per query head) split by head as the heads are, o's bias replicated;
- the embedding and the head split by vocabulary, the norms replicated;
- the KV page pool split on its kv-head axis ([K, N, P, D] -> K/N per device); the block tables,
  small per-call inputs, are replicated.
A layer then computes its heads and features locally; XLA adds one all-reduce after o and one
after down, and gathers the logits for sampling. Those two products add their partial sums in
float32 before rounding (transformer._dot), so bfloat16 steps stay those of one device (seen on
tiny-qwen2 in bfloat16 at N = 4: the same greedy ids; with bfloat16 partial sums they parted
after six tokens). Each device holds 1/N of the sharded weights and
of the cache. Small per-step inputs (token ids, positions, sampling parameters) are replicated.

When N exceeds the kv heads and is a multiple of them, each kv head is copied N/K times (as
tpu-inference does) and each copy serves G*K/N of its query heads: the model then runs with N
kv heads, so each device holds one kv head of the cache (1/K of it, not 1/N). Any other size
that does not divide a dimension (heads, kv heads, ffn, vocabulary) is refused with one line
naming it. The head's width V' (ids the tokenizer can produce, e.g. 151,669) is padded with zero
columns to a multiple of N; the logits are cut back to V' before sampling.

Across hosts (`jax.distributed`, engine.jax_backend.multihost) the mesh spans every process's
devices; each process places its own shards of the same arrays, read from its own copy of the
checkpoint.

Shapes: V vocab, V' head columns, E hidden, F ffn, H heads, K kv heads, G = H / K, D head dim.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.jax_backend.backend_profile import profile
from engine.jax_backend.weights import ExpertWeights, LayerWeights, Weights  # (registered as pytrees there)
from engine.model_store.checkpoint import ModelConfig

log = logging.getLogger(__name__)

AXIS = "tp"


class TensorParallelError(ValueError):
    """A tensor-parallel size this model or host cannot run; the one-line message names why."""


def request_cpu_devices(count: int) -> None:
    """Ask for `count` CPU devices if the JAX backend has not started yet (the
    `jax_num_cpu_devices` option only takes effect before it does); afterwards a no-op. Lets
    `--tensor-parallel N` run on a CPU host (for tests and trials: it shows that it works, it is
    not faster). GPU devices are what the host has."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend is up: the devices are what they are
        pass


def check_sizes(cfg: ModelConfig, n: int) -> None:
    """Refuse a size that does not divide the model's heads, kv heads (unless a multiple of
    them), ffn or vocabulary: TensorParallelError with one line naming the dimension."""
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel must be >= 1, got {n}")
    problems = [
        (cfg.n_heads % n, f"the model's {cfg.n_heads} attention heads (num_attention_heads)"),
        (cfg.n_kv_heads % n and n % cfg.n_kv_heads,
         f"the model's {cfg.n_kv_heads} kv heads (num_key_value_heads), nor is it a multiple of them"),
        (cfg.ffn_size % n, f"the model's intermediate size {cfg.ffn_size} (intermediate_size)"),
        (cfg.expert_ffn_size % n, f"the model's expert intermediate size {cfg.expert_ffn_size} (moe_intermediate_size)"),
        (cfg.vocab_size % n, f"the model's vocabulary of {cfg.vocab_size} (vocab_size)"),
    ]
    for remainder, dimension in problems:
        if remainder:
            raise TensorParallelError(f"--tensor-parallel {n} does not divide {dimension}")


@dataclass(frozen=True)
class Plan:
    """Where a model's arrays live on a mesh of `size` devices (see the module docstring)."""

    mesh: Mesh
    head_size: int  # V', the head's real width before padding

    @property
    def size(self) -> int:
        return self.mesh.size

    def sharding(self, *spec: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def cache(self) -> NamedSharding:
        """[K, N, P, D] buffers (the KV page pools): split on the kv-head axis. (Spelt as jit
        spells its outputs, without trailing Nones: a jitted step keys its compiled code on the
        spec, so a fresh buffer and a returned one must match.)"""
        return self.sharding(AXIS)

    def put(self, tree):
        """Host values (numpy) onto every device of the mesh, replicated: the per-step inputs."""
        return jax.device_put(tree, self.replicated)

    def layer_shardings(self, layer: LayerWeights) -> LayerWeights:
        """The sharding of each of a layer's tensors (None where the layer has none)."""
        cols, rows, rep = self.sharding(None, AXIS), self.sharding(AXIS, None), self.replicated
        dense_mlp = layer.experts is None
        return LayerWeights(
            attn_norm=rep, w_qkv=cols, w_o=rows, mlp_norm=rep,
            w_gate_up=cols if dense_mlp else None, w_down=rows if dense_mlp else None,
            b_qkv=None if layer.b_qkv is None else self.sharding(AXIS),
            q_norm=None if layer.q_norm is None else rep,
            k_norm=None if layer.k_norm is None else rep,
            post_attn_norm=None if layer.post_attn_norm is None else rep,
            post_mlp_norm=None if layer.post_mlp_norm is None else rep,
            experts=None if dense_mlp else self.expert_shardings(layer.experts),
            b_o=None if layer.b_o is None else rep,
            sinks=None if layer.sinks is None else self.sharding(AXIS),  # by query head, with the heads
        )

    def expert_shardings(self, experts: ExpertWeights) -> ExpertWeights:
        """An MoE layer's: every expert's features split as the dense MLP's (gate_up [X, E, 2F'] by
        its columns, down [X, F', E] by its rows), the router replicated. Each device then holds
        1/N of every expert and computes its features of whichever experts a token chose, so the
        work is balanced however tokens route and the one all-reduce stays after down; experts
        spread over devices instead would need an all-to-all of the tokens and X % N == 0."""
        rep = self.replicated
        return ExpertWeights(
            router=rep, gate_up=self.sharding(None, None, AXIS), down=self.sharding(None, AXIS, None),
            router_bias=None if experts.router_bias is None else rep,
            gate_up_bias=None if experts.gate_up_bias is None else self.sharding(None, AXIS),  # with gate_up's columns
            down_bias=None if experts.down_bias is None else rep,
        )


def make_plan(cfg: ModelConfig, size: int, head_size: int) -> Plan:
    """A mesh over the first `size` devices (all of them when JAX runs across processes: the
    size is then every process's devices together). Raises TensorParallelError (one line) for a
    size the model's dimensions or the host's devices refuse."""
    check_sizes(cfg, size)
    devices = jax.devices()
    multi = jax.process_count() > 1
    if len(devices) < size or (multi and len(devices) != size):
        where = f"{jax.process_count()} processes together have" if multi else "this host has"
        raise TensorParallelError(
            f"--tensor-parallel {size} needs {size} devices; {where} {len(devices)} ({profile().name})"
        )
    mesh = Mesh(np.array(devices[:size]), (AXIS,), axis_types=(AxisType.Auto,))
    return Plan(mesh, head_size)


def parallel_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config the forward pass runs with on N devices: N kv heads when they are replicated."""
    return replace(cfg, n_kv_heads=n) if n > cfg.n_kv_heads else cfg


def _replicate_kv(a: np.ndarray, cfg: ModelConfig, n: int) -> np.ndarray:
    """A w_qkv ([E, K*(G+2)*D]) or b_qkv ([K*(G+2)*D]) laid out for N kv heads: each kv head
    copied r = N/K times, copy j taking query heads j*G/r .. (j+1)*G/r - 1 of its group. The
    query heads keep their order, so w_o is unchanged."""
    k, d, g = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    r = n // k
    lead = a.shape[:-1]
    groups = a.reshape(*lead, k, g + 2, d)
    q = groups[..., :g, :].reshape(*lead, k * r, g // r, d)
    kv = np.repeat(groups[..., g:, :], r, axis=-3)  # [..., K * r, 2, D]
    return np.concatenate([q, kv], axis=-2).reshape(*lead, n * (g // r + 2) * d)


def shard_weights(weights: Weights, cfg: ModelConfig, plan: Plan, dtype) -> Weights:
    """Host (numpy) weights in the checkpoint's layout -> the mesh's shards, cast to `dtype`,
    layer by layer (a layer's replicated-kv copy exists on the host only while it is placed)."""
    n = plan.size

    def place(array: np.ndarray | None, sharding: NamedSharding | None):
        if array is None:
            return None
        array = np.asarray(array).astype(jnp.dtype(dtype), copy=False)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    layers = []
    for layer in weights.layers:
        if n > cfg.n_kv_heads:
            layer = replace(
                layer, w_qkv=_replicate_kv(layer.w_qkv, cfg, n),
                b_qkv=None if layer.b_qkv is None else _replicate_kv(layer.b_qkv, cfg, n),
            )
        layers.append(jax.tree.map(place, layer, plan.layer_shardings(layer), is_leaf=lambda x: x is None))
    head = np.asarray(weights.lm_head)
    padded = -(-head.shape[1] // n) * n
    head = np.pad(head, ((0, 0), (0, padded - head.shape[1])))  # zero columns, cut from the logits
    return Weights(
        embed=place(weights.embed, plan.sharding(AXIS, None)),
        layers=tuple(layers),
        final_norm=place(weights.final_norm, plan.replicated),
        lm_head=place(head, plan.sharding(None, AXIS)),
    )


def device_bytes(arrays) -> dict[int, int]:
    """Bytes each device holds of `arrays` (a pytree of jax.Arrays), by device id: what the
    tests compare with 1/N of the whole."""
    held: dict[int, int] = {}
    for array in jax.tree.leaves(arrays):
        for shard in array.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held
