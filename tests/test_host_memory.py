"""engine.jax_backend.host_memory: a large block freed and allocated again reuses its pages
instead of faulting them in anew (XLA:CPU allocates an executable's scratch on every call), and
a model's weights move into huge pages with their values kept."""

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


# 24 weights of 1 MiB and one of 8 MiB placed on the CPU one after another (as a model's are),
# then asked into huge pages; prints the outcome line and the process's huge pages before and
# after (kB, /proc/self/smaps_rollup), and the weights' bytes.
WEIGHTS = """
import sys
import jax, numpy as np
sys.path.insert(0, {root!r})
from engine.jax_backend import host_memory
def huge_kb():
    return next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
weights = [jax.device_put(np.full(1 << 20, i, np.uint8)) for i in range(24)] + [jax.device_put(np.ones(8 << 20, np.uint8))]
before = huge_kb()
line = host_memory.weights_in_huge_pages({{"layers": weights[:-1], "head": weights[-1]}})
print(line, before, huge_kb(), sum(w.nbytes for w in weights), sep="|")
assert all((np.asarray(w) == (i if i < 24 else 1)).all() for i, w in enumerate(weights))  # the values stay
"""


def _transparent_huge_pages() -> str:
    """The host's transparent huge page mode: "always", "madvise" or "never" ("" where unknown)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else ""


def test_the_weights_go_into_huge_pages_where_the_kernel_has_them_and_keep_their_values():
    out = subprocess.run(
        [sys.executable, "-c", WEIGHTS.format(root=str(ROOT))], capture_output=True, text=True, timeout=120,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line, before, after, total = out.stdout.strip().splitlines()[-1].split("|")
    mode = _transparent_huge_pages()
    if mode not in ("always", "madvise"):  # the kernel has none to give: it says so, and nothing moved
        assert line.startswith("off: "), line
        return
    pages = int(line.split()[1])  # "on: N pages of 2 MiB"
    # most of the run's whole huge pages (16 here, less the partial ones at its two ends): the
    # kernel refuses a collapse while it has no free 2 MiB block, which other processes' memory
    # use decides (a fresh-clone run of the suite once got 13), so not all of them is the claim
    assert line.startswith("on: ") and pages >= int(total) // (2 << 20) // 2, line
    assert int(after) - int(before) >= pages * 2048, (line, before, after)


def test_what_goes_into_huge_pages_is_what_a_decode_step_reads_whole():
    """JaxModel asks huge pages for the arrays a step of a few rows streams through
    (weights.read_every_step): the panel copies of the projections and of the head where the
    CPU kernels run, not the matrices they copy (read by prefill and by products of more rows)
    nor the embedding table (a row an input); moving those too was seconds of a large model's
    load for no step's gain."""
    import jax

    from engine.jax_backend.weights import read_every_step
    from support import prerequisites, tiny_served

    prerequisites.cpu_kernels()  # the panel copies are the kernels'
    model = tiny_served.load("tiny-llama", weights="float32")
    w = model._weights
    read = {id(a) for a in jax.tree.leaves(read_every_step(model._decode_weights, model._lm_head, w.final_norm))}
    assert id(w.embed) not in read and id(w.final_norm) in read
    assert id(model._lm_head.panels) in read and id(model._lm_head.w) not in read
    for layer in model._decode_weights:
        assert {id(layer.panels.qkv), id(layer.panels.o), id(layer.panels.gate_up), id(layer.panels.down), id(layer.attn_norm)} <= read
        assert not {id(layer.w_qkv), id(layer.w_o), id(layer.w_gate_up), id(layer.w_down)} & read
    int8 = tiny_served.load("tiny-llama", weights="int8")  # no panel copies: the blocks are what a step reads
    layers, head, _ = read_every_step(int8._decode_weights, int8._lm_head, int8._weights.final_norm)
    assert layers == int8._decode_weights and head is int8._lm_head
