"""A GGUF's matrices (llama or Gemma 3) as int8 blocks, for `--weights int8`, read without a float32 copy.

`engine.model_store.gguf_convert` keeps the GGUF a directory was converted from as `model.gguf`;
`engine.jax_backend.weights.load_int8` reads its matrices through `int8_tensor_reader`. The
llama.cpp types whose blocks are 32 small integers with a float16 scale map onto int8 blocks
exactly, with no float32 round trip: Q8_0 and Q5_0 (w = d * q) as the integers and d; Q4_1 and
Q5_1 (w = d * q + m, q unsigned) as the integers, d and the block's offset m (an Int8Rows with
`offset`; the kernel adds m times the sum of the block's inputs); Q4_0 (w = d * (q - 8)) as its
unsigned q with offset -8 d. Q4_0 and Q4_1 stay 4-bit (`bits` 4: engine.jax_backend.quantize),
Q5_0 and Q5_1 5-bit (`bits` 5: Q5_0's q - 16 signed, Q5_1's q unsigned with its m), so a decode
step reads the file's own bytes a block rather than their widening to 34 or 36. The reader still
hands every type's integers one int8 a value, [N, K], whatever its bits: a tensor is in memory
alone and briefly, and the fusions (q/k/v per kv head, gate and up interleaved, a head's rows
cut, llama's q and k rows permuted) move whole rows of it; engine.jax_backend.quantize.pack splits
them into nibbles and fifth bits once the rows are in their place.
So the weights served are the file's own values, the ones a float32 load of the same file holds.
Q4_K's sub-blocks of 32 (w = d * sc * q - dmin * m) are 4-bit blocks with an offset too, whose
scale d * sc and offset -dmin * m are rounded to float16: the one difference from the file's
values. Any other type (Q6_K, whose sub-blocks of 16 have scales of their own that no block of 32
holds; F16, F32, ...) is dequantized a chunk of rows at a time and requantized by the caller's
function. The file is memory-mapped, so only the tensor being read, and for a
requantized one only a chunk of it in float32, is in memory. No JAX here (the model store's
rule): the caller places the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from engine.model_store.gguf_convert import GGUFConversionError, dequantize_tensor, tensor_map
from engine.model_store.gguf_reader import open_gguf


INT8_BLOCK = 32  # the blocks of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, and of engine.jax_backend.quantize.Int8Matrix
_ROWS_PER_CHUNK = 4096  # a requantized tensor is dequantized this many rows at a time
Requantize = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # [N, K] f32 -> (q int8, scale f32)


@dataclass(frozen=True)
class Int8Rows:
    """A GGUF matrix as int8 blocks along its input, row n being output n (GGUF's own order, HF's
    [out, in]): W[n, j] = q[n, j] * scale[n, j // 32] (+ offset[n, j // 32] where there is one)."""

    q: np.ndarray  # [N, K] int8 (0..15 when bits is 4; -16..15, or 0..31 with an offset, when 5)
    scale: np.ndarray  # [N, K / 32] float16 (the GGUF's own d for the exact types)
    offset: np.ndarray | None = None  # [N, K / 32] float16: Q4_1's and Q5_1's m, Q4_0's -8 d; None: no offset
    bits: int = 8  # 4: q fits 4 bits (Q4_0, Q4_1, Q4_K), and is held so; 5: likewise 5 (Q5_0, Q5_1); 8 otherwise

    @property
    def format(self) -> "BlockFormat":
        return BlockFormat(self.bits, self.offset is not None)


@dataclass(frozen=True)
class BlockFormat:
    """How a matrix's blocks of 32 are held: integers of `bits`, a float16 scale, and a float16
    offset when `offset` (engine.jax_backend.quantize)."""

    bits: int = 8
    offset: bool = False

    @property
    def block_bytes(self) -> int:
        return INT8_BLOCK * self.bits // 8 + 2 + (2 if self.offset else 0)


SYMMETRIC = BlockFormat()  # 8 bits, a scale: Q8_0 and every requantized type


def fused_format(*formats: BlockFormat) -> BlockFormat:
    """The format of a matrix fused from parts (q/k/v, gate/up): 4 or 5 bits only when every part
    has them (5: and every part an offset, or none: a 5-bit matrix's integers are signed exactly
    when it has no offsets), else 8; an offset when any part has one."""
    bits = {f.bits for f in formats}
    same = len(bits) == 1 and (bits != {5} or len({f.offset for f in formats}) == 1)
    return BlockFormat(bits.pop() if same else 8, any(f.offset for f in formats))


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at bytes at..at+1 of every block: [..., bytes] uint8 -> [...] float16."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values 0..15: element i in the low nibble of byte i, element 16 + i
    in its high nibble (ggml's Q4/Q5 order)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's 4 bytes a block (a little-endian uint32, bit i for element i) -> 32 values 0 or 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32], bit i of the uint32 at i
    return bits * np.uint8(16)


def _q8_0_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q8_0 blocks (f16 d, 32 int8) -> the same integers and the same d."""
    blocks = data.reshape(n, k // INT8_BLOCK, 2 + INT8_BLOCK)  # uint8
    return Int8Rows(blocks[..., 2:].copy().view(np.int8).reshape(n, k), _halves(blocks, 0))


def _q4_0_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q4_0 blocks (f16 d, 16 bytes of nibbles; w = d * (nibble - 8)) -> q = nibble in [0, 15], d,
    offset -8 d (exact: a power-of-two multiple of a float16 short of its largest values)."""
    blocks = data.reshape(n, k // INT8_BLOCK, 2 + INT8_BLOCK // 2)
    q, d = _nibbles(blocks[..., 2:]).astype(np.int8).reshape(n, k), _halves(blocks, 0)
    with np.errstate(over="ignore"):
        offset = d * np.float16(-8)
    if not np.isfinite(offset).all():  # |d| > 8190: weights past +-65,000, in no model seen
        raise GGUFConversionError("a Q4_0 block scale too large for its offset (-8 d) in float16")
    return Int8Rows(q, d, offset, bits=4)


def _q4_1_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles; w = d * nibble + m) -> q = nibble in
    [0, 15], d, offset m."""
    blocks = data.reshape(n, k // INT8_BLOCK, 4 + INT8_BLOCK // 2)
    q = _nibbles(blocks[..., 4:]).astype(np.int8)
    return Int8Rows(q.reshape(n, k), _halves(blocks, 0), _halves(blocks, 2), bits=4)


def _q5_0_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q5_0 blocks (f16 d, 4 bytes of fifth bits, 16 of nibbles; w = d * (q5 - 16)) -> q = q5 - 16
    in [-16, 15], d, held in 5 bits."""
    blocks = data.reshape(n, k // INT8_BLOCK, 6 + INT8_BLOCK // 2)
    q5 = _nibbles(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6])
    return Int8Rows((q5.astype(np.int8) - np.int8(16)).reshape(n, k), _halves(blocks, 0), bits=5)


def _q5_1_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q5_1 blocks (f16 d, f16 m, 4 bytes of fifth bits, 16 of nibbles; w = d * q5 + m) -> q = q5
    in [0, 31], d, offset m, held in 5 bits."""
    blocks = data.reshape(n, k // INT8_BLOCK, 8 + INT8_BLOCK // 2)
    q5 = _nibbles(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8])
    return Int8Rows(q5.astype(np.int8).reshape(n, k), _halves(blocks, 0), _halves(blocks, 2), bits=5)


def _q4_k_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q4_K super-blocks of 256 values (f16 d, f16 dmin, 12 bytes holding a 6-bit scale sc and
    min m for each of 8 sub-blocks of 32, 128 bytes of nibbles; w = d * sc * q - dmin * m) -> per
    sub-block q = the nibble, scale d * sc and offset -dmin * m. The two products are rounded to
    float16, the one rounding (a relative 2^-11 of each), against requantizing to 8 bits, which
    moves a weight by up to half a step of max|block| / 127."""
    blocks = data.reshape(n, k // 256, 144)
    d, dmin = (_halves(blocks, at).astype(np.float32)[..., None] for at in (0, 2))  # [N, S, 1]
    low, high, rest = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]  # [N, S, 4] each
    # sub-blocks 0-3: the low 6 bits of `low` (sc) and `high` (m); 4-7: `rest`'s nibbles, with the
    # top 2 bits of `low` and `high` as their bits 4-5
    sc = np.concatenate([low & 0x3F, (rest & 0x0F) | (low >> 6) << 4], axis=-1)  # [N, S, 8]
    m = np.concatenate([high & 0x3F, rest >> 4 | (high >> 6) << 4], axis=-1)  # [N, S, 8]
    nibbles = blocks[..., 16:].reshape(n, k // 256, 4, 1, 32)  # 32 bytes per pair of sub-blocks
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3)  # [N, S, 4, 2, 32]: sub-block 2c low, 2c + 1 high
    scale = (d * sc).astype(np.float16).reshape(n, k // INT8_BLOCK)
    offset = (-(dmin * m)).astype(np.float16).reshape(n, k // INT8_BLOCK)
    return Int8Rows(q.astype(np.int8).reshape(n, k), scale, offset, bits=4)


_T = gguf.GGMLQuantizationType
EXACT_INT8 = {_T.Q8_0: _q8_0_rows, _T.Q4_0: _q4_0_rows, _T.Q4_1: _q4_1_rows, _T.Q5_0: _q5_0_rows, _T.Q5_1: _q5_1_rows}
# types mapped onto blocks of 32 with their scale and offset rounded to float16, not requantized
ROUNDED = {_T.Q4_K: _q4_k_rows}
WITH_OFFSET = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_1, _T.Q4_K})  # the mapped types whose blocks carry an offset
BITS = {_T.Q4_0: 4, _T.Q4_1: 4, _T.Q4_K: 4, _T.Q5_0: 5, _T.Q5_1: 5}  # the mapped types held in fewer than 8 bits


def int8_rows(t: gguf.ReaderTensor, requantize: Requantize) -> Int8Rows:
    """A GGUF matrix as int8 blocks without the whole tensor ever in float32 (nor the model).

    The EXACT_INT8 types map onto int8 blocks exactly (same integers, same scales, Q4_1's and
    Q5_1's offsets); Q4_K's sub-blocks of 32 map onto 4-bit blocks with their scales and offsets
    rounded to float16 (ROUNDED). Any other type that `gguf` can dequantize (K-quants, F16, F32, ...) is
    dequantized _ROWS_PER_CHUNK rows at a time and each chunk handed to `requantize` (blocks of
    32 along the input, symmetric), so a weight comes back within half a step, max|block| / 254.
    """
    if len(t.shape) != 2:
        raise GGUFConversionError(f"tensor {t.name!r} has {len(t.shape)} dims, expected a matrix")
    k, n = (int(d) for d in t.shape)  # GGUF lists the input dim first
    if k % INT8_BLOCK:
        raise GGUFConversionError(f"tensor {t.name!r}: int8 blocks need rows of a multiple of {INT8_BLOCK}, got {k}")
    data = np.asarray(t.data)
    if t.tensor_type in EXACT_INT8:
        return EXACT_INT8[t.tensor_type](data, n, k)
    if t.tensor_type in ROUNDED:
        return ROUNDED[t.tensor_type](data, n, k)
    q = np.empty((n, k), np.int8)
    scale = np.empty((n, k // INT8_BLOCK), np.float16)
    for start in range(0, n, _ROWS_PER_CHUNK):
        stop = min(n, start + _ROWS_PER_CHUNK)
        try:
            rows = gguf.quants.dequantize(data[start:stop], t.tensor_type)
        except NotImplementedError as e:
            raise GGUFConversionError(f"tensor {t.name!r} has unsupported type {t.tensor_type.name}") from e
        q[start:stop], scale[start:stop] = requantize(np.asarray(rows, np.float32).reshape(stop - start, k))
    return Int8Rows(q, scale)


# The reader `block_formats` opened, kept for the `int8_tensor_reader` of the same load, which
# takes it (so nothing holds it past the load). gguf-py parses the whole header into numpy views,
# one per element of every array (a 262k-id vocabulary makes most of a million), which takes
# seconds of CPU for Gemma 3's even as gguf_reader.GGUFFile: a load that checks its memory and
# then reads would parse it twice.
_handed_over: tuple[tuple, gguf.GGUFReader] | None = None


def _file_key(gguf_path: Path | str) -> tuple:
    st = Path(gguf_path).stat()
    return str(Path(gguf_path).resolve()), st.st_size, st.st_mtime_ns


def block_formats(gguf_path: Path | str) -> dict[str, BlockFormat]:
    """HF matrix name -> the format `int8_tensor_reader` gives it, from the GGUF's header alone
    (the memory check at load counts the bytes before anything is read)."""
    global _handed_over
    formats = {}
    reader = open_gguf(gguf_path)
    _handed_over = (_file_key(gguf_path), reader)
    hf_name = tensor_map(reader).hf_name
    for t in reader.tensors:
        if len(t.shape) == 2:
            formats[hf_name(t.name)] = BlockFormat(BITS.get(t.tensor_type, 8), t.tensor_type in WITH_OFFSET)
    return formats


def int8_tensor_reader(gguf_path: Path | str, requantize: Requantize) -> Callable[[str], np.ndarray | Int8Rows]:
    """HF tensor name -> what `--weights int8` holds for it, read from the GGUF as it is asked for:
    a matrix as `Int8Rows` (rows in HF's order, as gguf_convert.hf_tensors puts them), a vector as
    float32 (a Gemma norm less llama.cpp's +1, likewise). The reader memory-maps the file, so only
    the tensor being read is in memory."""
    global _handed_over
    kept, _handed_over = _handed_over, None
    reader = kept[1] if kept and kept[0] == _file_key(gguf_path) else open_gguf(gguf_path)
    tmap = tensor_map(reader)
    by_name = {tmap.hf_name(t.name): t for t in reader.tensors}

    def get(name: str) -> np.ndarray | Int8Rows:
        if name not in by_name:
            raise GGUFConversionError(f"tensor {name} missing from {gguf_path}")
        t = by_name[name]
        if len(t.shape) == 1:
            return tmap.fix_vector(name, dequantize_tensor(t))
        rows = int8_rows(t, requantize)
        # a row permutation (llama's q and k): whole rows, blocks, scales and offsets move together
        moved = (None if a is None else tmap.fix_rows(name, a) for a in (rows.q, rows.scale, rows.offset))
        return Int8Rows(*moved, bits=rows.bits)

    return get
