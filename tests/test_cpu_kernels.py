"""engine.jax_backend.cpu_kernels: the C++ decode attention over paged KV equals a float64 reference
that gathers each row's keys through its block table (ragged lengths, page boundaries, shuffled and
shared pages, GQA, page sizes 8, 16 and 32, both ISAs), on one thread and split across the pool,
never reading a position past a row's keys, and refusing a table entry outside the pools; the product
of a few rows over panel-packed weights equals x @ w, with each row's bits independent of the
call's other rows and of the ISA; and a machine that cannot build the kernels gets None (the engine then runs
plain JAX), never an error.

Where the library comes from (module docstring of cpu_kernels): the library `--build` writes is the
one loaded first, with no compiler and a cache nothing can be written to (the image's case, shown
through JaxModel.load); a cached library is loaded only when its sha256 matches its record, and a
library planted under the expected name (a real shared library whose constructor leaves a marker
file if it is ever dlopened) is never loaded, whatever else is there; off where the kernels would
apply is a WARNING with the reason, not applicable is INFO.

The model-level evidence (goldens from transformers, batch invariance, no recompiles, no cache
copy) runs with the kernel in tests/test_transformer_parity.py and tests/test_jax_model.py."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.jax_backend import cpu_kernels, transformer
from engine.jax_backend.jax_model import JaxModel
from support import paged_kv, prerequisites
from support.pool_threads import on_threads
from engine.model_store.registry import default_cache_dir

pytestmark = pytest.mark.usefixtures("loaded_kernels")  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
# What a custom call's error surfaces as: JaxRuntimeError from a jitted call's first (compiling)
# run, ValueError (INVALID_ARGUMENT) from a later run through JAX's C++ dispatch.
KERNEL_ERROR = (jax.errors.JaxRuntimeError, ValueError)


ISAS = ["avx2"] + (["avx512"] if "avx512f" in cpu_kernels._cpu_flags() else [])


def _each_isa(set_isa):
    """A fixture that runs a test under each build of a kernel (`set_isa`: cpu_kernels.*_isa) this CPU
    can run, AVX2 and AVX-512 where it has it, then restores AVX-512."""

    @pytest.fixture(params=ISAS)
    def fixture(request):
        kernels = cpu_kernels.load()
        assert set_isa(kernels, request.param == "avx512") == request.param
        yield request.param
        set_isa(kernels, True)

    return fixture


attention_isa = _each_isa(cpu_kernels.decode_attention_isa)  # decode_attention's vector body
panel_isa = _each_isa(cpu_kernels.panel_matmul_isa)  # panel_matmul's tile


def _paged_case(seed: int, lengths: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int, shared: int = 0):
    """Queries, pools, tables and positions for rows of `lengths` keys (support.paged_kv: shuffled
    pages, NaN wherever no row has a key), and the float64 reference output [R, H * D]."""
    rng = np.random.default_rng(seed)
    width = max(-(-n // page_size) for n in lengths) + 2  # entries past a row's pages are 0
    tables, pages = paged_kv.tables(rng, lengths, page_size, width, shared)
    k_pages, v_pages = paged_kv.pools(rng, tables, lengths, kv_heads, pages, page_size, head_dim)
    q = rng.standard_normal((len(lengths), heads, head_dim), np.float32)
    positions = np.array(lengths, np.int32) - 1
    want = np.stack([
        paged_kv.attention(q[r], paged_kv.gather(k_pages, tables[r], n), paged_kv.gather(v_pages, tables[r], n), n)
        for r, n in enumerate(lengths)
    ])
    return (q, k_pages, v_pages, tables, positions), want


_decode = jax.jit(cpu_kernels.decode_attention)


@pytest.mark.parametrize(
    "lengths, heads, kv_heads, head_dim, page_size, shared",
    [
        # SmolLM2's heads; one key, a length ending exactly on a page boundary and one past it, two
        # rows sharing a prefix page
        ([1, 16, 17, 40, 64], 9, 3, 64, 16, 1),
        ([8, 9, 33, 7], 9, 3, 64, 8, 1),  # pages of 8: a page is half an AVX-512 group of keys
        ([32, 33, 100, 1], 9, 3, 64, 32, 1),  # pages of 32
        ([5, 40, 39], 4, 4, 16, 16, 0),  # no grouping (G = 1)
        ([17, 16, 3], 8, 2, 12, 16, 1),  # a head dim that is no multiple of 8 (the plain loops)
        ([15, 25, 8], 8, 2, 12, 8, 1),
        ([300, 257], 8, 1, 128, 16, 0),  # G = 8 (several P . V passes of heads), D = 128
        ([33, 32, 31, 48], 6, 3, 80, 16, 0),  # D = 80: five AVX-512 vectors (passes of 4 and 1), ten AVX2 ones
        ([64, 512, 200, 65, 448, 128, 96, 500], 9, 3, 64, 16, 2),  # served lengths, shared 2 pages
    ],
)
def test_kernel_attention_equals_the_paged_reference(attention_isa, lengths, heads, kv_heads, head_dim, page_size, shared):
    """Each row attends its keys through its table, exactly positions 0..positions[r]: the pools
    hold NaN everywhere else, which would show in the output if it were read."""
    args, want = _paged_case(sum(lengths) + head_dim, lengths, heads, kv_heads, head_dim, page_size, shared)
    got = np.asarray(_decode(*args))
    assert got.shape == (len(lengths), heads * head_dim)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_rows_sharing_pages_read_the_same_keys():
    """Two rows whose tables name the same pages and the same queries give the same bits."""
    args, _ = _paged_case(3, [40, 40], 9, 3, 64, 16, shared=3)
    q, k_pages, v_pages, tables, positions = args
    q[1] = q[0]
    got = np.asarray(_decode(q, k_pages, v_pages, tables, positions))
    np.testing.assert_array_equal(tables[0], tables[1])
    np.testing.assert_array_equal(got[0], got[1])


def test_decode_attention_splits_its_units_over_the_pool_with_the_same_bits():
    """One row's kv heads are units of their own: on two threads both take part (at batch 1 too,
    where the attention once stayed on the caller), and each unit's result is the same bits
    whichever thread computed it."""
    kernels = cpu_kernels.load()
    args, want = _paged_case(7, [4096], 9, 3, 64, 16)  # SmolLM2's heads; keys enough for a worker to join in time
    results = {}
    try:
        for threads in (1, 2):
            results[threads] = on_threads(kernels, threads, lambda: np.asarray(jax.block_until_ready(_decode(*args))))
    finally:
        cpu_kernels.set_threads(kernels, cpu_kernels.available_cpus())
    np.testing.assert_array_equal(results[1], results[2])
    np.testing.assert_allclose(results[2], want, atol=2e-6, rtol=1e-5)


def test_a_position_past_the_table_is_clamped_into_it(attention_isa):
    """A padding row's position past its table (or below 0) reads the table's positions (or key 0)
    only: its output is finite and equals the clamped position's."""
    args, _ = _paged_case(5, [48, 48, 48], 9, 3, 64, 16)
    q, k_pages, v_pages, tables, _ = args
    width = tables.shape[1]
    tables[:, 3:] = tables[0, 0]  # every position of the table holds a key
    clamped = np.asarray(_decode(q, k_pages, v_pages, tables, np.array([width * 16 - 1, 0, 7], np.int32)))
    got = np.asarray(_decode(q, k_pages, v_pages, tables, np.array([width * 16 + 100, -5, 7], np.int32)))
    np.testing.assert_array_equal(got, clamped)


