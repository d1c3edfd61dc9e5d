"""engine.jax_backend.ragged_attention: the paged Pallas decode-attention kernel (on the CPU in
Pallas interpret mode; on a GPU host the same tests run it compiled by Triton) equals the
plain-JAX reference, which gathers each row's pages through its block table, for ragged lengths,
lengths ending on and one past a page boundary, shuffled pages, two rows sharing pages, idle
rows, GQA at SmolLM2's (H/K = 3) and Llama-3.1-8B's (H/K = 4) head shapes, page sizes 16 and 32,
several block and split sizes, in float32 and bfloat16; stale or NaN contents of the pool that
no row reads (the null page, pages' unwritten tails, free pages) never reach it; and JAX's
Triton lowering accepts the kernel (cross-lowered for CUDA).

No GPU runs in CI, so there the Triton code is lowered but never compiled or run. The shapes are
small (a handful of pages) because interpret mode runs every program one after another.

Tolerances: float32 within 1e-6 absolute + 1e-5 relative (the online softmax sums in another
order; products are exact float32; ~5e-7 seen). bfloat16 within 8e-3 absolute + 8e-3 relative,
two bf16 steps at outputs near 1 (~4e-3 seen): both sides read the same bf16 values, but the
kernel rounds its (unnormalised) probabilities to bf16 before the value product while the
reference keeps them float32, and both outputs are rounded to bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import ragged_attention
from support.lowering import host_syncs

TOL = {jnp.float32: dict(atol=1e-6, rtol=1e-5), jnp.bfloat16: dict(atol=8e-3, rtol=8e-3)}
INTERPRET = jax.default_backend() != "gpu"
WIDTH = 5  # table entries per row: every row below ends with null entries
kernel = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret"))
# the plain-JAX reference jitted: one executable per shape, where called op by op each of its
# operations compiled one of its own
reference = jax.jit(ragged_attention.reference)


def _layout(page: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Block tables [R, WIDTH] and lengths [R] over a pool of N pages whose ids are shuffled:
    row 0 ends one past a page boundary (2P + 1), row 1 is idle, row 2 ends on a boundary (2P),
    row 3 holds one key, row 4 shares row 0's first two pages and goes on in its own (3P + 5:
    mid-page). Entries past a row's pages are the null page 0; one page is held by nobody."""
    lengths = np.array([2 * page + 1, 0, 2 * page, 1, 3 * page + 5], np.int32)
    own = [3, 0, 2, 1, 2]  # pages each row holds alone
    n = 1 + sum(own) + 1
    ids = iter(np.random.default_rng(seed).permutation(np.arange(1, n)))
    tables = np.zeros((len(lengths), WIDTH), np.int32)
    for row, count in enumerate(own):
        tables[row, :count] = [next(ids) for _ in range(count)]
    tables[4, 2:4] = tables[4, :2]
    tables[4, :2] = tables[0, :2]  # the shared prefix
    assert all((tables[r, : -(-lengths[r] // page)] > 0).all() for r in range(len(lengths)))
    return tables, lengths, n


def _inputs(heads: int, kv_heads: int, head_dim: int, page: int, dtype, seed: int = 0):
    tables, lengths, n = _layout(page, seed)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(lengths), heads, head_dim), np.float32)
    k_pages = rng.standard_normal((kv_heads, n, page, head_dim), np.float32)
    v_pages = rng.standard_normal((kv_heads, n, page, head_dim), np.float32)
    q, k_pages, v_pages = (jnp.asarray(a, dtype) for a in (q, k_pages, v_pages))
    return q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, page, block_k, splits, dtype",
    [
        (9, 3, 64, 16, None, None, jnp.float32),  # SmolLM2's heads; default block (4 pages) and splits
        (9, 3, 64, 16, 16, 3, jnp.float32),  # a page per block, 3 splits (the table padded to 6 entries)
        (9, 3, 64, 32, None, None, jnp.bfloat16),  # page 32: two pages per block
        (32, 8, 128, 16, None, None, jnp.bfloat16),  # Llama-3.1-8B's heads
        (32, 8, 128, 32, 32, 2, jnp.float32),  # a page per block, one row's keys in both splits
    ],
)
def test_kernel_equals_the_gathering_reference(heads, kv_heads, head_dim, page, block_k, splits, dtype):
    q, k_pages, v_pages, tables, lengths = _inputs(heads, kv_heads, head_dim, page, dtype)
    got = kernel(q, k_pages, v_pages, tables, lengths, block_k=block_k, splits=splits, interpret=INTERPRET)
    assert got.shape == (len(lengths), heads * head_dim) and got.dtype == dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[lengths == 0], 0.0)  # an idle row: zeros, never NaN
    want = np.asarray(reference(q, k_pages, v_pages, tables, lengths), np.float32)
    np.testing.assert_allclose(got, want, **TOL[dtype])


