"""Weight-only int8 (`--weights int8`): every projection, the embedding and the LM head held as
int8 blocks with float16 scales (and, for blocks read from a GGUF's Q4_0, Q4_1, Q5_1 or Q4_K, a
float16 offset each; a GGUF's 4- and 5-bit blocks stay 4- and 5-bit); activations and the KV cache stay float32 (the
kernel takes each product's input as 16-bit blocks, within float rounding of the dequantized
weights' float product, on either of its paths: AVX-512 VNNI, or AVX2 with the same bits).

Blocks: a matrix used as x @ W ([in, out] in engine.model_store.checkpoint) is quantized
transposed, [out, in]: q [N, K] int8 and scale [N, K / 32] float16, W.T[n, j] =
q[n, j] * scale[n, j // 32]. That is llama.cpp's Q8_0 (blocks of 32 along the input with one
float16 scale: 34 bytes a block), symmetric, round to nearest: scale = max|block| / 127, rounded
to float16 before the block is divided by it. A float32 scale made a block 36 bytes, and a
batch-1 step reads every byte: 151 MB a step for the default model against Q8_0's 145 MB.

Offsets: llama.cpp's Q4_1 and Q5_1 store w = d * q + m with q unsigned, which no symmetric block
holds exactly. An Int8Matrix may therefore carry an offset per block, W.T[n, j] = q[n, j] *
scale[n, j // 32] + offset[n, j // 32], and the kernel adds offset times the sum of the block's
inputs. The default model arrives as Q4_1: with the offsets its int8 weights are exactly the
values its float32 load holds (they were requantized before, and greedy ids drifted from
float32's after a near-tie), for 2 more bytes a block (36, the bytes of Q8_0 plus m).

4-bit blocks: a GGUF's Q4_0 and Q4_1 matrices hold 4-bit integers, and widening them to 8 bits
made a decode step read 1.8x the bytes the file holds. They are therefore kept as 4-bit blocks
(`bits` 4: two inputs a byte, always with an offset; Q4_0's d * (q - 8) is q with offset -8 d,
exact in float16), 20 bytes a block as in the file, and the kernel unpacks them as they stream
in. A 4-bit block is 0.56x the bytes of an 8-bit one with its offset; the default model's weights
(its Q8_0 embedding and head stay 8-bit) are 97 MB against 151 and against Q8_0's 145, and a
batch-1 step reads them all: int8 here means weights of at most 8 bits, as the file has them. A fused matrix whose parts
differ (a Q4_1 q with a Q8_0 v) is held in 8 bits.

5-bit blocks: likewise a GGUF's Q5_0 (w = d * q, q in -16..15: Gemma 3's own projections) and
Q5_1 (w = d * q + m, q in 0..31) stay 5-bit (`bits` 5: signed without an offset, unsigned with
one), 22 and 24 bytes a block as in the file, 0.65x (0.67x) the bytes of their int8 widening; the
kernel adds the fifth bit as it unpacks the nibbles, and its products are the same bits as the
widened blocks' (kernels/int8_matmul.cc). A fused matrix is 5-bit when every part is, with
offsets on all parts or on none (a Q5_0 part beside a Q5_1 one is held in 8 bits: one matrix's
integers are either signed or unsigned).

Layout: `Int8Matrix` holds those blocks regrouped once, at load, in panels of 16 outputs (`pack`):
packed [P, K / 2, 16, 2] int8 (8 bits: packed[p, j, i] = q[16 p + i, 2 j : 2 j + 2]) or
[P, K / 4, 16, 2] uint8 (4 and 5 bits: packed[p, g, i, t] = q[16 p + i, 4 g + t] | q[16 p + i,
4 g + 2 + t] << 4, each q's low four bits), for 5 bits high [P, K / 4, 2] uint32 (bit 2 i + t
of high[p, g, h] the fifth bit of q[16 p + i, 4 g + 2 h + t], of q + 16 where q is signed: the
masks the kernel applies to the nibbles it unpacks, one load each), scale [P, K / 32, 16] and
offset (or None) in scale's layout, P = ceil(N / 16), zero past N: the layout the C++ kernel reads
with one load per pair (or two pairs) of inputs of 16 outputs (kernels/int8_matmul.cc says why).
`rows()` gives q and scale back (the many-row path, the embedding's lookups, tests). The embedding [V, E] is already [rows, in]; a tied head shares it
(same object) when it covers every row, so the model holds those bytes once.

Products: `matmul` sends up to DIRECT_ROWS rows (decode steps, short prompt chunks) to the C++
kernel (engine.jax_backend.cpu_kernels.int8_matmul), which works on the bytes as they stream
in (integer dots on 16-bit activation blocks, with AVX-512 VNNI or, the same bits, AVX2); up to SLICED_ROWS
rows (a packed prefill of a burst of prompts, prompt chunks, decode above 64 rows) go to it in
slices of DIRECT_ROWS rows, each slice reading the weights again, which costs little beside
its arithmetic; more rows (long prompt chunks) dequantize the matrix in XLA and run its float32
GEMM, where the convert costs little per row. XLA:CPU does not fuse that convert into the dot, so the
kernel is needed for the few-row case (docs/benchmarks.md). These blocks are for the CPU
kernels only: where the kernels are off (an accelerator, no compiler, bfloat16, `--cpu-kernels
off`) `--weights int8` is engine.jax_backend.channel_quant's per-channel int8 instead, whose
product XLA compiles; neither runs under tensor parallelism.

Where the blocks come from (engine.jax_backend.weights.load_int8): a directory converted from a
GGUF keeps it as `model.gguf`, and its matrices are read from there (`gguf_weights`): Q8_0,
Q4_0, Q4_1, Q5_0 and Q5_1 blocks are taken as they are (the same integers, scales and offsets:
no float32 round trip); Q4_K's sub-blocks of 32 as 4-bit blocks with their scales and offsets
rounded to float16; other types are requantized a chunk of rows at a time
(engine.model_store.gguf_blocks); each family's own layer loader places them
(`GGUFInt8Reader`). Otherwise the float32 checkpoint is read on the host one tensor at a time and
quantized as it is placed (`int8_place`, symmetric, no offsets). Either way the model never
exists whole in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from engine.jax_backend import cpu_kernels
from engine.model_store.gguf_blocks import BlockFormat, fused_format

BLOCK = cpu_kernels.INT8_BLOCK
PANEL = cpu_kernels.INT8_PANEL
SCALE = np.float16  # the blocks' scale, as Q8_0 keeps it (module docstring; kernels/int8_matmul.cc reads f16)
DIRECT_ROWS = 64  # most rows one call of the C++ kernel takes
# Most rows the kernel takes in slices of DIRECT_ROWS; above it, dequantize + XLA's GEMM. Measured
# on the default model's MLP and qkv shapes, 2 vCPUs of an AMD EPYC (Zen 4, VNNI), medians of 7
# (docs/benchmarks.md, "int8 products of 65-512 rows"): the slices took 0.46x the GEMM path's time
# at 128 rows, 0.55x at 256, 0.71x at 512 and 1.11x at 1,024.
SLICED_ROWS = 512
# the weights a model is served with: "float32" the dtype's own; "int8" these blocks with the CPU
# kernels, channel_quant's int8 without them; "fp8" channel_quant's e4m3 everywhere
WEIGHTS = ("float32", "int8", "fp8")
AUTO = "auto"  # what --weights defaults to: int8 where it runs and the model brings its GGUF, else float32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Matrix:
    """A weight matrix as integer blocks of [out, in] rows, in panels of 16 outputs (module docstring)."""

    packed: jax.Array  # [P, K / 2, PANEL, 2] int8 (bits 8) or [P, K / 4, PANEL, 2] uint8 (bits 4 and 5: low nibbles)
    scale: jax.Array  # [P, K / BLOCK, PANEL] float16
    n: int = field(metadata=dict(static=True))  # outputs (rows of q)
    offset: jax.Array | None = None  # [P, K / BLOCK, PANEL] float16, or None: no offsets (module docstring)
    bits: int = field(default=8, metadata=dict(static=True))  # 8, 5 (signed exactly without an offset) or 4 (always with one)
    high: jax.Array | None = None  # [P, K / 4, 2] uint32: the fifth bits (bits 5), else None (module docstring)

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's shape as x @ W sees it: [in, out] (the float32 weight's shape)."""
        return self.packed.shape[1] * (2 if self.bits == 8 else 4), self.n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.packed, self.scale, self.offset, self.high) if a is not None)

    def rows(self) -> tuple[jax.Array, jax.Array]:
        """(q [N, K] int8 (0..15 for 4 bits; -16..15 or 0..31 for 5), scale [N, K / BLOCK]
        float16): the blocks as `quantize_rows` (or engine.model_store.gguf_blocks) gives them."""
        p = self.packed.shape[0]
        if self.bits == 8:
            q = self.packed.transpose(0, 2, 1, 3)
        else:
            high = None if self.high is None else self.high[:, None]  # [P, 1, K / 4, 2]
            lanes = jnp.arange(PANEL)[None, :]  # [1, 16]
            q = _nibble_values(self.packed.transpose(0, 2, 1, 3), high, lanes, self.offset is None)  # [P, 16, K / 4, 2, 2]
        return q.reshape(p * PANEL, self.shape[0])[: self.n], _unpanel(self.scale, self.n)

    def offsets(self) -> jax.Array | None:
        """offset [N, K / BLOCK] float16 in the layout of `rows()`'s scale, or None."""
        return None if self.offset is None else _unpanel(self.offset, self.n)