@pytest.mark.parametrize("entry", [-1, "pages"])
def test_a_table_entry_outside_the_pools_is_an_error_and_the_process_goes_on(entry):
    args, want = _paged_case(9, [40, 20], 9, 3, 64, 16)
    q, k_pages, v_pages, tables, positions = args
    bad = tables.copy()
    bad[1, 1] = k_pages.shape[1] if entry == "pages" else entry
    for _ in range(2):  # the first run and a cached one
        with pytest.raises(KERNEL_ERROR, match=rf"tables\[1, 1\] = {bad[1, 1]} is not a page of the pools \(0..{k_pages.shape[1] - 1}\)"):
            np.asarray(_decode(q, k_pages, v_pages, bad, positions))
    np.testing.assert_allclose(np.asarray(_decode(*args)), want, atol=2e-6, rtol=1e-5)


def test_shapes_that_do_not_fit_are_a_clear_error():
    args, _ = _paged_case(11, [20, 20], 9, 3, 64, 16)
    q, k_pages, v_pages, tables, positions = args
    with pytest.raises(KERNEL_ERROR, match=r"expected q \[R, H, D\], k_pages and v_pages \[K, N, P, D\].*got q \[2, 9, 64\], k_pages \[3, \d+, 16, 64\], v_pages .*, tables \[1, 4\]"):
        np.asarray(_decode(q, k_pages, v_pages, tables[:1], positions))
    with pytest.raises(KERNEL_ERROR, match="expected q"):  # a pool of another page size
        np.asarray(_decode(q, k_pages, v_pages[:, :, :8], tables, positions))


