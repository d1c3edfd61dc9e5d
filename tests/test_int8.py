"""Weight-only int8 (`--weights int8`, engine.jax_backend.quantize) and the threads of the CPU
weight products: products against float32, greedy ids of a tiny checkpoint, memory, compiles
after warm-up, the thread count, and the refusals; int8 read straight from a GGUF
(engine.model_store.gguf_blocks: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 exact, Q4_1's and Q5_1's with
their block offsets, the 4- and 5-bit ones held so, their products the int8 widening's bits; F16
requantized within half a step), written here with `gguf.GGUFWriter`
(tests/support/tiny_gguf.py). The real default model's agreement gate is in tests/test_real_model.py,
which loads its int8 weights once for all its tests."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import tiny_gguf, tiny_served
from support.greedy import greedy_ids
from support.pool_threads import on_threads

from engine.jax_backend import cpu_kernels, quantize
from engine.jax_backend import weights as weights_mod
from engine.jax_backend.jax_model import JaxModel
from engine.model_store import gguf_blocks, gguf_convert
from engine.model_store.gguf_convert import convert_gguf

ASSETS = Path(__file__).parent / "assets"
T = gguf.GGMLQuantizationType

pytestmark = pytest.mark.usefixtures("loaded_kernels")  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them


def _int8(w: np.ndarray) -> quantize.Int8Matrix:  # w [in, out], as x @ w
    return quantize.pack(*quantize.quantize_rows(np.ascontiguousarray(w.T)))


def _activations_quantized(x: np.ndarray, m: quantize.Int8Matrix) -> np.ndarray:
    """What the kernel computes on either path, in float64: each row of x as int16 blocks of 32
    (scale max |x| / 32767, round half to even in float32, as the kernel does), integer dots with q's blocks,
    times both scales; plus, with offsets, each offset times the sum of its block's quantized
    inputs (times their scale)."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    inverse = np.divide(np.float32(32767), amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(blocks * inverse[..., None]).astype(np.int64)
    q, scale = (np.asarray(a) for a in m.rows())
    dots = np.einsum("rbj,nbj->rnb", xq, q.reshape(-1, k // 32, 32).astype(np.int64)).astype(np.float64)
    sx = amax.astype(np.float64) / 32767
    y = np.einsum("rnb,nb,rb->rn", dots, scale.astype(np.float64), sx)
    if m.offset is not None:
        y += np.einsum("nb,rb->rn", np.asarray(m.offsets()).astype(np.float64), xq.sum(axis=-1) * sx)
    return y


@pytest.fixture(params=["avx512vnni", "avx2"])
def int8_isa(request):
    """Each path of the int8 kernel in turn (AVX2 everywhere; VNNI where the CPU has it)."""
    kernels = cpu_kernels.load()
    if cpu_kernels.int8_matmul_isa(kernels, request.param == "avx512vnni") != request.param:
        cpu_kernels.int8_matmul_isa(kernels, True)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    cpu_kernels.int8_matmul_isa(kernels, True)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, quantize.DIRECT_ROWS, quantize.DIRECT_ROWS + 1, 2 * quantize.DIRECT_ROWS + 3,
                                  quantize.SLICED_ROWS + 1])
