"""A GGUF file's header and tensors, parsed by gguf-py, without numpy.memmap's per-view cost.

gguf-py's `GGUFReader` maps the file as a `numpy.memmap` and parses the header into views of it,
one view per element of every metadata array. Gemma 3's vocabulary of 262k pieces (tokens,
scores, types) makes about a million views, and each view of a memmap runs numpy's bookkeeping for
that subclass (`memmap.__array_finalize__` and its `__getitem__`): in a profile, three quarters
of the parse, which for Gemma 3 270M's file takes seconds of CPU, paid by `tokenwire pull` and by
every `--weights int8` start on it (figures: docs/notes/test-suite-time.md, the eighth pass as a
whole run).

`GGUFFile` is GGUFReader reading the same mapping as a plain ndarray: the same memory, read-only
where the file was opened so, kept mapped by the memmap it views. gguf-py's own parse runs
unchanged over it and gives the same fields and tensors (tests/test_gguf_reader.py), in a
fraction of the time. Only the type of the views differs (the tensors' data are ndarrays over the
mapping, not memmaps). This leans on one detail of gguf-py (pinned in pyproject.toml): that the
parse reads the file through the `data` attribute its constructor sets. A release that stopped
doing so would lose the speed, not the result.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


class GGUFFile(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memory map (see the module docstring)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._mapped = mapped  # keeps the mapping open while any view of it lives
        self._plain = mapped.view(np.ndarray)


def open_gguf(path: Path | str) -> GGUFFile:
    """The GGUF at `path`, memory-mapped read-only, its header parsed."""
    return GGUFFile(path, "r")
