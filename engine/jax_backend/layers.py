"""The shared layer library every model family's block is made of: RoPE (with its scalings,
longrope, YaRN and partial rotation), soft-capping, the RMSNorms, the projections (plain, CPU panel
kernel, int8 / fp8), the fused q/k/v split and the gated MLP, the embedding lookup. Pure
functions of arrays and the static config; no family knowledge (engine.jax_backend.families
composes these into blocks, engine.jax_backend.transformer runs the blocks over the paged KV
cache).

Shapes: B rows, T tokens, E hidden, F ffn, H heads, K kv heads, G = H / K, D head dim, V rows of
the embedding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import channel_quant, cpu_kernels, quantize
from engine.model_store.checkpoint import LayerWeights, ModelConfig, RopeScaling


def rope(xs: tuple[jax.Array, ...], positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, ...]:
    """Each x [B, T, heads, D] of `xs` (q and k) rotated as the config says, with one set of
    frequencies: its base and scaling over the first `cfg.rotary_dim` dims of each head (all
    without one; the rest pass through). A config with neither longrope nor partial rotation is
    `apply_rope` with `rope_inv_freq`: the same operations as before either existed."""
    rot = cfg.rotary_dim or cfg.head_dim
    s = cfg.rope_scaling
    if s is not None and s.kind == "longrope":
        short, long = longrope_frequencies(rot, cfg.rope_theta, s)  # [rot/2] each
        pos = positions.astype(jnp.float32)[..., None]  # [B, T, 1]
        angles = jnp.where(pos >= s.original_max_position_embeddings, pos * long, pos * short)  # [B, T, rot/2]
        turn = lambda part: rotate(part, angles, s.attention_factor)  # noqa: E731
    else:
        inv_freq = rope_frequencies(rot, cfg.rope_theta, s)  # [rot/2]
        scale = s.attention_factor if s is not None and s.kind == "yarn" else 1.0
        turn = lambda part: rotate(part, positions.astype(jnp.float32)[..., None] * inv_freq, scale)  # noqa: E731
    if rot == cfg.head_dim:
        return tuple(map(turn, xs))
    return tuple(jnp.concatenate([turn(x[..., :rot]), x[..., rot:]], axis=-1) for x in xs)


def longrope_frequencies(d: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, np.ndarray]:
    """LongRoPE's (short, long) per-pair frequencies [D/2]: the base's, each divided by its pair's
    factor. Which set a position uses is `rope`'s choice: the long one from
    original_max_position_embeddings on, as transformers' cached generation picks it for the
    tokens it adds (its forward over a whole sequence longer than that rotates every position
    with the long set)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    short, long = np.asarray(s.short_factor, np.float64), np.asarray(s.long_factor, np.float64)
    return (inv / short).astype(np.float32), (inv / long).astype(np.float32)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft-capping, cap * tanh(x / cap), elementwise; None: x itself (no operation)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """The config's per-pair rotation frequencies [D/2] (`rope_frequencies` of its head dim, base and scaling)."""
    return rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def rope_frequencies(d: int, theta: float, s: RopeScaling | None) -> np.ndarray:
    """Per-pair rotation frequencies [D/2] for base `theta`, with linear or llama3 scaling applied.
    A family whose layers rotate differently (Gemma 3's local and global bases) calls it per kind."""
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
    if s is None:
        return inv.astype(np.float32)
    if s.kind == "linear":
        return (inv / s.factor).astype(np.float32)
    if s.kind == "longrope":  # position-dependent: `rope` picks between longrope_frequencies' two
        raise ValueError("longrope frequencies depend on the position: rotate with layers.rope")
    if s.kind == "yarn":  # (its attention factor scales cos and sin: `rope` applies it)
        return _yarn_inv_freq(d, theta, s)
    return _llama3_inv_freq(inv, s).astype(np.float32)


def _yarn_inv_freq(d: int, theta: float, s: RopeScaling) -> np.ndarray:
    """YaRN's per-pair frequencies [D/2]: pair i keeps the base's frequency where it turns more
    than beta_fast times over the original context, takes the base's / factor where it turns
    fewer than beta_slow times, and blends the two linearly between (transformers'
    _compute_yarn_parameters, in float32 as it computes them)."""
    pos_freqs = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))  # [D/2]
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (np.float32(s.factor) * pos_freqs)

    def pair(rotations: float) -> float:  # the (fractional) pair that turns `rotations` times
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(s.beta_fast), pair(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)  # [D/2]
    kept = 1 - ramp  # the share of the base's frequency
    return (interpolated * (1 - kept) + extrapolated * kept).astype(np.float32)