def _nibble_values(quads: jax.Array, high: jax.Array | None, lane: jax.Array, signed: bool) -> jax.Array:
    """The integers of 4- or 5-bit blocks (module docstring's layout): quads [..., G, 2 (t)] uint8
    of the outputs at `lane` (broadcast against ...), high [..., G, 2 (h)] uint32 their panel's
    fifth bits (None: 4 bits) -> q [..., G, 2 (h), 2 (t)] int8, input 4 g + 2 h + t."""
    q = jnp.stack([quads & 0x0F, quads >> 4], axis=-2).astype(jnp.int32)  # [..., G, 2, 2]
    if high is None:
        return q.astype(jnp.int8)
    shift = ((2 * lane)[..., None, None, None] + jnp.arange(2)).astype(jnp.uint32)  # [..., 1, 1, 2]
    q = q + 16 * ((high[..., None] >> shift) & 1).astype(jnp.int32)  # bit 2 lane + t of mask h
    return (q - 16 if signed else q).astype(jnp.int8)


def _unpanel(per_block: jax.Array, n: int) -> jax.Array:
    """[P, K / BLOCK, PANEL] -> [N, K / BLOCK]."""
    p, blocks, _ = per_block.shape
    return per_block.transpose(0, 2, 1).reshape(p * PANEL, blocks)[:n]


