"""Keep XLA:CPU's per-call scratch memory resident between calls.

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_BYTES = 1 << 30  # freed heap memory kept for reuse before any is returned to the kernel

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