@pytest.mark.parametrize(
    "rows, k, n",
    [
        (1, 5, 7),  # shorter than one vector, fewer outputs than a panel
        (2, 64, 100),  # a part-filled last panel
        (3, 20, 3),
        (1, 576, 960),  # SmolLM2's q/k/v, o, gate/up and down products, as a decode step and chunks
        (8, 576, 576),
        (13, 576, 3072),  # one row past a block of 12
        (37, 1536, 576),
        (64, 576, 960),  # PANEL_ROWS
    ],
)
def test_panel_product_equals_matmul(panel_isa, rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k * 7 + n)
    x = rng.standard_normal((rows, 1, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    got = jax.jit(cpu_kernels.panel_matmul, static_argnums=2)(x, cpu_kernels.pack_panels(jnp.asarray(w)), n)
    assert got.shape == (rows, 1, n)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.sqrt(k), rtol=1e-5)


def test_a_rows_panel_product_is_the_same_bits_whatever_else_is_in_the_call():
    """Each output is summed over K in order with one fused multiply-add at a time, whatever the
    row's place in its block of rows, the block sizes, or the ISA: the same bits for a row alone,
    in a call of 29 rows (blocks of 10, 10, 9 with AVX-512, 3s with AVX2), and under either ISA.
    (Batch invariance at the model level rests on this.)"""
    kernels = cpu_kernels.load()
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((29, 576), np.float32))
    p = cpu_kernels.pack_panels(jnp.asarray(rng.standard_normal((576, 200), np.float32)))
    product = jax.jit(cpu_kernels.panel_matmul, static_argnums=2)
    results = []
    try:
        for isa in ISAS:
            cpu_kernels.panel_matmul_isa(kernels, isa == "avx512")
            results.append(np.asarray(product(x, p, 200)))
            results.append(np.concatenate([np.asarray(product(x[r : r + 1], p, 200)) for r in range(29)]))
    finally:
        cpu_kernels.panel_matmul_isa(kernels, True)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_panels_are_used_up_to_panel_rows_only():
    """Products of up to PANEL_ROWS rows read the panel copies, longer ones the originals: with the
    panels zeroed only the shorter results change."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((8, 40), np.float32))
    zeros = jnp.zeros_like(cpu_kernels.pack_panels(w))
    for rows in (1, 2, cpu_kernels.PANEL_ROWS):
        x = jnp.ones((rows, 1, 8))
        np.testing.assert_array_equal(transformer._project(x, w, zeros), np.zeros((rows, 1, 40)))
        np.testing.assert_allclose(transformer._project(x, w, None), x @ w, rtol=1e-6)
    many = jnp.ones((1, cpu_kernels.PANEL_ROWS + 1, 8))  # a prefill chunk past the limit
    np.testing.assert_allclose(transformer._project(many, w, zeros), many @ w, rtol=1e-6)


TINY = Path(__file__).parent / "assets" / "tiny-llama"
MARKER_VARIABLE = "TOKENWIRE_TEST_LOADED_MARKER"
# A real shared library with the kernels' symbols whose constructor appends to the file named by
# $TOKENWIRE_TEST_LOADED_MARKER: if the loader ever dlopens it, the file appears.
PLANTED_SOURCE = r"""
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
  if (const char* marker = std::getenv("TOKENWIRE_TEST_LOADED_MARKER"))
    if (FILE* f = std::fopen(marker, "a")) { std::fputs("loaded\n", f); std::fclose(f); }
}
extern "C" void TokenwireDecodeAttention() {}
extern "C" void TokenwirePanelMatmul() {}
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mode, p.stat().st_size) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory, loaded_kernels) -> Path:
    """A package-like directory holding the library, built by the command the Dockerfile runs.

    The compiler's process is this run's library copied to the output path when the run has one
    on disk: that file is what the same `_compile` command made of the same sources and flags
    (its name hashes them, with jaxlib's version), at this run's first use of the kernels or at an
    earlier run's for these very sources; a second g++ run of some twenty seconds would prove
    nothing more. All else `--build` does runs as it is: the staged file, its mode, its rename to
    the library's name, loading it and finding every symbol. A library built for one process only
    (no file left) is compiled here."""
    compiler = prerequisites.cxx()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without one
    directory = tmp_path_factory.mktemp("package") / "kernels"
    built = loaded_kernels.path
    with pytest.MonkeyPatch.context() as patch:
        if built.is_file() and built.name == cpu_kernels.library_name():

            def compile_(command, **kwargs):
                assert command[0] == compiler and command[-2] == "-o", command  # the compiler, writing the staged file
                shutil.copyfile(built, command[-1])
                return subprocess.CompletedProcess(command, 0, "", "")

            patch.setattr(cpu_kernels.subprocess, "run", compile_)
        assert cpu_kernels.main(["--build", str(directory)]) == 0
    library = directory / cpu_kernels.library_name()
    assert [p.name for p in directory.iterdir()] == [library.name]  # no staged file left behind
    assert library.stat().st_mode & 0o777 == 0o644  # readable by the serving user, writable by its owner only
    return directory


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("planted")
    (directory / "planted.cc").write_text(PLANTED_SOURCE)
    library = directory / "planted.so"
    subprocess.run([cpu_kernels._compiler(None), "-shared", "-fPIC", "-o", str(library), str(directory / "planted.cc")], check=True)
    # the detector works: loading a copy of it leaves the marker
    control, marker = directory / "control.so", directory / "control-marker"
    shutil.copy(library, control)
    os.environ[MARKER_VARIABLE] = str(marker)
    try:
        import ctypes

        ctypes.CDLL(str(control))
    finally:
        del os.environ[MARKER_VARIABLE]
    assert marker.read_text() == "loaded\n"
    return library