def test_an_int8_product_is_within_2e_2_of_float32(rows, int8_isa):
    """Every path (panels of 16 outputs with a tail of 11 outputs, one row, a few and rows past
    the 12-row passes, the kernel in slices of DIRECT_ROWS rows with a short last one, and the
    many-row dequantize + GEMM) is its exact product to float rounding: the dequantized weights
    times x quantized to int16 blocks (either path of the kernel, up to SLICED_ROWS rows; within
    1e-4 of x itself too), or times x (the GEMM); and within the issue's 2e-2 relative error of
    the float32 product."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 203)).astype(np.float32) * 0.05  # 203 outputs: a part-filled last panel
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    m = _int8(w)
    got = np.asarray(jax.jit(quantize.matmul)(jnp.asarray(x), m))
    if rows <= quantize.SLICED_ROWS:
        exact = _activations_quantized(x, m)
    else:
        exact = x @ np.asarray(quantize.dequantize(m)).T
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, x @ np.asarray(quantize.dequantize(m)).T, rtol=1e-4, atol=1e-4)
    assert np.linalg.norm(got - x @ w) / np.linalg.norm(x @ w) <= 2e-2


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 12, 13, quantize.DIRECT_ROWS + 1, quantize.SLICED_ROWS + 1])
def test_blocks_with_offsets_give_their_exact_product(rows, bits, int8_isa):
    """Blocks w = scale * q + offset with q in 0..15 (a GGUF's Q4_1), held in 8 or in 4 bits:
    every path (one row, the VNNI row counts, the AVX2 several-row dequantized panel, the
    kernel in slices, the many-row GEMM) gives the product of exactly those values, to float rounding, with the
    offsets' share worked out separately."""
    rng = np.random.default_rng(rows)
    n, k = 203, 96
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    scale = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16)
    offset = (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
    offset[0, 0] = 0.0  # a block without one
    m = quantize.pack(q, scale, offset, bits)
    assert m.bits == bits and m.shape == (k, n) and m.packed.nbytes == -(-n // 16) * 16 * k * bits // 8
    np.testing.assert_array_equal(np.asarray(m.rows()[0]), q)
    values = np.asarray(quantize.dequantize(m))
    want = q.reshape(n, k // 32, 32) * scale[..., None].astype(np.float32) + offset[..., None].astype(np.float32)
    np.testing.assert_array_equal(values, want.reshape(n, k))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(quantize.matmul)(jnp.asarray(x), m))
    exact = _activations_quantized(x, m) if rows <= quantize.SLICED_ROWS else x @ values.T
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, x @ values.T, rtol=1e-4, atol=1e-4)
    without = np.asarray(jax.jit(quantize.matmul)(jnp.asarray(x), quantize.pack(q, scale)))
    share = x.reshape(rows, k // 32, 32).sum(axis=-1) @ offset.astype(np.float32).T  # [R, N]
    np.testing.assert_allclose(got - without, share, rtol=1e-4, atol=1e-4)


_integers = jax.jit(lambda m: m.rows()[0])  # one compile a shape, not one per operation
_embed = jax.jit(quantize.embed)
_matmul = jax.jit(quantize.matmul)


@pytest.mark.parametrize("signed", [True, False], ids=["q5_0", "q5_1"])
def test_5_bit_blocks_give_the_bits_of_their_int8_widening(signed, int8_isa):
    """Blocks of 5-bit integers (a GGUF's Q5_0: -16..15, no offset; Q5_1: 0..31 with offsets),
    held in 5 bits (nibbles and fifth-bit masks), give exactly the products, bit for bit, that
    the same blocks held as int8 give, on each path, for 1..13 rows (the VNNI tiles' row counts
    and sums per row, a 12-row pass and one more) and odd numbers of outputs (a part-filled last
    panel), and through `matmul` in slices and by the many-row GEMM; their rows, embedding lookups
    and bytes are those of 5 bits."""
    rng = np.random.default_rng(int(signed))
    for rows in (1, 2, 3, 5, 8, 12, 13):
        n, k = int(rng.integers(1, 48)) * 2 + 1, int(rng.integers(1, 6)) * 32
        q = rng.integers(-16, 16, (n, k)) if signed else rng.integers(0, 32, (n, k))
        q[0, :32] = -16 if signed else 31  # one block at an end of the range, one at the other
        q[-1, -32:] = 15 if signed else 0
        scale = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16)
        offset = None if signed else (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
        five, eight = quantize.pack(q.astype(np.int8), scale, offset, 5), quantize.pack(q.astype(np.int8), scale, offset, 8)
        assert five.bits == 5 and five.shape == (k, n) and five.high.dtype == jnp.uint32
        assert five.nbytes == -(-n // 16) * 16 * (k // 32) * (22 if signed else 24)  # the file's bytes a block
        np.testing.assert_array_equal(np.asarray(_integers(five)), q)
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        got, want = (np.asarray(cpu_kernels.int8_matmul(x, m.packed, m.scale, n, m.offset, m.high)) for m in (five, eight))
        np.testing.assert_array_equal(got, want, err_msg=f"{rows} rows, {n} outputs, {k} inputs")
        tokens = jnp.asarray([0, n // 2, n - 1])
        np.testing.assert_array_equal(np.asarray(_embed(five, tokens)), np.asarray(_embed(eight, tokens)))
    for rows in (quantize.DIRECT_ROWS + 1, quantize.SLICED_ROWS + 1):  # the last shape's matrices
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(_matmul(x, five)), np.asarray(_matmul(x, eight)), err_msg=f"{rows} rows")


def test_an_offset_of_another_shape_and_4_bits_without_one_are_refused():
    m = quantize.pack(np.zeros((16, 64), np.int8), np.ones((16, 2), np.float16), np.zeros((16, 2), np.float16))
    with pytest.raises(ValueError, match="offset of scale's shape"):
        cpu_kernels.int8_matmul(jnp.ones((1, 64)), m.packed, m.scale, m.n, m.offset[:, :1])
    four = quantize.pack(np.zeros((16, 64), np.int8), np.ones((16, 2), np.float16), np.zeros((16, 2), np.float16), 4)
    with pytest.raises(ValueError, match="4-bit blocks with an offset"):
        cpu_kernels.int8_matmul(jnp.ones((1, 64)), four.packed, four.scale, four.n)
    with pytest.raises(ValueError, match="0..15, with an offset"):
        quantize.pack(np.full((16, 64), 16, np.int8), np.ones((16, 2), np.float16), np.zeros((16, 2), np.float16), 4)
    with pytest.raises(ValueError, match="0..15, with an offset"):
        quantize.pack(np.zeros((16, 64), np.int8), np.ones((16, 2), np.float16), None, 4)
    with pytest.raises(ValueError, match="-16..15 without an offset, 0..31 with one"):
        quantize.pack(np.full((16, 64), 16, np.int8), np.ones((16, 2), np.float16), None, 5)
    with pytest.raises(ValueError, match="-16..15 without an offset, 0..31 with one"):
        quantize.pack(np.full((16, 64), -1, np.int8), np.ones((16, 2), np.float16), np.zeros((16, 2), np.float16), 5)


@pytest.mark.parametrize("bits", [8, 4])
def test_embedding_rows_are_the_blocks_values(bits):
    """An embedding's looked-up rows (quantize.embed, as the model reads them) equal the
    dequantized matrix's rows, in 8 and in 4 bits, a part-filled last panel included."""
    rng = np.random.default_rng(bits)
    n, k = 37, 64
    q = rng.integers(0, 16, (n, k)).astype(np.int8)
    scale = (rng.random((n, k // 32)) + 0.5).astype(np.float16)
    offset = (rng.random((n, k // 32)) - 0.5).astype(np.float16)
    m = quantize.pack(q, scale, offset, bits)
    tokens = jnp.asarray([[0, 5, 36], [17, 16, 1]])
    got = np.asarray(jax.jit(quantize.embed)(m, tokens))
    np.testing.assert_array_equal(got, np.asarray(quantize.dequantize(m))[np.asarray(tokens)])


def test_weights_of_minus_128_are_read_on_each_path(int8_isa):
    """A Q8_0 file may hold -128 (our quantizer never writes it): widened to int16 it multiplies
    like any other weight, and a block of x at its largest values saturates nothing."""
    q = np.full((8, 64), -128, np.int8)
    q[:, 1::2] = 127
    m = quantize.pack(q, np.full((8, 2), 0.5, np.float32))
    x = np.linspace(-1.0, 1.0, 2 * 64, dtype=np.float32).reshape(2, 64)
    got = np.asarray(jax.jit(quantize.matmul)(jnp.asarray(x), m))
    np.testing.assert_allclose(got, _activations_quantized(x, m), rtol=1e-5, atol=1e-5)


def test_the_avx2_path_gives_the_vnni_paths_bits():
    """The AVX2 path is the VNNI path's arithmetic in narrower vectors: the same products, bit for
    bit, for int8, 4- and 5-bit blocks with and without offsets, 1..13 rows (each tile's row count
    on both paths, and a pass of several) and a part-filled last panel, so a CPU's instruction set
    never changes an id. (Needs a CPU with both; elsewhere the products' tests above check the
    AVX2 path against the integers' own arithmetic.)"""
    kernels = cpu_kernels.load()
    if cpu_kernels.int8_matmul_isa(kernels, True) != "avx512vnni":
        pytest.skip("this CPU has no avx512vnni")
    rng = np.random.default_rng(7)
    n, k = 75, 160
    for bits, signed in ((8, True), (8, False), (4, False), (5, True), (5, False)):
        q = rng.integers(-16, 16, (n, k)) if signed else rng.integers(0, 16 if bits == 4 else 32, (n, k))
        if bits == 8 and signed:
            q = rng.integers(-128, 128, (n, k))
        scale = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float16)
        offset = None if signed else (-rng.random((n, k // 32)) * 0.08).astype(np.float16)
        m = quantize.pack(q.astype(np.int8), scale, offset, bits)
        for rows in range(1, 14):
            x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32) * rng.random((rows, 1)).astype(np.float32))
            got = {}
            try:
                for isa in ("avx2", "avx512vnni"):
                    assert cpu_kernels.int8_matmul_isa(kernels, isa == "avx512vnni") == isa
                    got[isa] = np.asarray(cpu_kernels.int8_matmul(x, m.packed, m.scale, n, m.offset, m.high))
            finally:
                cpu_kernels.int8_matmul_isa(kernels, True)
            np.testing.assert_array_equal(got["avx2"], got["avx512vnni"], err_msg=f"{bits} bits, {rows} rows")


def test_the_thread_count_is_respected():
    """set_threads(n) runs a product on n threads (the caller and n - 1 workers), and the result
    does not depend on n."""
    kernels = cpu_kernels.load()
    rng = np.random.default_rng(0)
    m = _int8(rng.standard_normal((1024, 8192)).astype(np.float32))  # ~1 ms: long enough for a worker to join
    panels = cpu_kernels.pack_panels(jnp.asarray(rng.standard_normal((1024, 4096)).astype(np.float32)))
    x = jnp.asarray(rng.standard_normal((1, 1024)).astype(np.float32))
    int8, panel = jax.jit(quantize.matmul), jax.jit(functools.partial(cpu_kernels.panel_matmul, n=4096))
    results = {}
    try:
        for threads in (1, 2):
            for product, fn, args in (("int8", int8, (x, m)), ("panel", panel, (x, panels))):
                results[product, threads] = on_threads(kernels, threads, lambda: np.asarray(jax.block_until_ready(fn(*args))))
    finally:
        cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
    np.testing.assert_array_equal(results["int8", 1], results["int8", 2])
    np.testing.assert_array_equal(results["panel", 1], results["panel", 2])




def test_int8_greedy_ids_follow_float32_with_a_quarter_of_the_bytes_and_no_compiles_after_warm_up():
    """tiny-llama (untied head), one row and three rows: fed float32's greedy ids, int8 picks the
    same next id at >= 95% of 3 x 16 steps (its random weights leave near-ties; measured 100%),
    and the free-running ids start the same; weight bytes <= 0.3x float32's; no compile after
    warm-up."""
    prompts = [(1, 5, 7, 9, 11), (3, 100, 200), (42, 43, 44, 45, 46, 47)]
    f32 = tiny_served.load(weights="float32")
    int8 = tiny_served.load(weights="int8")  # warmed up here and in test_jax_stack: one compile in the run
    assert int8.int8 and int8.kernels
    assert quantize.weight_bytes(int8._weights) <= 0.3 * quantize.weight_bytes(f32._weights)
    int8.warm_up()
    compiled = int8.compilations()
    want = greedy_ids(f32, prompts[:1], 16) + greedy_ids(f32, prompts[1:], 16)
    forced = greedy_ids(int8, prompts[:1], 16, want[:1]) + greedy_ids(int8, prompts[1:], 16, want[1:])
    free = greedy_ids(int8, prompts[:1], 16) + greedy_ids(int8, prompts[1:], 16)
    assert int8.compilations() == compiled
    same = sum(a == b for ra, rb in zip(want, forced) for a, b in zip(ra, rb))
    assert same >= 0.95 * 48, (want, forced)
    assert [r[:4] for r in free] == [r[:4] for r in want]


def test_a_tied_head_shares_the_int8_embedding():
    model = JaxModel.load(ASSETS / "tiny-qwen2", max_batch_size=1, max_context_length=32, weights="int8")
    assert model._weights.lm_head is model._weights.embed


def test_int8_is_refused_where_it_cannot_run_and_is_channels_without_the_kernels():
    """Under tensor parallelism and for an unknown format: refused. Without the kernels, int8 is
    not refused: it is engine.jax_backend.channel_quant's (tests/test_gpu_weights.py); the blocks
    themselves still need the kernels."""
    path = ASSETS / "tiny-llama"
    with pytest.raises(ValueError, match="tensor parallelism"):
        JaxModel.load(path, weights="int8", tensor_parallel=2)
    with pytest.raises(ValueError, match="weights must be one of"):
        JaxModel.load(path, weights="int4")
    off = JaxModel.load(path, max_context_length=32, weights="int8", kernels=False)
    assert not off.int8 and type(off._weights.embed).__name__ == "ChannelMatrix"
    blocks = weights_mod.load_int8(path)
    with pytest.raises(ValueError, match="need the CPU kernels"):
        JaxModel(blocks.config, blocks.weights, off.info, jnp.float32, kernels=False)


# --- int8 straight from a GGUF (engine.model_store.gguf_blocks) -----------------------------------

ALL_MATRICES = tuple(tiny_gguf.MATRICES)


def _gguf_dir(tmp_path: Path, types: dict) -> tuple[Path, dict[str, np.ndarray]]:
    hf = tiny_gguf.write(tmp_path / "tiny.gguf", types)
    return convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf"), hf


def _raw(path: Path, gguf_name: str) -> gguf.ReaderTensor:
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == gguf_name)


def test_q8_0_blocks_are_read_as_they_are_with_no_float_round_trip(tmp_path):
    """Q8_0: q is the file's int8 bytes, scale its float16 d, exactly."""
    tiny_gguf.write(tmp_path / "t.gguf", {name: T.Q8_0 for name in ALL_MATRICES})
    t = _raw(tmp_path / "t.gguf", "blk.1.ffn_down.weight")  # [64, 96]: 3 blocks a row
    rows = gguf_blocks.int8_rows(t, quantize.quantize_rows)
    blocks = np.asarray(t.data).reshape(64, 3, 34)
    np.testing.assert_array_equal(rows.q, blocks[..., 2:].copy().view(np.int8).reshape(64, 96))
    np.testing.assert_array_equal(rows.scale, blocks[..., :2].copy().view(np.float16)[..., 0])
    assert rows.q.dtype == np.int8 and rows.scale.dtype == np.float16 and np.abs(rows.q).max() == 127
    deq = rows.q.reshape(64, 3, 32).astype(np.float32) * rows.scale[..., None]
    np.testing.assert_array_equal(deq.reshape(64, 96), gguf.quants.dequantize(t.data, T.Q8_0))


# each exact type: (the range of its integers, whether its blocks carry an offset, their bits)
EXACT = {T.Q4_0: ((0, 15), True, 4), T.Q4_1: ((0, 15), True, 4), T.Q5_0: ((-16, 15), False, 5), T.Q5_1: ((0, 31), True, 5)}


@pytest.mark.parametrize("qtype", sorted(EXACT, key=lambda t: t.name), ids=lambda t: t.name)
def test_the_4_and_5_bit_types_map_onto_int8_blocks_exactly(tmp_path, qtype):
    """Q4_0 (d * (q - 8): q with offset -8 d), Q5_0 (d * (q - 16)) and Q4_1 / Q5_1 (d * q + m)
    are their integers, d and m as the file has them, held in 4 and 5 bits: scale * q (+ offset)
    is gguf's own dequantization, bit for bit, with the integers spanning their type's range, and
    so is the matrix packed in those bits."""
    (low, high), has_offset, bits = EXACT[qtype]
    tiny_gguf.write(tmp_path / "t.gguf", {"model.layers.{i}.mlp.up_proj.weight": qtype})
    t = _raw(tmp_path / "t.gguf", "blk.0.ffn_up.weight")  # [96, 64]: 2 blocks a row
    rows = gguf_blocks.int8_rows(t, quantize.quantize_rows)
    assert (rows.q.min(), rows.q.max()) == (low, high)
    assert (rows.offset is not None) == has_offset and rows.scale.dtype == np.float16 and rows.bits == bits
    got = rows.q.reshape(96, 2, 32).astype(np.float32) * rows.scale[..., None].astype(np.float32)
    if has_offset:
        got = got + rows.offset[..., None].astype(np.float32)
    np.testing.assert_array_equal(got.reshape(96, 64), gguf.quants.dequantize(t.data, qtype))
    packed = quantize.dequantize(quantize.pack(rows.q, rows.scale, rows.offset, rows.bits))
    np.testing.assert_array_equal(np.asarray(packed), gguf.quants.dequantize(t.data, qtype))


def test_f16_is_requantized_within_half_a_step(tmp_path):
    """A type with no int8 form of its own (F16 here) is requantized symmetric per block: within
    max|block| / 254 of the file's values, and not equal to them."""
    tiny_gguf.write(tmp_path / "t.gguf", {"model.layers.{i}.mlp.up_proj.weight": T.F16})
    t = _raw(tmp_path / "t.gguf", "blk.0.ffn_up.weight")
    rows = gguf_blocks.int8_rows(t, quantize.quantize_rows)
    want = np.asarray(t.data, np.float32).reshape(96, 2, 32)
    got = rows.q.reshape(96, 2, 32).astype(np.float32) * rows.scale[..., None]
    assert rows.offset is None
    assert np.all(np.abs(got - want) <= np.abs(want).max(axis=-1, keepdims=True) / 254 * (1 + 2**-10))
    assert not np.array_equal(got, want)


def test_requantizing_chunk_by_chunk_equals_the_whole_tensor_at_once(tmp_path, monkeypatch):
    """The row chunks (bounding the float32 temporaries) change nothing, a ragged last one included."""
    tiny_gguf.write(tmp_path / "t.gguf", {"model.embed_tokens.weight": T.F16})
    t = _raw(tmp_path / "t.gguf", "token_embd.weight")  # 260 rows
    whole = gguf_blocks.int8_rows(t, quantize.quantize_rows)
    monkeypatch.setattr(gguf_blocks, "_ROWS_PER_CHUNK", 7)
    chunked = gguf_blocks.int8_rows(t, quantize.quantize_rows)
    np.testing.assert_array_equal(chunked.q, whole.q)
    np.testing.assert_array_equal(chunked.scale, whole.scale)


# Q8_0 with Q4_0 MLPs; Gemma 3's mix: Q5_0 q/k/v and MLP (5 bits, signed), here a Q5_1 o (5 bits
# with offsets) and a Q8_0 down (8 bits), with what each fused matrix is held in
GGUF_MIXES = {
    "q8_0+q4_0": ({"mlp": T.Q4_0}, T.Q8_0, [(8, False), (8, False), (4, True), (4, True)]),
    "q5_0+q5_1": ({"q_proj": T.Q5_0, "k_proj": T.Q5_0, "v_proj": T.Q5_0, "o_proj": T.Q5_1, "gate": T.Q5_0, "up": T.Q5_0},
                  T.Q8_0, [(5, False), (5, True), (5, False), (8, False)]),
}


@pytest.mark.parametrize("mix", GGUF_MIXES)
def test_a_gguf_directory_serves_int8_from_its_blocks_in_the_float32_layout(tmp_path, mix):
    """A converted directory keeps model.gguf, and --weights int8 reads its blocks (GGUF_MIXES):
    every matrix dequantizes to exactly what the float32 load of the same directory holds (the
    fused q/k/v and gate/up layouts, the un-permuted q and k, the tied head), each held in its
    type's bits, and the greedy ids equal float32's."""
    by_part, rest, held = GGUF_MIXES[mix]
    types = {name: next((t for part, t in by_part.items() if part in name), rest) for name in ALL_MATRICES}
    model_dir, _ = _gguf_dir(tmp_path, types)
    assert (model_dir / gguf_convert.GGUF_NAME).is_file()
    f32, int8 = weights_mod.load_checkpoint(model_dir, "float32").weights, weights_mod.load_int8(model_dir).weights
    embed = _raw(model_dir / gguf_convert.GGUF_NAME, "token_embd.weight")
    np.testing.assert_array_equal(np.asarray(int8.embed.rows()[0]), gguf_blocks.int8_rows(embed, quantize.quantize_rows).q)
    assert int8.lm_head is int8.embed
    np.testing.assert_array_equal(np.asarray(quantize.dequantize(int8.embed)), np.asarray(f32.embed))
    for a, b in zip(f32.layers, int8.layers):
        for field in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            np.testing.assert_array_equal(np.asarray(quantize.dequantize(getattr(b, field))).T, np.asarray(getattr(a, field)), err_msg=field)
        np.testing.assert_array_equal(np.asarray(b.attn_norm), np.asarray(a.attn_norm))
        assert [(m.bits, m.offset is not None) for m in (b.w_qkv, b.w_o, b.w_gate_up, b.w_down)] == held
    prompts = [(5, 70, 80, 90), (100, 101)]
    want = greedy_ids(JaxModel.load(model_dir, max_batch_size=2, max_context_length=32, weights="float32"), prompts, 12)
    got = greedy_ids(JaxModel.load(model_dir, max_batch_size=2, max_context_length=32, weights="int8"), prompts, 12)
    assert got == want


def test_auto_serves_int8_for_a_model_that_brings_its_gguf_and_float32_elsewhere(tmp_path, caplog):
    """The servers' default, weights="auto": int8 on the CPU with its kernels when the directory
    keeps model.gguf (a pulled model); float32 without the kernels, and for a checkpoint without
    a GGUF (tiny-llama: safetensors only). The log says which and why."""
    model_dir, _ = _gguf_dir(tmp_path, {name: T.Q8_0 for name in ALL_MATRICES})
    kw = dict(max_batch_size=1, max_context_length=32, weights="auto")
    with caplog.at_level("INFO", logger="engine.jax_backend.loading"):
        assert JaxModel.load(model_dir, **kw).int8
        assert not JaxModel.load(model_dir, kernels=False, **kw).int8
        assert not JaxModel.load(ASSETS / "tiny-llama", **kw).int8
    choices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights auto")]
    assert choices == [
        "weights auto: int8 (the CPU kernels and the model's model.gguf: its 4- and 5-bit blocks held as they are)",
        "weights auto: float32 (the CPU kernels are off)",
        "weights auto: float32 (no model.gguf in the model directory)",
    ]


def test_a_q4_1_gguf_serves_its_own_values_and_a_directory_without_one_is_quantized_from_float32(tmp_path):
    """A Q4_1 model (as the default model is, with a Q8_0 embedding and head here, and v in Q8_0 so
    that the fused q/k/v mixes blocks with and without offsets): every int8 matrix dequantizes to
    exactly what the float32 load of the directory holds, and greedy ids equal float32's.
    Removing model.gguf makes the loader quantize the float32 safetensors instead (the HF path,
    symmetric, no offsets): within half an int8 step (of the float16 scale) of those values."""
    types = {name: T.Q4_1 for name in ALL_MATRICES}
    types.update({"model.embed_tokens.weight": T.Q8_0, "model.layers.{i}.self_attn.v_proj.weight": T.Q8_0})
    model_dir, _ = _gguf_dir(tmp_path, types)
    from_gguf = weights_mod.load_int8(model_dir).weights
    f32 = weights_mod.load_checkpoint(model_dir, "float32").weights
    assert from_gguf.embed.offset is None and from_gguf.lm_head is from_gguf.embed
    for a, b in zip(f32.layers, from_gguf.layers):
        for field in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            assert getattr(b, field).offset is not None, field
            np.testing.assert_array_equal(np.asarray(quantize.dequantize(getattr(b, field))).T, np.asarray(getattr(a, field)), err_msg=field)
    prompts = [(5, 70, 80, 90), (100, 101)]
    want = greedy_ids(JaxModel.load(model_dir, max_batch_size=2, max_context_length=32, weights="float32"), prompts, 12)
    got = greedy_ids(JaxModel.load(model_dir, max_batch_size=2, max_context_length=32, weights="int8"), prompts, 12)
    assert got == want
    (model_dir / gguf_convert.GGUF_NAME).unlink()
    from_f32 = weights_mod.load_int8(model_dir).weights
    for a, c in zip(f32.layers, from_f32.layers):
        for field in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            want = np.asarray(getattr(a, field)).T  # [out, in]
            n, k = want.shape
            bound = np.abs(want.reshape(n, k // 32, 32)).max(axis=-1, keepdims=True) / 254
            got = np.asarray(quantize.dequantize(getattr(c, field))).reshape(n, k // 32, 32)
            # half a step of the block's float16 scale, which is within 2**-11 of max / 127
            assert getattr(c, field).offset is None
            assert np.all(np.abs(got - want.reshape(n, k // 32, 32)) <= bound * (1 + 2**-10)), field


def test_fewer_threads_after_more_run_on_fewer():
    """Workers made for a larger thread count stay out of products once the count is lowered."""
    kernels = cpu_kernels.load()
    rng = np.random.default_rng(1)
    panels = cpu_kernels.pack_panels(jnp.asarray(rng.standard_normal((1024, 4096)).astype(np.float32)))
    x = jnp.asarray(rng.standard_normal((1, 1024)).astype(np.float32))
    product = jax.jit(functools.partial(cpu_kernels.panel_matmul, n=4096))
    try:
        cpu_kernels.set_threads(kernels, 4)
        jax.block_until_ready(product(x, panels))  # makes the 3 workers
        cpu_kernels.set_threads(kernels, 2)
        seen = []
        for _ in range(20):
            jax.block_until_ready(product(x, panels))
            seen.append(cpu_kernels.last_threads(kernels))
        assert max(seen) <= 2, seen
    finally:
        cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