def test_the_reference_reads_the_pages_the_tables_name():
    """The reference itself, against attention written out by hand for row 4 (shared pages, then
    its own, mid-page), so the kernel is not checked against a gather with the same mistake."""
    q, k_pages, v_pages, tables, lengths = _inputs(4, 2, 16, 16, jnp.float32)
    row, length, g = 4, int(lengths[4]), 2
    pos = np.arange(length)
    page_ids = np.asarray(tables)[row, pos // 16]  # [length]
    k = np.asarray(k_pages)[:, page_ids, pos % 16]  # [K, length, D]
    v = np.asarray(v_pages)[:, page_ids, pos % 16]
    qr = np.asarray(q)[row].reshape(2, g, 16)  # [K, G, D]
    scores = np.einsum("kgd,ksd->kgs", qr, k) / 4.0
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("kgs,ksd->kgd", probs / probs.sum(-1, keepdims=True), v).reshape(-1)
    got = np.asarray(reference(q, k_pages, v_pages, tables, lengths))
    np.testing.assert_allclose(got[row], want, atol=1e-5, rtol=1e-5)


def test_nothing_no_row_reads_reaches_the_output():
    """NaN in every pool position that no row's table and length reach (the null page, the tails
    of last pages, the free page) gives the same bits as a clean pool."""
    page = 16
    q, k_pages, v_pages, tables, lengths = _inputs(9, 3, 64, page, jnp.float32, seed=1)
    read = np.zeros(k_pages.shape[1:3], bool)  # [N, P]
    for table, length in zip(np.asarray(tables), np.asarray(lengths)):
        pos = np.arange(length)
        read[table[pos // page], pos % page] = True
    assert not read[0].any() and not read.all()
    args = dict(block_k=32, splits=2, interpret=INTERPRET)
    clean = np.asarray(kernel(q, k_pages, v_pages, tables, lengths, **args))
    stale = ~read[None, :, :, None]  # [1, N, P, 1]
    k_dirty, v_dirty = jnp.where(stale, jnp.nan, k_pages), jnp.where(stale, jnp.nan, v_pages)
    dirty = np.asarray(kernel(q, k_dirty, v_dirty, tables, lengths, **args))
    np.testing.assert_array_equal(dirty, clean)


def test_bad_shapes_fail_in_one_line():
    q = jnp.zeros((2, 4, 24), jnp.float32)
    pages = jnp.zeros((2, 4, 16, 24), jnp.float32)
    tables, lengths = jnp.zeros((2, 3), jnp.int32), jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ragged_attention.decode_attention(q, pages, pages, tables, lengths, interpret=True)
    q, pages = jnp.zeros((2, 4, 16)), jnp.zeros((2, 4, 12, 16))
    with pytest.raises(ValueError, match="page size 12"):
        ragged_attention.decode_attention(q, pages, pages, tables, lengths, interpret=True)
    pages = jnp.zeros((3, 4, 16, 16))
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        ragged_attention.decode_attention(q, pages, pages, tables, lengths, interpret=True)
    pages = jnp.zeros((2, 4, 16, 16))
    with pytest.raises(ValueError, match=r"must be \[2, W\] and \[2\]"):
        ragged_attention.decode_attention(q, pages, pages, tables[:1], lengths, interpret=True)
    assert ragged_attention.supported(128, 16) and ragged_attention.supported(64, 32)
    assert not ragged_attention.supported(24, 16) and not ragged_attention.supported(64, 12)
    assert not ragged_attention.supported(64, 2 * ragged_attention.MAX_PAGE)


def test_the_kernel_applies_on_a_gpu_only():
    on_gpu = jax.default_backend() == "gpu"
    assert ragged_attention.available() == ragged_attention.applies(64, 16) == on_gpu
    assert not ragged_attention.applies(64, 12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_lowers_for_a_cuda_gpu(dtype):
    """Cross-lowering from this CPU: JAX's Pallas Triton lowering accepts the kernel (power-of-two
    tensors, the page gather, supported ops) and emits one Triton call with grid (rows, kv heads,
    splits) at the 8B shape, 16-token pages, 1024 positions a row, and nothing around it that makes
    XLA:GPU wait on the host (interpret=None: the platform's pick is folded away). Triton's own
    compile to GPU code happens only on a GPU and is not tested here."""
    rows, heads, kv_heads, head_dim, page, pages = 8, 32, 8, 128, 16, 600
    q = jax.ShapeDtypeStruct((rows, heads, head_dim), dtype)
    pool = jax.ShapeDtypeStruct((kv_heads, pages, page, head_dim), dtype)
    tables = jax.ShapeDtypeStruct((rows, 1024 // page), jnp.int32)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    step = jax.jit(ragged_attention.decode_attention, static_argnames=("block_k", "splits", "interpret"))
    lowered = step.trace(q, pool, pool, tables, lengths).lower(lowering_platforms=("cuda",))
    assert host_syncs(lowered.compiler_ir("stablehlo")) == []
    text = lowered.as_text()
    assert text.count("xla.gpu.triton") == 1
    assert "grid_x = 8 : i32, grid_y = 8 : i32, grid_z = 4 : i32" in text  # 8 x 8 x 4 splits = 256 programs