@pytest.fixture
def no_compiler(tmp_path_factory, monkeypatch):
    """No g++ or clang++ on PATH, and any attempt to compile fails the test."""
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-path")))

    def compile_(*args):
        raise AssertionError("a compile was attempted")

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)


@pytest.fixture
def quick_build(prebuilt, monkeypatch):
    """A "compile" that copies the library built once for this module (a real g++ run takes
    seconds): the loader's handling of what it built is unchanged."""

    def compile_(compiler, directory):
        fd, staged = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=directory)
        os.close(fd)
        shutil.copyfile(prebuilt / cpu_kernels.library_name(), staged)
        os.chmod(staged, 0o644)
        return Path(staged)

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)


def test_the_built_library_is_loaded_first_with_no_compiler_and_an_unwritable_cache(prebuilt, tmp_path, no_compiler):
    """The image's case: a prebuilt library, no compiler, a cache that cannot be written (its
    parent is a file, so any mkdir or write there would fail, root or not): kernels on, from the
    prebuilt file, and nothing written anywhere."""
    (tmp_path / "a-file").write_text("")
    options = cpu_kernels.BuildOptions(tmp_path / "a-file" / "cache", prebuilt_dir=prebuilt)
    before = _tree(tmp_path), _tree(prebuilt)
    status = cpu_kernels.status(options)
    library = prebuilt / cpu_kernels.library_name()
    assert status.kernels is not None and status.kernels.path == library and status.kernels.origin == "prebuilt"
    assert status.kernels.sha256 == _sha256(library)
    assert status.state == f"on: prebuilt {library}"
    assert (_tree(tmp_path), _tree(prebuilt)) == before