def _llama3_inv_freq(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, the band between blended."""
    wavelen = 2 * np.pi / inv  # [D/2]
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back before the weight multiplies
    (as transformers' Llama does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * normed.astype(x.dtype)


def rms_norm_unit_offset(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: scaled by (1 + w), all in float32, cast back at the end (transformers'
    Gemma3RMSNorm). Checkpoints store w without the 1 (llama.cpp's GGUF files store 1 + w: a
    converter from them subtracts it)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate halves (the transformers layout): x [B, T, heads, D], positions [B, T]."""
    return rotate(x, positions.astype(jnp.float32)[..., None] * inv_freq)  # angles [B, T, D/2]


def rotate(x: jax.Array, angles: jax.Array, scale: float = 1.0) -> jax.Array:
    """x [B, T, heads, D] rotated by angles [B, T, D/2] (halves, the transformers layout), cos and
    sin multiplied by `scale` (longrope's attention factor) when it is not 1."""
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, D/2]
    sin = jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, heads, D/2] each
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def project(x: jax.Array, w: jax.Array, panels: jax.Array | None) -> jax.Array:
    """x [..., in] @ w [in, out]; by the CPU kernel on the panel-packed copy when there is one and
    x has at most cpu_kernels.PANEL_ROWS rows (decode steps, short prompt chunks; longer chunks
    use w and XLA's GEMM). The row count is static: the choice is made while tracing."""
    if panels is not None and x.size // x.shape[-1] <= cpu_kernels.PANEL_ROWS:
        return cpu_kernels.panel_matmul(x, panels, w.shape[1]).astype(x.dtype)
    return dot(x, w)


def dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w, its sums kept in float32 until the end: one device rounds once, as a plain bf16
    product does; under tensor parallelism (o, down: a sum split over devices) the partial sums
    are added in float32 before the one rounding, so bf16 results stay close to one device's.
    A quantized weight goes to its own product: the CPU kernels' int8 blocks
    (engine.jax_backend.quantize) or int8 / fp8 channels (engine.jax_backend.channel_quant)."""
    if isinstance(w, quantize.Int8Matrix):
        return quantize.matmul(x, w).astype(x.dtype)
    if isinstance(w, channel_quant.ChannelMatrix):
        return channel_quant.product(x, w).astype(x.dtype)
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

def split_qkv(x: jax.Array, w: LayerWeights, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused q/k/v projection (plus its bias, Qwen2) and its split: x [B, T, E] -> q
    [B, T, H, D], k/v [B, T, K, D], unrotated (the layout: engine.model_store.checkpoint.LayerWeights)."""
    b, t, _ = x.shape
    h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = h // kv
    qkv = project(x, w.w_qkv, getattr(w.panels, "qkv", None))  # [B, T, K * (G + 2) * D]
    if cfg.qkv_bias:
        qkv = qkv + w.b_qkv
    qkv = qkv.reshape(b, t, kv, g + 2, d)  # per kv head: its G query heads, its key, its value
    q = qkv[:, :, :, :g].reshape(b, t, h, d)  # [B, T, H, D]; head k * G + i uses kv head k
    k = qkv[:, :, :, g]  # [B, T, K, D]
    v = qkv[:, :, :, g + 1]  # [B, T, K, D]
    return q, k, v


def gated_mlp(x: jax.Array, w: LayerWeights, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """down(act(gate(x)) * up(x)): x [B, T, E] -> [B, T, E] (SiLU for Llama, GELU-tanh for Gemma)."""
    gate_up = project(x, w.w_gate_up, getattr(w.panels, "gate_up", None))  # [B, T, 2F], interleaved
    gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)  # [B, T, F, 2]
    gate, up = gate_up[..., 0], gate_up[..., 1]  # [B, T, F] each
    return project(act(gate) * up, w.w_down, getattr(w.panels, "down", None))  # [B, T, E]


def embed(table: jax.Array | quantize.Int8Matrix | channel_quant.ChannelMatrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` [...] of the embedding [V, E] -> [..., E] (float32 rows of the CPU kernels'
    int8 one, the activations' dtype from int8 channels)."""
    if isinstance(table, quantize.Int8Matrix):
        return quantize.embed(table, tokens)
    if isinstance(table, channel_quant.ChannelMatrix):
        return channel_quant.embed(table, tokens)
    return table[tokens]