# What q may hold at each width, by whether the blocks carry offsets (module docstring)
RANGES = {(8, False): (-128, 127), (8, True): (-128, 127), (4, True): (0, 15), (5, False): (-16, 15), (5, True): (0, 31)}


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None, bits: int = 8) -> Int8Matrix:
    """Blocks q [N, K] int8, scale [N, K / BLOCK] and optionally offset [N, K / BLOCK] (as
    `quantize_rows` gives them, or a GGUF's own, engine.model_store.gguf_blocks; held as float16,
    which they are in the file) -> an Int8Matrix on the device, regrouped into panels of 16
    outputs (module docstring). `bits` 4 packs q, which must lie in 0..15, two to a byte, and
    needs an offset; `bits` 5 packs q's low four bits so, and its fifth bits as masks: q in
    -16..15 without an offset, 0..31 with one (RANGES)."""
    n, k = q.shape
    if bits not in (8, 5, 4):
        raise ValueError(f"blocks of 8, 5 or 4 bits, not {bits}")
    kind = (bits, offset is not None)
    if kind not in RANGES or q.size and not RANGES[kind][0] <= q.min() <= q.max() <= RANGES[kind][1]:  # never for 8 bits
        raise ValueError({4: "4-bit blocks hold 0..15, with an offset", 5: "5-bit blocks hold -16..15 without an offset, 0..31 with one"}[bits])
    panels = -(-n // PANEL)
    padded_q = np.zeros((panels * PANEL, k), np.int8)
    padded_q[:n] = q
    fifth = None
    if bits == 8:
        packed = padded_q.reshape(panels, PANEL, k // 2, 2).transpose(0, 2, 1, 3)
    else:  # [P, 16, K / 4, 2 (low, high), 2 (t)] -> one byte per (group, output, t)
        unsigned = (padded_q + np.int8(16) if bits == 5 and offset is None else padded_q).view(np.uint8)
        nibbles = (unsigned & 0x0F).reshape(panels, PANEL, k // 4, 2, 2)
        packed = (nibbles[:, :, :, 0] | nibbles[:, :, :, 1] << 4).transpose(0, 2, 1, 3)
        if bits == 5:  # bit 2 i + t of mask (p, g, h): the fifth bit of output i's input 4 g + 2 h + t
            bit = (unsigned >> 4).reshape(panels, PANEL, k // 4, 2, 2).transpose(0, 2, 3, 1, 4)  # [P, G, 2 (h), 16, 2 (t)]
            masks = np.packbits(bit.reshape(panels, k // 4, 2, 2 * PANEL), axis=-1, bitorder="little")  # [P, G, 2, 4]
            fifth = jnp.asarray(np.ascontiguousarray(masks).view("<u4").astype(np.uint32)[..., 0])  # [P, G, 2]

    def per_block(values: np.ndarray) -> jax.Array:  # [N, K / BLOCK] -> [P, K / BLOCK, PANEL] float16
        padded = np.zeros((panels * PANEL, k // BLOCK), SCALE)
        padded[:n] = values
        return jnp.asarray(np.ascontiguousarray(padded.reshape(panels, PANEL, k // BLOCK).transpose(0, 2, 1)))

    return Int8Matrix(
        jnp.asarray(np.ascontiguousarray(packed)), per_block(scale), n, None if offset is None else per_block(offset), bits,
        fifth,
    )


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (q [N, K] int8, scale [N, K / BLOCK] float16), blocks along K."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"int8 weights need every input dimension to be a multiple of {BLOCK}, got {k}")
    blocks = np.asarray(w, np.float32).reshape(n, k // BLOCK, BLOCK)
    scale = (np.abs(blocks).max(axis=-1) / 127.0).astype(SCALE)  # [N, K / BLOCK]
    wide = scale.astype(np.float32)  # the value the kernels multiply by
    safe = np.where(wide > 0, wide, 1.0)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int8)
    return q.reshape(n, k), scale


def _blocks_to_float(q: jax.Array, scale: jax.Array, offset: jax.Array | None = None) -> jax.Array:
    """q [..., K] int8, scale and offset (or None) [..., K / BLOCK] -> the values [..., K] as float32."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK).astype(jnp.float32)
    values = blocks * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        values = values + offset.astype(jnp.float32)[..., None]
    return values.reshape(q.shape)


def dequantize(m: Int8Matrix) -> jax.Array:
    """The float32 matrix W.T [N, K] (tests; the many-row path)."""
    return _blocks_to_float(*m.rows(), m.offsets())


def matmul(x: jax.Array, m: Int8Matrix) -> jax.Array:
    """x [..., in] @ W -> [..., out] float32 (module docstring for which path runs)."""
    rows = x.size // x.shape[-1]
    if rows <= DIRECT_ROWS:
        return cpu_kernels.int8_matmul(x, m.packed, m.scale, m.n, m.offset, m.high)
    if rows <= SLICED_ROWS:  # static: chosen while tracing
        flat = x.reshape(rows, x.shape[-1])  # [R, in]
        parts = [cpu_kernels.int8_matmul(flat[s : s + DIRECT_ROWS], m.packed, m.scale, m.n, m.offset, m.high)
                 for s in range(0, rows, DIRECT_ROWS)]  # each [<= DIRECT_ROWS, out]
        return jnp.concatenate(parts).reshape(*x.shape[:-1], m.n)
    return jnp.matmul(x.astype(jnp.float32), dequantize(m).T)


def embed(m: Int8Matrix, tokens: jax.Array) -> jax.Array:
    """Rows `tokens` of an int8 embedding [V, E] as float32: tokens [...] -> [..., E]."""
    panel, lane = tokens // PANEL, tokens % PANEL
    q = m.packed[panel, :, lane]  # [..., E / 2, 2] int8, or [..., E / 4, 2] uint8 (4 and 5 bits)
    if m.bits != 8:
        high = None if m.high is None else m.high[panel]  # [..., E / 4, 2] uint32
        q = _nibble_values(q, high, lane, m.offset is None)  # [..., E / 4, 2, 2]
    q = q.reshape(*tokens.shape, -1)  # [..., E]
    offset = None if m.offset is None else m.offset[panel, :, lane]
    return _blocks_to_float(q, m.scale[panel, :, lane], offset)  # scale, offset [..., E / BLOCK]


def int8_place(embedding_shape: tuple[int, int]):
    """A `place` for engine.model_store.checkpoint.load_weights: each 2-D weight as an Int8Matrix
    on the device, transposed from [in, out] to [out, in] except the embedding (the one tensor of
    `embedding_shape`, [V, E], already [rows, in]); 1-D tensors (norms, biases) as float32."""

    def place(array: np.ndarray) -> jax.Array | Int8Matrix:
        if array.ndim != 2:
            return jnp.asarray(array, jnp.float32)
        rows = array if array.shape == embedding_shape else np.ascontiguousarray(array.T)
        return pack(*quantize_rows(rows))

    return place


# The projections a layer holds, in LayerWeights' order, and the HF matrices each is fused from:
# `gguf_weights` places them and `gguf_layout` gives their formats, so the two cannot disagree.
LAYER_MATRICES = (
    ("w_qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("w_o", ("self_attn.o_proj.weight",)),
    ("w_gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("w_down", ("mlp.down_proj.weight",)),
)


class GGUFInt8Reader:
    """A family's layer loader reads a GGUF's int8 blocks through this, as it reads a float32
    checkpoint through engine.model_store.checkpoint.TensorReader (the same methods, each matrix
    an Int8Matrix on the device in the layout `int8_place` gives a float32 one: the fused q/k/v
    rows per kv head, gate and up rows interleaved). So each family's tensor names and norms are
    written once, in engine.model_store.families, for both loads. Rows are whole blocks, so the
    fusions move q, scale and offset rows together and quantize nothing again (a fused matrix
    whose parts differ in type gets zero offsets for the parts without)."""

    def __init__(self, get, config) -> None:
        self.get, self.config = get, config  # get: engine.model_store.gguf_blocks.int8_tensor_reader

    @staticmethod
    def place(a):
        """What the family hands the device: an Int8Matrix is there already; a vector goes as float32."""
        return a if isinstance(a, Int8Matrix) else jnp.asarray(a, jnp.float32)

    def rows(self, name: str, shape: tuple[int, int]):  # -> Int8Rows [out, in]
        from engine.model_store.checkpoint import CheckpointError

        r = self.get(name)
        if tuple(r.q.shape) != shape:
            raise CheckpointError(f"{self.config.architecture}: tensor {name} has shape {tuple(r.q.shape)}, expected {shape}")
        return r

    def tensor(self, name: str, shape: tuple[int]) -> np.ndarray:
        from engine.model_store.checkpoint import CheckpointError

        v = self.get(name)
        if tuple(v.shape) != shape:
            raise CheckpointError(f"{self.config.architecture}: tensor {name} has shape {tuple(v.shape)}, expected {shape}")
        return np.asarray(v, np.float32)

    def vector(self, name: str, size: int) -> jax.Array:
        return self.place(self.tensor(name, (size,)))

    def by_kv_head(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [H * D, ...], k/v [K * D, ...] rows -> [K * (G + 2) * D, ...]: per kv head its G
        query heads, its key, its value (as checkpoint.load_weights lays out w_qkv's columns)."""
        c = self.config
        K, D, g, rest = c.n_kv_heads, c.head_dim, c.n_heads // c.n_kv_heads, q.shape[1:]
        parts = [q.reshape(K, g, D, *rest), k.reshape(K, 1, D, *rest), v.reshape(K, 1, D, *rest)]
        return np.concatenate(parts, axis=1).reshape(K * (g + 2) * D, *rest)

    def qkv(self, p: str) -> Int8Matrix:
        c, a = self.config, p + "self_attn."
        E, HD, KD = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return fused_rows(self.by_kv_head, self.rows(a + "q_proj.weight", (HD, E)),
                          self.rows(a + "k_proj.weight", (KD, E)), self.rows(a + "v_proj.weight", (KD, E)))

    def qkv_bias(self, p: str) -> np.ndarray:  # [K * (G + 2) * D]
        c, a = self.config, p + "self_attn."
        HD, KD = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        return self.by_kv_head(self.tensor(a + "q_proj.bias", (HD,)), self.tensor(a + "k_proj.bias", (KD,)),
                               self.tensor(a + "v_proj.bias", (KD,)))

    def o(self, p: str) -> Int8Matrix:
        c = self.config
        return fused_rows(lambda x: x, self.rows(p + "self_attn.o_proj.weight", (c.hidden_size, c.n_heads * c.head_dim)))

    def gate_up(self, p: str) -> Int8Matrix:  # rows 2f, 2f + 1: feature f's gate, up
        E, F = self.config.hidden_size, self.config.ffn_size
        interleave = lambda x, y: np.stack([x, y], axis=1).reshape(2 * F, -1)  # noqa: E731
        return fused_rows(interleave, self.rows(p + "mlp.gate_proj.weight", (F, E)), self.rows(p + "mlp.up_proj.weight", (F, E)))

    def down(self, p: str) -> Int8Matrix:
        c = self.config
        return fused_rows(lambda x: x, self.rows(p + "mlp.down_proj.weight", (c.hidden_size, c.ffn_size)))


def fused_rows(join, *parts) -> Int8Matrix:
    """One Int8Matrix of `parts` (engine.model_store.gguf_blocks.Int8Rows) whose rows `join`
    combines: 4 (or 5) bits when every part has 4 (or 5, all with offsets or none), else 8
    (module docstring); offsets when any part has them."""
    f = fused_format(*(r.format for r in parts))
    offsets = join(*(np.zeros_like(r.scale) if r.offset is None else r.offset for r in parts)) if f.offset else None
    return pack(join(*(r.q for r in parts)), join(*(r.scale for r in parts)), offsets, f.bits)


def scaled(m: Int8Matrix, factor: float) -> Int8Matrix:
    """m's values times `factor`, sharing its integers: its scales and offsets multiplied, in
    float32 so that each value is the float32 load's (dequantized, then scaled) to a rounding.
    For an embedding stored scaled (Gemma's sqrt(hidden)) whose head is the same matrix unscaled:
    the big array is held once, the copy is its scales. Only `embed` reads it (the kernels read
    float16 scales; never give it to `matmul`)."""
    times = lambda a: None if a is None else (a.astype(jnp.float32) * np.float32(factor))  # noqa: E731
    return Int8Matrix(m.packed, times(m.scale), m.n, times(m.offset), m.bits, m.high)


def gguf_weights(get, config, head_size: int):
    """engine.model_store.checkpoint.Weights built from `get`
    (engine.model_store.gguf_blocks.int8_tensor_reader: a matrix as Int8Rows [out, in], a vector
    as float32) by the config's family's own layer loader over a GGUFInt8Reader, each matrix
    placed on the device as it is read. A family whose embedding is stored scaled (Gemma) gets
    it as `scaled` rows of the head's matrix."""
    from engine.model_store import families
    from engine.model_store.checkpoint import Weights

    c = config
    family, read = families.FAMILIES[c.architecture], GGUFInt8Reader(get, c)
    e = read.rows("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    embed = fused_rows(lambda a: a, e)
    if c.tie_word_embeddings:
        head = embed if head_size == c.vocab_size else fused_rows(lambda a: a[:head_size], e)
    else:
        head = fused_rows(lambda a: a[:head_size], read.rows("lm_head.weight", (c.vocab_size, c.hidden_size)))
    if family.embed_scale:
        embed = scaled(embed, family.embed_scale(c))
    return Weights(
        embed=embed,
        layers=tuple(family.layer(read, f"model.layers.{i}.") for i in range(c.n_layers)),
        final_norm=read.vector("model.norm.weight", c.hidden_size),
        lm_head=head,
    )


@dataclass(frozen=True)
class Int8Layout:
    """The block format of every matrix `gguf_weights` places: per layer (w_qkv, w_o, w_gate_up,
    w_down), the embedding and the head (the memory check at load counts their bytes)."""

    layers: tuple[tuple[BlockFormat, ...], ...]  # per layer, LAYER_MATRICES' order
    embed: BlockFormat
    head: BlockFormat


def gguf_layout(formats: dict[str, BlockFormat], config) -> Int8Layout:
    """`gguf_weights`' formats from the GGUF's (engine.model_store.gguf_blocks.block_formats),
    with its fusions."""
    def layer(p: str) -> tuple[BlockFormat, ...]:
        return tuple(fused_format(*(formats[p + n] for n in names)) for _, names in LAYER_MATRICES)

    embed = formats["model.embed_tokens.weight"]
    head = embed if config.tie_word_embeddings else formats["lm_head.weight"]
    return Int8Layout(tuple(layer(f"model.layers.{i}.") for i in range(config.n_layers)), embed, head)


def weight_bytes(tree) -> int:
    """Bytes of the distinct arrays in a pytree of weights (a shared head counted once)."""
    return sum({id(leaf): leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree)}.values())
