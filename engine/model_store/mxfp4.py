"""MXFP4 weights (the OCP microscaling format gpt-oss ships its experts in) unpacked to float32
at load; numpy only.

On disk a matrix [..., out, in] is two uint8 tensors: `*_blocks` [..., out, in / 32, 16], each
byte two 4-bit e2m1 values (the low nibble the even element, the high nibble the odd one), and
`*_scales` [..., out, in / 32], one power-of-two exponent per 32 values with a bias of 127. An
e2m1 code is a sign bit and the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (`E2M1`); value = code's
magnitude x 2 ** (scale - 127). Every product of the two is exact in float32 (and in bfloat16)
for the exponents checkpoints use, so the unpacked weights are the packed ones, not a rounding of
them (tests/test_gpt_oss.py compares with transformers' own dequantization bit for bit).
Where the two matrices sit in a gpt-oss checkpoint: engine.model_store.families.gpt_oss.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per scale
SCALE_BIAS = 127
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)  # by 4-bit code: the sign is the code's top bit


def unpack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] float32 (G groups of
    32 values along the last axis). ValueError naming what does not fit."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1:] != (BLOCK // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape}: want [..., G, 16] and [..., G]")
    values = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1)  # [..., G, 16, 2]: low nibble first
    values = values.reshape(*scales.shape, BLOCK)  # [..., G, 32]
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS  # [..., G, 1]
    return np.ldexp(values, exponents).astype(np.float32).reshape(*scales.shape[:-1], -1)  # [..., G * 32]

