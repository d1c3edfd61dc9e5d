"""Host memory for XLA:CPU: each call's scratch kept resident between calls, and the weights in
huge pages.

XLA:CPU allocates each executable's temporary buffer afresh on every call and frees it after.
glibc serves a request above its mmap threshold (which it raises by itself up to at most 32 MiB
on 64-bit) with new pages from the kernel, and returns them on free, so every call faults each
page of its scratch in again. The one-executable decode step at 32 rows of SmolLM2-135M has a
33.8 MB scratch: measured 6,221 page faults and 17 ms of kernel time per step, against 22 and
0.9 ms with the change below (docs/benchmarks.md, issue 17). Any executable whose scratch passes
32 MiB (a long prefill piece, a larger batch or vocabulary) would pay the same.

The fix is glibc's own setting, made here because no library does it for us and jaxlib has no
option to keep a temporary buffer between calls: serve every request from the heap (M_MMAP_MAX 0)
and do not hand freed memory at the top of the heap back to the kernel below TRIM_BYTES
(M_TRIM_THRESHOLD). A freed scratch then stays mapped, and the next call reuses its pages. The
cost: the process keeps the high-water mark of its temporaries resident (which the memory plan
counts anyway, engine.jax_backend.memory_plan), up to TRIM_BYTES more than before.

Process-wide, so it is made once, by the first CPU model a process builds; later calls return
the first outcome. Only on glibc (Linux); elsewhere a no-op that says so.

The weights in huge pages (`weights_in_huge_pages`): a decode step reads every weight, and with
them in 4 KiB pages that is a page walk for every 4 KiB read (~24,000 a batch-1 step of the
default model, whose 96 MB of int8 weights the TLB cannot hold); where in the heap a process's
weights land then decides how much of its step goes to the walks, so two processes of the same
code differ by several per cent. In 2 MiB pages a batch-1 int8 step did ~20% less work, and
every process alike (docs/notes/design-measurements.md, "Paged KV at batch 1"). The buffers are
already written when the model is built, so the kernel is asked to collapse them into huge pages
in place (Linux's MADV_COLLAPSE, 6.1 and later; it works whether transparent huge pages are
"always" or "madvise", and not where they are "never"): no library does this for jaxlib's
buffers, and glibc's own tunable (glibc.malloc.hugetlb) can only be set before a process starts.
JaxModel asks it for what a step streams through whole (engine.jax_backend.weights.read_every_step):
the collapse copies each page (about 2 ms a 2 MiB page here), so the embedding table and the
matrices a panel copy stands in for stay as they are (a float32 Gemma 3 270M loaded in about
half the time: docs/benchmarks.md, "Model loads").
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import os
import threading

import jax

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_BYTES = 1 << 30  # freed heap memory kept for reuse before any is returned to the kernel
MADV_COLLAPSE = 25  # <linux/mman.h>: collapse a range's pages into transparent huge pages now
HUGE_PAGE = 2 << 20  # x86-64's (and most arm64 kernels') transparent huge page

_lock = threading.Lock()
_outcome: str | None = None


def keep_scratch_resident() -> str:
    """Make glibc keep freed large blocks for reuse (see the module docstring); -> what was done,
    in one line: "on: ..." or "off: <reason>". Idempotent."""
    global _outcome
    with _lock:
        if _outcome is None:
            _outcome = _apply()
            log.info("host scratch memory: %s", _outcome)
        return _outcome


def _apply() -> str:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return f"off: the C library ({name or 'not found'}) is not glibc"
    version.restype = ctypes.c_char_p
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    if not ok:
        return f"off: glibc {version().decode()} refused mallopt"
    return f"on: glibc {version().decode()} serves large blocks from the heap and keeps up to {TRIM_BYTES >> 20} MiB freed"


def weights_in_huge_pages(arrays) -> str:
    """Ask the kernel to move the host buffers of `arrays` (a pytree of jax.Arrays on the CPU)
    into huge pages (see the module docstring): the whole huge pages of each run of buffers that
    lie end to end (a model's weights are allocated one after another, most far smaller than a
    huge page; a gap of less than one between two buffers comes along). -> what was done, in one
    line: "on: ..." or "off: <reason>". Best effort: a refusal leaves the pages as they were."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError, TypeError):
        return "off: no madvise in this C library"
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    buffers = sorted(
        (shard.data.unsafe_buffer_pointer(), shard.data.nbytes)
        for a in jax.tree.leaves(arrays) for shard in getattr(a, "addressable_shards", ())
    )
    runs: list[list[int]] = []  # [start, end) of buffers that lie (nearly) end to end, as allocated one after another
    for start, size in buffers:
        if runs and start - runs[-1][1] < HUGE_PAGE:
            runs[-1][1] = max(runs[-1][1], start + size)  # a gap under a huge page: one run (what the gap holds comes along)
        else:
            runs.append([start, start + size])
    spans = [(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE) for start, end in runs]
    spans = [(first, end) for first, end in spans if end > first]  # each run's whole huge pages
    anonymous = _anonymous_mappings()
    done, refused = 0, collections.Counter()
    for first, end in spans:
        for page in range(first, end, HUGE_PAGE):  # one at a time: a run may cross mappings the kernel treats apart
            if not any(lo <= page and page + HUGE_PAGE <= hi for lo, hi in anonymous):
                continue  # a file's pages (a checkpoint's, memory-mapped, that a small weight still reads), not ours to move
            if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                done += 1
            else:
                refused[os.strerror(ctypes.get_errno())] += 1
    why = ", ".join(f"{n} refused: {reason}" for reason, n in sorted(refused.items()))
    if not done:
        return f"off: {why or 'no run of buffers covers a whole huge page'}"
    return f"on: {done} pages of {HUGE_PAGE >> 20} MiB" + (f" ({why})" if why else "")


def _anonymous_mappings() -> list[tuple[int, int]]:
    """This process's anonymous memory ([start, end) of each mapping with no file: the heap and
    malloc's own mappings), from /proc/self/maps; none where there is no such file."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] == "[heap]":
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi))
    return out
