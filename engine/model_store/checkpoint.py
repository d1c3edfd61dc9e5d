"""Read a Hugging Face model directory into a static config, weights in our layout, and EOS ids.

Data flow: config.json -> `ModelConfig` (frozen, hashable: it is the static argument of every
jitted step); `model.safetensors` (or `model-*.safetensors` + index) -> `Weights`, one
`LayerWeights` per layer (separate arrays, not stacked: on XLA:CPU a layer sliced out of a
stacked array inside the step is copied first) and projections stored [in, out] so the forward
pass multiplies `x @ w`; the fused projections are laid out so that any split of their columns
into equal contiguous parts gives each part whole kv-head groups (q, k, v) and whole features
(gate, up): a tensor-parallel shard (engine.jax_backend.mesh) then computes its heads and features
with no exchange; config.json + generation_config.json + the tokenizer's eos token ->
`eos_token_ids`. What differs between model families (config keys, tensor names) is each
family's module in engine.model_store.families, picked by config.json's `architectures`; this
module holds what they share. Everything a checkpoint can get wrong (an architecture we do not run, a missing or
misshapen tensor) raises `CheckpointError` here, before anything is compiled.

No JAX here: each tensor is read as float32 numpy and handed to `place`, which returns what the
weights hold. The default keeps numpy; `engine.jax_backend.weights` places each tensor on the
device as it is read (so the host never holds the whole model twice) and registers these classes
as JAX pytrees.

The head is always its own [E, V'] array, V' being the ids the tokenizer can produce
(`tokenizer_size`): some checkpoints (Qwen2/3) pad the embedding past the tokenizer (151936 rows
for 151669 ids), and a padding id must never be sampled, so the head has no column for one. A
tied embedding is copied transposed for the head (one extra V' x E array): on XLA:CPU the [E, V']
product was the faster layout for the few-row steps that matter most (docs/benchmarks.md).

Shapes: V vocab (embedding rows), V' head columns, E hidden, F ffn, H heads, K kv heads, D head
dim, L layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors import safe_open

from engine.model_store.model_files import eos_token_ids, tokenizer_ids

REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


Array = Any  # a weight tensor: numpy as read, or whatever `place` made of it (a jax.Array)
Place = Callable[[np.ndarray], Array]


class CheckpointError(ValueError):
    """A model directory we cannot run: the message names the architecture or tensor at fault."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" divides positions by `factor`; "llama3" rescales by band;
    "longrope" (Phi-3 / Phi-4, engine.model_store.families.phi3) divides each pair's frequency by
    its own factor, the short ones below original_max_position_embeddings and the long ones from
    there on, and scales cos and sin by `attention_factor`; "yarn" (gpt-oss) blends each pair's
    frequency between the base's and the base's / `factor` by its wavelength (the pairs that turn
    more than beta_fast times over original_max_position_embeddings keep the base's, fewer than
    beta_slow take the divided one, a linear ramp between), and scales cos and sin by
    `attention_factor`."""

    kind: str  # "linear" | "llama3" | "longrope" | "yarn"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    short_factor: tuple[float, ...] = ()  # longrope only: one per rotated pair
    long_factor: tuple[float, ...] = ()  # longrope only
    attention_factor: float = 1.0  # longrope and yarn
    beta_fast: float = 32.0  # yarn only
    beta_slow: float = 1.0  # yarn only
    truncate: bool = True  # yarn only: the ramp's ends rounded out to whole pairs


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know statically; hashable so `jit` can key on it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int
    # Every layer's sliding window (transformer.in_window: a query sees its last `sliding_window`
    # positions, its own included); None: full attention. A family whose layers differ passes its
    # own per layer (transformer.layer_windows).
    sliding_window: int | None
    # Families whose layers differ (engine.model_store.families): each layer's window (None: a
    # global layer), the RoPE base of the windowed (local) layers, and the attention's scale when
    # it is not 1/sqrt(head_dim). None for the dense families.
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    # Gemma 2's soft-capping: attention scores (after the scale, before the mask) become
    # cap * tanh(score / cap), and so do the final logits. None: no cap, no operation added.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Partial RoPE (Phi-4-mini's partial_rotary_factor): only each head's first `rotary_dim` dims
    # rotate, the rest pass through. None: the whole head dim.
    rotary_dim: int | None = None
    # Mixture-of-experts families (engine.jax_backend.moe): the experts of each MoE layer, the
    # experts each token is routed to, one expert's intermediate size, how the router's logits
    # become those k experts' weights (ROUTINGS), and which layers are MoE (the others run the
    # dense MLP of ffn_size). 0 / None for the dense families.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_size: int = 0
    routing: str | None = None
    moe_layers: tuple[bool, ...] | None = None
    # gpt-oss (engine.jax_backend.families.gpt_oss): a bias on o (LayerWeights.b_o); per-head
    # attention sinks (LayerWeights.sinks: a learned logit in each head's softmax denominator,
    # with no value; every attention path takes them); biases on the router and on each expert's
    # gate_up and down (ExpertWeights); the experts' clamped SwiGLU, its gate's sigmoid gain and
    # its clamp. False / None for the other families: nothing added to their steps.
    o_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None


# How router logits [X] become the weights of a token's k experts (engine.jax_backend.moe.route):
# "softmax": softmax over all experts, the k largest kept as they are (Qwen3-MoE, norm_topk_prob
# false); "softmax_renormalized": the same, divided by their sum (Qwen3-MoE with norm_topk_prob);
# "topk_softmax": the k largest logits, softmax over those k (Mixtral; equal to the renormalised
# softmax; gpt-oss routes so, after a router bias).
ROUTINGS = ("softmax", "softmax_renormalized", "topk_softmax")


@dataclass(frozen=True)
class ExpertWeights:
    """One MoE layer's router and experts, each expert's matrices stacked on a leading axis (the
    grouped products of engine.jax_backend.moe read them so). Laid out as the dense MLP's: [in,
    out], gate and up interleaved feature by feature, so a split of the features' axis into equal
    contiguous parts gives each part whole features of every expert (tensor parallelism)."""

    router: Array  # [E, X]
    gate_up: Array  # [X, E, 2F']  F' = expert_ffn_size; columns 2f and 2f + 1 are feature f's gate, up
    down: Array  # [X, F', E]
    router_bias: Array | None = None  # [X]  added to the router's logits (gpt-oss)
    gate_up_bias: Array | None = None  # [X, 2F']  each expert's, laid out as gate_up's columns (gpt-oss)
    down_bias: Array | None = None  # [X, E]  (gpt-oss)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors (each an `Array`: what `place` returned for it)."""

    attn_norm: Array  # [E]
    w_qkv: Array  # [E, K * (G + 2) * D]  per kv head: its G query heads, its key, its value
    w_o: Array  # [H * D, E]
    mlp_norm: Array  # [E]
    w_gate_up: Array  # [E, 2F]  gate and up interleaved: columns 2f and 2f + 1 are feature f's (None in an MoE layer)
    w_down: Array  # [F, E]  (None in an MoE layer)
    b_qkv: Array | None  # [K * (G + 2) * D]  only when qkv_bias, laid out as w_qkv
    q_norm: Array | None  # [D]  only when qk_norm
    k_norm: Array | None  # [D]  only when qk_norm
    post_attn_norm: Array | None = None  # [E]  Gemma: the attention's output normed before the residual add
    post_mlp_norm: Array | None = None  # [E]  Gemma: the MLP's output likewise
    experts: ExpertWeights | None = None  # an MoE layer's router and experts (its w_gate_up, w_down None)
    b_o: Array | None = None  # [E]  gpt-oss: o's bias (ModelConfig.o_bias)
    sinks: Array | None = None  # [H]  gpt-oss: each query head's sink logit (ModelConfig.attention_sinks)
    panels: Any = None  # panel-packed copies for CPU products of a few rows, added by engine.jax_backend


