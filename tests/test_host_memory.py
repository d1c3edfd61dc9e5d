"""engine.jax_backend.host_memory: a large block freed and allocated again reuses its pages
instead of faulting them in anew (XLA:CPU allocates an executable's scratch on every call)."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine.jax_backend import host_memory

ROOT = Path(__file__).resolve().parent.parent

# A 40 MiB block (above glibc's largest mmap threshold, 32 MiB) written, freed and allocated
# again five times; prints the minor page faults per round.
ROUNDS = """
import resource, sys
import numpy as np
sys.path.insert(0, {root!r})
if {keep}:
    from engine.jax_backend import host_memory
    assert host_memory.keep_scratch_resident().startswith("on"), host_memory.keep_scratch_resident()
def once():
    block = np.ones(40 << 20, np.uint8)
    return int(block[::4096].sum())
once()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    once()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 5)
"""


def _faults_per_round(keep: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS.format(root=str(ROOT), keep=keep)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not host_memory.keep_scratch_resident().startswith("on"), reason="not glibc")
def test_a_freed_large_block_is_reused_without_page_faults():
    plain, kept = _faults_per_round(False), _faults_per_round(True)
    # Without it every round maps the block afresh (10,240 faults of 4 KiB pages, fewer with
    # transparent huge pages); with it the pages stay mapped.
    assert plain >= 100, f"{plain} faults per round without it: the check cannot tell"
    assert kept <= plain / 20, f"{kept} faults per round with it, {plain} without"


def test_it_is_made_once_and_says_what_it_did():
    first = host_memory.keep_scratch_resident()
    assert first.split(":")[0] in ("on", "off")
    assert host_memory.keep_scratch_resident() is first
