"""A llama GGUF's matrices as int8 blocks, for `--weights int8`, read without a float32 copy.

`engine.model_store.gguf_convert` keeps the GGUF a directory was converted from as `model.gguf`;
`engine.jax_backend.weights.load_int8` reads its matrices through `int8_tensor_reader`: Q8_0 and
Q4_0 blocks map onto int8 blocks exactly (the same integers and scales), any other type (Q4_1,
K-quants, F16, F32) is dequantized a chunk of rows at a time and requantized by the caller's
function. The file is memory-mapped, so only the tensor being read, and for a requantized one
only a chunk of it in float32, is in memory. No JAX here (the model store's rule): the caller
places the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from engine.model_store.gguf_convert import (
    GGUFConversionError,
    dequantize_tensor,
    hf_tensor_name,
    read_llama_hparams,
    unpermute_rope_rows,
)


INT8_BLOCK = 32  # the blocks of Q8_0, Q4_0 and Q4_1, and of engine.jax_backend.quantize.Int8Matrix
_ROWS_PER_CHUNK = 4096  # a requantized tensor is dequantized this many rows at a time
Requantize = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # [N, K] f32 -> (q int8, scale f32)


@dataclass(frozen=True)
class Int8Rows:
    """A GGUF matrix as int8 blocks along its input, row n being output n (GGUF's own order, HF's
    [out, in]): W[n, j] = q[n, j] * scale[n, j // 32]."""

    q: np.ndarray  # [N, K] int8
    scale: np.ndarray  # [N, K / 32] float16 (the GGUF's own for Q8_0 and Q4_0)


def _q8_0_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q8_0 blocks (f16 d, 32 int8) -> the same integers and the same d: exact."""
    blocks = data.reshape(n, k // INT8_BLOCK, 2 + INT8_BLOCK)  # uint8
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]  # [N, K / 32]
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Int8Rows(q, scale)


def _q4_0_rows(data: np.ndarray, n: int, k: int) -> Int8Rows:
    """Q4_0 blocks (f16 d, 16 bytes: element i in the low nibble of byte i, element 16 + i in its
    high nibble; w = d * (nibble - 8)) -> q = nibble - 8 in [-8, 7], scale = d: exact."""
    blocks = data.reshape(n, k // INT8_BLOCK, 2 + INT8_BLOCK // 2)
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    packed = blocks[..., 2:]  # [N, K / 32, 16]
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [N, K / 32, 32]
    q = (nibbles.astype(np.int8) - np.int8(8)).reshape(n, k)
    return Int8Rows(q, scale)


_EXACT_INT8 = {gguf.GGMLQuantizationType.Q8_0: _q8_0_rows, gguf.GGMLQuantizationType.Q4_0: _q4_0_rows}


def int8_rows(t: gguf.ReaderTensor, requantize: Requantize) -> Int8Rows:
    """A GGUF matrix as int8 blocks without the whole tensor ever in float32 (nor the model).

    Q8_0 and Q4_0 map onto int8 blocks exactly (same integers, same scales). Any other type that
    `gguf` can dequantize (Q4_1, K-quants, F16, F32, ...) is dequantized _ROWS_PER_CHUNK rows at a
    time and each chunk handed to `requantize` (blocks of 32 along the input, symmetric), so a
    Q4_1 weight w = d * nibble + m comes back within half a step, max|block| / 254, of w.
    """
    if len(t.shape) != 2:
        raise GGUFConversionError(f"tensor {t.name!r} has {len(t.shape)} dims, expected a matrix")
    k, n = (int(d) for d in t.shape)  # GGUF lists the input dim first
    if k % INT8_BLOCK:
        raise GGUFConversionError(f"tensor {t.name!r}: int8 blocks need rows of a multiple of {INT8_BLOCK}, got {k}")
    data = np.asarray(t.data)
    if t.tensor_type in _EXACT_INT8:
        return _EXACT_INT8[t.tensor_type](data, n, k)
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


def int8_tensor_reader(gguf_path: Path | str, requantize: Requantize) -> Callable[[str], np.ndarray | Int8Rows]:
    """HF tensor name -> what `--weights int8` holds for it, read from the GGUF as it is asked for:
    a matrix as `Int8Rows` (q and k rows un-permuted, as gguf_convert.convert_tensors does), a vector as
    float32. The reader memory-maps the file, so only the tensor being read is in memory."""
    reader = gguf.GGUFReader(gguf_path, "r")
    hp = read_llama_hparams(reader)
    by_name = {hf_tensor_name(t.name): t for t in reader.tensors}

    def get(name: str) -> np.ndarray | Int8Rows:
        if name not in by_name:
            raise GGUFConversionError(f"tensor {name} missing from {gguf_path}")
        t = by_name[name]
        if len(t.shape) == 1:
            return dequantize_tensor(t)
        rows = int8_rows(t, requantize)
        heads = {"self_attn.q_proj.weight": hp.num_attention_heads, "self_attn.k_proj.weight": hp.num_key_value_heads}
        for suffix, n_heads in heads.items():
            if name.endswith(suffix):  # a row permutation: whole rows, blocks and scales move together
                rows = Int8Rows(unpermute_rope_rows(rows.q, n_heads), unpermute_rope_rows(rows.scale, n_heads))
        return rows

    return get