def test_a_read_only_cache_serves_with_kernels_on(prebuilt, tmp_path, no_compiler, caplog):
    """JaxModel.load as the decode service calls it, with the model and the cache read-only
    (0555; the cache's kernels/ absent and its parent unwritable for a non-root user) and the
    library prebuilt: kernels on, no WARNING, nothing created."""
    model_dir = tmp_path / "cache" / "models" / "tiny"
    shutil.copytree(TINY, model_dir)
    for path in [model_dir, *model_dir.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    (tmp_path / "cache" / "models").chmod(0o555)
    (tmp_path / "cache").chmod(0o555)
    before = _tree(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="engine"):
            model = JaxModel.load(
                model_dir, max_batch_size=1, max_context_length=16,
                kernel_build=cpu_kernels.BuildOptions(tmp_path / "cache", prebuilt_dir=prebuilt),
            )
        assert model.kernels is True
        assert model.kernel_state == f"on: prebuilt {prebuilt / cpu_kernels.library_name()}"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert _tree(tmp_path) == before
    finally:
        for path in tmp_path.rglob("*"):
            path.chmod(0o755)
        (tmp_path / "cache").chmod(0o755)


def test_a_verified_cached_library_is_loaded_without_a_compiler(prebuilt, tmp_path, no_compiler):
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    name = cpu_kernels.library_name()
    shutil.copy(prebuilt / name, cache / name)
    (cache / f"{name}.sha256").write_text(_sha256(prebuilt / name) + "\n")
    status = cpu_kernels.status(cpu_kernels.BuildOptions(tmp_path, prebuilt_dir=tmp_path / "no-prebuilt"))
    assert status.kernels is not None and status.kernels.origin == "cached" and status.kernels.path == cache / name
    assert status.state == f"on: cached {cache / name}"


def _plant(directory: Path, library: Path, record: str | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    name = cpu_kernels.library_name()
    shutil.copy(library, directory / name)
    if record is not None:
        (directory / f"{name}.sha256").write_text(record + "\n")


@pytest.mark.parametrize(
    "case",
    [
        "cached, no sha256 record",
        "cached, the record of the real library",
        "cached, a matching record in a directory others can write",
        "cached, a matching record, files of another user",
        "prebuilt, writable by others",
        "prebuilt, garbage",
    ],
)
def test_a_library_planted_under_the_expected_name_is_never_loaded(
    case, prebuilt, planted_library, quick_build, tmp_path, monkeypatch, caplog
):
    """Whatever is planted, the marker never appears (the planted library was never dlopened) and
    the kernels come on from a library the loader built and hashed itself."""
    marker = tmp_path / "LOADED"
    monkeypatch.setenv(MARKER_VARIABLE, str(marker))
    cache, package = tmp_path / "cache", tmp_path / "package"
    package.mkdir()
    real = prebuilt / cpu_kernels.library_name()
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    if case == "cached, no sha256 record":
        _plant(kernels, planted_library, None)
    elif case == "cached, the record of the real library":
        _plant(kernels, planted_library, _sha256(real))
    elif case == "cached, a matching record in a directory others can write":
        _plant(kernels, planted_library, _sha256(planted_library))
        kernels.chmod(0o777)
    elif case == "cached, a matching record, files of another user":
        if os.geteuid() != 0:
            pytest.skip("only root can give files to another user")
        _plant(kernels, planted_library, _sha256(planted_library))
        for path in kernels.iterdir():
            os.chown(path, 4242, 4242)
    elif case == "prebuilt, writable by others":
        _plant(package, planted_library, None)
        (package / cpu_kernels.library_name()).chmod(0o666)
    elif case == "prebuilt, garbage":
        (package / cpu_kernels.library_name()).write_bytes(b"not a library")
    shared = _tree(kernels) if "others can write" in case else None
    with caplog.at_level(logging.INFO, logger="engine.jax_backend.cpu_kernels"):
        status = cpu_kernels.status(cpu_kernels.BuildOptions(cache, prebuilt_dir=package))
    assert not marker.exists(), "the planted library was loaded"
    assert status.kernels is not None and status.kernels.sha256 == _sha256(real)
    if case == "prebuilt, garbage":  # the garbage would not load; only the warning says why it was passed over
        assert "not loading the prebuilt CPU kernels" in caplog.text
        assert status.state.startswith("on: built ")
    elif shared is not None:  # nothing is written into a directory others can write
        assert status.state.startswith("on: built for this process only ")
        assert _tree(kernels) == shared
    else:
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "not loading the" in r.getMessage()]
        assert warned, caplog.text
        if case.startswith("cached"):
            name = cpu_kernels.library_name()
            assert status.state == f"on: built {kernels / name}"  # rebuilt in place, with its record
            assert _sha256(kernels / name) == _sha256(real)
            assert (kernels / f"{name}.sha256").read_text().strip() == _sha256(real)


def test_off_where_they_would_apply_is_a_warning_with_the_reason(tmp_path, no_compiler, caplog):
    """No prebuilt library and no compiler on an x86-64 CPU with AVX2 and FMA, float32: the model
    runs plain JAX, the log says so at WARNING with the reason, and kernel_state says it too."""
    options = cpu_kernels.BuildOptions(tmp_path, prebuilt_dir=tmp_path / "no-prebuilt")
    with caplog.at_level(logging.INFO, logger="engine"):
        model = JaxModel.load(TINY, max_batch_size=1, max_context_length=16, kernel_build=options)
    assert model.kernels is False
    assert model.kernel_state.startswith("off: no prebuilt library (") and "no C++ compiler" in model.kernel_state
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"CPU decode kernels {model.kernel_state}; using plain JAX (slower decode steps)"]
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_not_applicable_is_said_at_info(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with caplog.at_level(logging.INFO, logger="engine"):
        model = JaxModel.load(TINY, max_batch_size=1, max_context_length=16, kernel_build=cpu_kernels.BuildOptions(tmp_path))
        bf16 = JaxModel.load(TINY, max_batch_size=1, max_context_length=16, dtype="bfloat16")
    assert model.kernels is False and model.kernel_state == "not applicable: aarch64 is not x86-64"
    assert bf16.kernels is False and bf16.kernel_state.startswith("not applicable: the dtype is bfloat16")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert cpu_kernels.main(["--build", str(tmp_path / "out")]) == 0  # the image's build step: nothing to do
    assert not (tmp_path / "out").exists()


def test_a_failed_build_gets_plain_jax_and_leaves_no_library(tmp_path, caplog):
    options = cpu_kernels.BuildOptions(tmp_path, compiler="false", prebuilt_dir=tmp_path / "no-prebuilt")  # always fails
    with caplog.at_level(logging.WARNING, logger="engine.jax_backend.cpu_kernels"):
        assert cpu_kernels.load(options) is None
    assert "CPU decode kernels off: no prebuilt library, and building one failed" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # the staged file and the objects were removed
    assert cpu_kernels.main(["--build", str(tmp_path / "out"), "--cxx", "false"]) == 1
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_build_logs_all_the_compiler_said_and_the_state_keeps_one_line(tmp_path, caplog):
    said = [
        "In file included from decode_attention.cc:1:",
        "vec.h:12:3: error: 'fmadd' was not declared in this scope",
        "   12 |   fmadd(a, b, c);",
        "compilation terminated.",
    ]
    compiler = tmp_path / "broken-cxx"  # prints those lines to stderr, exits 1
    compiler.write_text("#!/bin/sh\ncat >&2 <<'SAID'\n" + "\n".join(said) + "\nSAID\nexit 1\n")
    compiler.chmod(0o755)
    options = cpu_kernels.BuildOptions(tmp_path / "cache", compiler=str(compiler), prebuilt_dir=tmp_path / "no-prebuilt")
    with caplog.at_level(logging.WARNING, logger="engine.jax_backend.cpu_kernels"):
        status = cpu_kernels.status(options)
    assert status.state == f"off: no prebuilt library, and building one failed: {said[1]}"
    (record,) = [r for r in caplog.records if r.getMessage().startswith("building the CPU kernels failed")]
    assert record.levelno == logging.WARNING
    assert record.getMessage().splitlines()[-len(said):] == said


def test_the_library_is_found_once_and_reused(monkeypatch):
    """The default load is memoised, and another process (a fresh BuildOptions for the same cache)
    finds what the first built or found, without compiling."""
    first = cpu_kernels.load()
    assert first is not None and first.path.is_file() and cpu_kernels.load() is first
    assert first.path.name == cpu_kernels.library_name()

    def compile_(*args):
        raise AssertionError("a compile was attempted")

    monkeypatch.setattr(cpu_kernels, "_compile", compile_)
    again = cpu_kernels.load(cpu_kernels.BuildOptions(default_cache_dir()))
    assert again is not None and again.path == first.path and again.sha256 == first.sha256


def test_processes_that_start_at_once_on_a_fresh_cache_build_the_library_once(tmp_path, loaded_kernels):
    """Replicas (or a test run's workers) starting together on a fresh host: the first to find
    no library builds it under the cache's lock, the others wait for it and load it from the
    cache, so the sources are compiled once, not once a process. The compiler here logs each call
    and writes this run's library to its output (a real g++ run proves nothing more, in tens of
    seconds); it sleeps, so the processes overlap."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "logging-cxx"
    compiler.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nsleep 0.5\nfor out; do :; done\ncp {loaded_kernels.path} "$out"\n')
    compiler.chmod(0o755)
    code = (
        "import sys; from pathlib import Path; from engine.jax_backend import cpu_kernels as k; "
        f"s = k.status(k.BuildOptions(Path(sys.argv[1]), compiler={str(compiler)!r}, prebuilt_dir=Path(sys.argv[1]) / 'none')); "
        "print(s.kernels.origin if s.kernels else s.state)"
    )
    root = Path(__file__).resolve().parent.parent
    processes = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache")], cwd=root,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(3)]
    origins = sorted(p.communicate(timeout=120)[0].strip() for p in processes)
    assert origins == ["built", "cached", "cached"], origins
    links = [line for line in calls.read_text().splitlines() if " -c " not in line]
    assert len(links) == 1 and len(calls.read_text().splitlines()) == len(cpu_kernels.SOURCES) + 1
