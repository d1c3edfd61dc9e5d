"""The import direction holds, and the text process runs without JAX.

The contracts live in pyproject.toml ([tool.importlinter]) and are checked with import-linter's
own `lint-imports`; a copy of the tree with one forbidden import added shows that a violation
fails with a message naming the import. The text-server test starts the real process (as
`tokenwire text-server` runs) with Python's import-time log and reads which modules it loaded.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from engine.core.engine import EngineConfig
from engine.core.scripted_model import ScriptedModel
from services.client import AsyncTextClient
from services.decode_server import start_decode_server

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("engine", "services", "tokenizer_svc", "protos")


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=tree, capture_output=True, text=True, env={"PYTHONPATH": str(tree)}, timeout=120
    )


def test_the_layering_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def copy_tree(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(module: Path, statement: str) -> None:
    module.write_text(module.read_text() + f"\n{statement}  # added by tests/test_layering.py\n")


def test_a_forbidden_import_fails_and_names_itself(tmp_path):
    tree = copy_tree(tmp_path)
    add_import(tree / "engine" / "core" / "events.py", "import jax")
    add_import(tree / "tokenizer_svc" / "stop_strings.py", "import grpc")
    add_import(tree / "engine" / "model_store" / "model_files.py", "from engine.core import stopping")
    result = lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert "engine.core is not allowed to import jax: - engine.core.events -> jax" in out
    assert "tokenizer_svc is not allowed to import grpc: - tokenizer_svc.stop_strings -> grpc" in out
    assert "engine.model_store is not allowed to import engine.core: - engine.model_store.model_files -> engine.core.stopping" in out


def imported_modules(importtime_log: str) -> set[str]:
    """Module names from `python -X importtime` lines: 'import time: self | cumulative | name'."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_log.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


async def test_the_text_server_process_never_imports_jax(tmp_path):
    # The scripted decoder's vocabulary and EOS ids are those of the tiny-llama tokenizer.
    model = ScriptedModel(vocab_size=512, eos_token_ids=frozenset({0, 2}), max_batch_size=2, max_context_length=128)
    decoder = await start_decode_server(model, EngineConfig(max_queue_size=4))
    log = tmp_path / "text.log"
    try:
        with log.open("w") as err:
            process = subprocess.Popen(
                [sys.executable, "-X", "importtime", "-m", "services.cli", "--log-level", "INFO", "text-server",
                 "--model", str(ROOT / "tests" / "assets" / "tiny-llama"),
                 "--decoder", f"127.0.0.1:{decoder.port}", "--port", "0"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
            )
        try:
            port = await _bound_port(log, process)
            async with AsyncTextClient(f"127.0.0.1:{port}", timeout=30) as client:
                completion = await client.complete("hello", max_output_tokens=3)  # the whole generation path
            assert completion.usage.completion_tokens == 3
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
    finally:
        await decoder.stop(None)
    modules = imported_modules(log.read_text())
    assert "services.text_server" in modules and "tokenizer_svc.tokenizer" in modules  # the log is complete
    loaded = sorted({m.split(".")[0] for m in modules if m.split(".")[0] in ("jax", "jaxlib")})
    loaded += sorted(m for m in modules if m.startswith("engine.jax_backend"))
    assert loaded == [], f"the text process imported {loaded}"


async def _bound_port(log: Path, process: subprocess.Popen) -> int:
    """The port the text server logs once it serves ("text service on HOST:PORT, ..."); bounded
    at 60 s on a busy machine, failing at once with the log if the process exits first."""
    from support.waiting import until

    def logged() -> str | None:
        if process.poll() is not None:
            raise AssertionError(f"text-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        return next((line for line in log.read_text().splitlines() if "text service on " in line), None)

    await until(logged, "the text server's 'text service on' line", limit_s=60, interval_s=0.1)
    return int(logged().split("text service on ", 1)[1].split(",", 1)[0].rsplit(":", 1)[1])
