"""One line that says which machine a benchmark ran on (figures are only comparable within a run)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def describe(*packages: str) -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in packages)
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}" + (f", {versions}" if versions else "")
    )