@dataclass(frozen=True)
class Weights:
    embed: Array  # [V, E]
    layers: tuple[LayerWeights, ...]  # L of them
    final_norm: Array  # [E]
    lm_head: Array  # [E, V']; the embedding's first V' rows, transposed, when tied


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: Weights
    eos_token_ids: frozenset[int]
    tokenizer_size: int  # V': ids the tokenizer can produce, <= config.vocab_size; the head's width


def load_checkpoint(model_dir: str | Path, place: Place = np.asarray, place_head: Place | None = None) -> Checkpoint:
    """The directory's config, weights (each tensor handed to `place` as it is read; the head as
    `load_weights` says), EOS ids and tokenizer size."""
    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json", required=True)
    config = parse_config(raw)
    head_size = tokenizer_size(model_dir, config.vocab_size)
    weights = load_weights(model_dir, config, place, head_size, place_head)
    return Checkpoint(config, weights, eos_token_ids(model_dir), head_size)


def tokenizer_size(model_dir: Path, vocab_size: int) -> int:
    """Ids the tokenizer can produce: 1 + the largest id in tokenizer.json's model vocab and added
    tokens, capped at `vocab_size`; `vocab_size` when there is no tokenizer.json (the file is read
    once per version: model_files.tokenizer_ids)."""
    ids = tokenizer_ids(model_dir)
    return vocab_size if ids is None or ids.largest is None else min(vocab_size, ids.largest + 1)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig, by the family its `architectures` names
    (engine.model_store.families.FAMILIES); CheckpointError for an architecture we do not run."""
    from engine.model_store import families  # (its modules import this one)

    archs = raw.get("architectures") or [raw.get("model_type", "<none>")]
    arch = archs[0]
    if arch not in families.FAMILIES:
        raise CheckpointError(f"unsupported architecture {arch!r}; supported: {', '.join(families.FAMILIES)}")
    return families.FAMILIES[arch].parse_config(raw)


def rope_scaling(arch: str, rope: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    raise CheckpointError(f"{arch}: unsupported rope scaling type {kind!r} (default, linear, llama3)")


def yarn_scaling(arch: str, rope: dict[str, Any]) -> RopeScaling:
    """YaRN from a config's rope parameters (transformers' keys and defaults). Read by the
    families tested with it against transformers (gpt-oss); `rope_scaling` still refuses it for
    the others."""
    try:
        factor, original = float(rope["factor"]), int(rope["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{arch}: yarn needs a factor and original_max_position_embeddings, got {rope!r}") from None
    return RopeScaling(
        "yarn", factor, original_max_position_embeddings=original,
        attention_factor=float(rope.get("attention_factor") or yarn_attention_factor(rope)),
        beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
    )


def yarn_attention_factor(rope: dict[str, Any]) -> float:
    """YaRN's cos/sin scale when the config names none: 0.1 ln(factor) + 1 (the paper's), or the
    ratio of two such terms with `mscale` and `mscale_all_dim` (DeepSeek's form)."""
    factor = float(rope["factor"])

    def m(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return m(float(rope["mscale"])) / m(float(rope["mscale_all_dim"]))
    return m(1.0)


def load_weights(
    model_dir: Path, config: ModelConfig, place: Place = np.asarray, head_size: int | None = None,
    place_head: Place | None = None,
) -> Weights:
    """Read, check shapes against `config`, transpose to [in, out], hand each tensor to `place`;
    the head keeps the first `head_size` ids (default: all). `place_head`, where given, takes the
    head's rows [V', E] and returns it placed as [E, V'] (the caller's transpose: a large
    vocabulary's is seconds in numpy); else the rows are transposed here and handed to `place`.
    Each family reads its layers by its own tensor names (engine.model_store.families), through
    `TensorReader`."""
    from engine.model_store import families  # (its modules import this one)

    c = config
    read = TensorReader(_tensor_reader(model_dir, c.architecture), c, place)
    family = families.FAMILIES[c.architecture]
    E = c.hidden_size
    embed = read.tensor("model.embed_tokens.weight", (c.vocab_size, E))
    head = embed if c.tie_word_embeddings else read.tensor("lm_head.weight", (c.vocab_size, E))  # [V, E]
    if family.embed_scale:  # Gemma: rows scaled by sqrt(E) (the head keeps them as stored)
        embed = embed * np.float32(family.embed_scale(c))
    return Weights(
        embed=place(embed),
        layers=tuple(family.layer(read, f"model.layers.{i}.") for i in range(c.n_layers)),
        final_norm=place(read.tensor("model.norm.weight", (E,))),
        lm_head=(place_head or (lambda rows: place(np.ascontiguousarray(rows.T))))(head[: head_size or c.vocab_size]),
    )


class TensorReader:
    """A checkpoint's tensors by name, shape-checked against the config and in our layouts (float32
    numpy; `place` is the caller's to apply): what a family's layer loader reads with."""

    def __init__(self, get: Callable[[str], np.ndarray], config: ModelConfig, place: Place) -> None:
        self.get, self.config, self.place = get, config, place

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.get(name)
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"{self.config.architecture}: tensor {name} has shape {tuple(array.shape)}, expected {shape}"
            )
        return array.astype(np.float32, copy=False)  # the reader's own array: a float32 one is not copied again

    def by_kv_head(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [H * D, ...], k/v [K * D, ...] -> [K * (G + 2) * D, ...]: per kv head, its G query
        heads, its key, its value (LayerWeights.w_qkv)."""
        c = self.config
        K, D = c.n_kv_heads, c.head_dim
        g, rest = c.n_heads // K, q.shape[1:]
        parts = [q.reshape(K, g, D, *rest), k.reshape(K, 1, D, *rest), v.reshape(K, 1, D, *rest)]
        return np.concatenate(parts, axis=1).reshape(K * (g + 2) * D, *rest)

    def qkv(self, p: str) -> np.ndarray:  # [E, K * (G + 2) * D]
        c, a = self.config, p + "self_attn."
        E, HD, KD = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return self.by_kv_head(
            self.tensor(a + "q_proj.weight", (HD, E)), self.tensor(a + "k_proj.weight", (KD, E)),
            self.tensor(a + "v_proj.weight", (KD, E)),
        ).T

    def qkv_bias(self, p: str) -> np.ndarray:  # [K * (G + 2) * D]
        c, a = self.config, p + "self_attn."
        HD, KD = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return self.by_kv_head(
            self.tensor(a + "q_proj.bias", (HD,)), self.tensor(a + "k_proj.bias", (KD,)),
            self.tensor(a + "v_proj.bias", (KD,)),
        )

    def o(self, p: str) -> np.ndarray:  # [H * D, E]
        c = self.config
        return self.tensor(p + "self_attn.o_proj.weight", (c.hidden_size, c.n_heads * c.head_dim)).T

    def gate_up(self, p: str) -> np.ndarray:  # [E, 2F]: gate and up interleaved, feature by feature
        E, F = self.config.hidden_size, self.config.ffn_size
        return self.interleave(self.tensor(p + "mlp.gate_proj.weight", (F, E)), self.tensor(p + "mlp.up_proj.weight", (F, E)))

    def interleave(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """gate, up [F, E] -> [E, 2F], feature by feature (LayerWeights.w_gate_up)."""
        E, F = self.config.hidden_size, self.config.ffn_size
        return np.stack([gate, up], axis=1).reshape(2 * F, E).T

    def down(self, p: str) -> np.ndarray:  # [F, E]
        return self.tensor(p + "mlp.down_proj.weight", (self.config.hidden_size, self.config.ffn_size)).T

    def vector(self, name: str, size: int) -> Array:
        """A norm's weights [size], placed."""
        return self.place(self.tensor(name, (size,)))


def _tensor_reader(model_dir: Path, arch: str) -> Callable[[str], np.ndarray]:
    """name -> array, over one `model.safetensors` or the shards an index maps names to."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        where = {name: single for name in _keys(single)}
    elif index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {name: model_dir / shard for name, shard in weight_map.items()}
    else:
        raise CheckpointError(f"{arch}: no model.safetensors or model.safetensors.index.json in {model_dir}")

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise CheckpointError(f"{arch}: tensor {name} missing from {model_dir}")
        with safe_open(where[name], framework="numpy") as f:
            return f.get_tensor(name)

    return get


def _keys(path: Path) -> list[str]:
    with safe_open(path, framework="numpy") as f:
        return list(f.keys())


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path} not found")
        return {}
    return json.loads(path.read_text())
