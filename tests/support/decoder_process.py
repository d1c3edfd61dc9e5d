"""`start_scripted_decoder`: tests/support/scripted_decoder.py as a process of its own, for tests
that kill or signal a decode server. Its stdout is read only up to its READY line (nothing more is
written there); its log goes to /dev/null, so no pipe fills while it serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.waiting import read_line

SCRIPT = Path(__file__).resolve().parent / "scripted_decoder.py"


def start_scripted_decoder(port: int, *args: str, host: str = "127.0.0.1") -> subprocess.Popen:
    """Start it on host:port and wait (bounded) until it serves; `args` are its other flags."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--host", host, "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        line = read_line(proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    assert line.startswith("READY"), f"scripted decoder did not start: {line!r}"
    return proc
