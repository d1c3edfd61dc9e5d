"""Claims that hold on XLA:CPU in float32 only, and the one place that says so.

Greedy ids equal to transformers' goldens, bit-equal ids whatever the batch's shape (batch
invariance), whole and chunked prefill giving the same ids, and HLO text with f32[...] shapes: on
XLA:CPU in float32 these hold and the tests assert them exactly. On a GPU the default dtype is
bfloat16, float32 products may run as TF32, and a GEMM's kernel (so its rounding) changes with the
row count, so none of them is promised there. Such tests pin float32 themselves and skip, with
this reason, when JAX's default backend is not the CPU (the backend cannot be switched once it has
started). tests/test_bfloat16.py bounds bfloat16 against float32 on whatever backend runs.
"""

from __future__ import annotations

import pytest

CPU_FLOAT32_ONLY = (
    "holds on XLA:CPU in float32 only: on a GPU the default dtype is bfloat16, float32 products may "
    "run as TF32, and a GEMM's kernel (so its rounding) changes with the row count (tests/support/backend.py)"
)


def require_cpu() -> None:
    """Skip the calling test (or fixture), saying why, unless JAX's default backend is the CPU."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip(f"{jax.default_backend()} backend: this {CPU_FLOAT32_ONLY}")
