"""The persistent compilation cache: a second start loads warm-up's executables instead of
compiling them, and a cache directory someone else could write is never used.

The start-ups run in fresh interpreters (the cache is JAX's process-wide configuration, which
must not leak into this test process), each loading the tiny model the way decode-server's
engine process does (`services.cli._load_model`) and warming it up."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"

START = """
import json, sys
import jax.monitoring
from pathlib import Path
from services.cli import _load_model
from services.config import ModelOptions
events = {"hits": 0, "misses": 0}
def count(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1
jax.monitoring.register_event_listener(count)
# kernels off: no g++ build into the fresh cache; a context of 64 (not the checkpoint's 256), one
# slot and one prompt chunk of 8: 17 executables written (the model's 10 shapes and JAX's own
# helpers; 20 with chunks of 8 and 16), as every shape is written and read back the same way
options = ModelOptions(64, "float32", False, Path(sys.argv[2]), None, compilation_cache=sys.argv[3] == "on",
                       max_prefill_chunk=8)
model = _load_model(Path(sys.argv[1]), 1, options)
model.warm_up()
print(json.dumps(events))
"""


def _start(cache: Path, on: str = "on") -> dict[str, int]:
    """-> how many of the start's compiles the persistent cache answered (hits) or missed."""
    result = subprocess.run(
        [sys.executable, "-c", START, str(ASSETS / "tiny-llama"), str(cache), on],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_executable_from_the_cache(tmp_path):
    first = _start(tmp_path)
    assert first["hits"] == 0 and first["misses"] > 10  # every shape compiled, and written
    assert any((tmp_path / "xla").iterdir())
    second = _start(tmp_path)
    assert second == {"hits": first["misses"], "misses": 0}  # all read back, none compiled


def test_a_cache_directory_others_can_write_is_refused(tmp_path, caplog):
    from engine.jax_backend import compilation_cache

    shared = tmp_path / "xla"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="engine.jax_backend.compilation_cache"):
        assert not compilation_cache.enable(shared)
    assert "no one else can write" in caplog.text and str(shared) in caplog.text
    file = tmp_path / "a-file"
    file.write_text("")
    assert not compilation_cache.enable(file / "xla")  # cannot be made: refused, logged, no exception


def test_a_process_keeps_the_first_directory_it_enables(tmp_path):
    """JAX keys every executable on the directory configured, while it goes on using the cache it
    opened first: a second directory (a test worker loading a model as a server does) would key the
    process's executables apart from every other process's. In a fresh interpreter (the cache is
    process-wide): the second `enable` is on, and changes nothing."""
    script = (
        "import sys, jax; from pathlib import Path; from engine.jax_backend import compilation_cache as c\n"
        "first, second = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "print(c.enable(first), c.enable(second), jax.config.jax_compilation_cache_dir)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "first"), str(tmp_path / "second")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True", str(tmp_path / "first")]
