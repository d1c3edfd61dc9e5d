"""Shared fixtures: real servers on loopback ports, driven by the scripted model; test certificates;
the CPU kernels and the real model, each had once per run (support.prerequisites says when their
absence fails instead of skipping; a whole run begins both in the background as it starts,
support.prefetch); and the Hypothesis profiles.

Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (Hypothesis's own convention; unset: "thorough"):
  * "thorough": every property test at its full count (`support.examples.examples(n)` gives n);
  * "ci" (.ci/run): a quarter of each count (at least one), derandomized, no example database
    (Hypothesis's own "ci" profile underneath), so a CI run is shorter and repeatable.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
from hypothesis import settings

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from protos.decode.v1 import decode_pb2_grpc
from services.decode_server import start_decode_server
from support import cpu_alone, file_order, prefetch, prerequisites
from support.backend import require_cpu
from support.examples import FULL
from support.xla_flags import TEST_XLA_FLAGS

# The test run compiles with LLVM at its optimization level 1 and without its expensive passes
# (XLA_FLAGS, inherited by the servers and children that tests start): the same HLO, and in every
# program compared (scripts/test_xla_flags.py: the real model's logits in float32, bfloat16, int8
# and fp8 through each layer, its served greedy ids, tiny-llama's served ids) the same results bit
# for bit, for about a fifth less CPU per compile of a tiny model, and compiles are most of this
# suite's time on the 2-core machine (docs/notes/test-suite-time.md). Tried and not kept: level 0
# (40% less, but float32 sums change in their last bits, enough to flip a marginal real-model
# claim) and XLA:CPU's older emitters (`--xla_cpu_use_fusion_emitters=false`: the same bits and
# quicker compiles, but the real model's steps ran twice as long). TOKENWIRE_TEST_SERVED_XLA=1
# compiles exactly as decode-server does; where a GPU plugin is installed (scripts/gpu_check runs
# the suite there) nothing changes.
def _accelerator_installed() -> bool:
    return any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


if not (os.environ.get("TOKENWIRE_TEST_SERVED_XLA") or _accelerator_installed()
        or "xla_llvm_disable_expensive_passes" in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = " ".join((os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS)).strip()

# No Hypothesis deadline in either: a deadline is a wall-clock bound on each example, which a
# loaded host breaks (speed is the benchmarks' question).
settings.register_profile("thorough", max_examples=FULL, deadline=None)
settings.register_profile("ci", parent=settings.get_profile("ci"), max_examples=FULL // 4, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "thorough")


@pytest.fixture
def on_the_cpu():
    """Arrays made and calls run inside the test on the CPU device, whatever the default backend:
    the families' whole-model checks against transformers' float32 goldens. (Not for JaxModel: a
    default device is part of jit's cache key, so a step warmed up outside the context would
    compile again inside it.)"""
    import jax

    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def scripted_model() -> ScriptedModel:
    # vocab 1000, EOS 2, 4 slots, context 64: small enough to reason about by hand
    return ScriptedModel(vocab_size=1000, eos_token_ids=frozenset({2}), max_batch_size=4, max_context_length=64)


@pytest.fixture
async def decode_server(scripted_model):
    server = await start_decode_server(scripted_model, EngineConfig(max_queue_size=8))
    yield server
    await server.stop(None)


@pytest.fixture
async def decoder(decode_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode_server.port}") as channel:
        yield decode_pb2_grpc.DecoderStub(channel)


# -- certificates, made once per session with the openssl CLI (valid two days) ----------------

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def _make_ca(directory: Path, name: str) -> None:
    _openssl(
        directory, "req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
        "-subj", f"/CN=tokenwire test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )


def _make_leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(directory, "req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=tokenwire {name}")
    _openssl(
        directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-set_serial", str(secrets.randbits(62) + 1), "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext",
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _make_ca(d, "rogue-ca")
    _make_leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture
def cpu_backend():
    """Skips, saying why, unless JAX's default backend is the CPU (support.backend): for tests
    whose claim is exact equality under float32, which they pin themselves."""
    require_cpu()


@pytest.fixture(scope="session")
def loaded_kernels():
    """The CPU kernels, found or built once per run (engine.jax_backend.cpu_kernels.status); a
    test that needs them skips, or fails when strict, with the build's reason (support.prerequisites)."""
    return prerequisites.cpu_kernels()


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The default model's directory (SmolLM2-135M-Instruct), pulled once per run into the default
    cache, as `tokenwire pull` does; every `real_model` test gets it here, so none depends on
    another having run first. A failed pull skips, or fails when strict, saying why."""
    return prerequisites.real_model_dir()


@pytest.fixture(autouse=True)
def _real_model_marked(request) -> None:
    """A test marked `real_model` gets the `real_model` fixture whether or not it names it: the
    marker alone makes the model be there (or the test skip or fail, saying why) before it starts."""
    if request.node.get_closest_marker("real_model"):
        request.getfixturevalue("real_model")


_RUN_DIR = "TOKENWIRE_TEST_RUN_DIR"
_PREFETCH = pytest.StashKey[list]()


def pytest_configure(config) -> None:
    """A directory of this run's own, made by the process that starts the run and shared by all
    its pytest-xdist workers (they inherit the variable): JAX's compilation cache and the CPU lock."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_RUN_DIR] = tempfile.mkdtemp(prefix="tokenwire-test-run-")
        config.stash[_PREFETCH] = prefetch.start(config)  # the real models and the kernels, while workers start
    cpu_alone.open_lock(Path(os.environ[_RUN_DIR]) / "cpu.lock")
    file_order.register(config)  # whole files longest first, for scripts/test's workers


def pytest_unconfigure(config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        prefetch.finish(config.stash.get(_PREFETCH, []))
        shutil.rmtree(os.environ.pop(_RUN_DIR, ""), ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its set-up (models its module loads) and tear-down included, holds the run's CPU
    lock shared, so a stretch that needs the CPUs alone (`support.cpu_alone.alone`) waits for the
    other workers' tests and holds them off."""
    cpu_alone.shared()
    try:
        yield
    finally:
        cpu_alone.release()


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache() -> None:
    """JAX's persistent compilation cache, on as decode-server serves it (ModelOptions'
    compilation_cache), in this run's directory, which its workers share (JAX's cache is made for
    several processes): a test that loads a model another test already compiled reads its
    executables back instead of compiling them again. It stays the worker's when a test loads a
    model as a server's process does (services.model_loading.load_model, which enables
    ~/.cache/tokenwire/xla): engine.jax_backend.compilation_cache keeps a process's first
    directory. Counts of compilations (`JaxModel.compilations`) are the jit caches' and do not
    change."""
    if os.environ.get("TOKENWIRE_TEST_NO_XLA_CACHE"):
        return
    from engine.jax_backend import compilation_cache

    directory = Path(os.environ[_RUN_DIR]) / "xla"
    directory.mkdir(exist_ok=True)
    assert compilation_cache.enable(directory)
