"""The model runs on 4 forced CPU devices, done once per test run in one child interpreter
(tests/support/tp_worker.py), for tests/test_tensor_parallel.py and tests/test_split_sampler.py,
whichever pytest-xdist workers run them (`runs`).

JAX fixes its device count when its backend starts, and the test session's has one device, so
these runs need a child started with JAX_NUM_CPU_DEVICES; each child is an interpreter start, a
JAX start and its models' compiles, so both files read the same one (a mesh of 2 is the first 2
of the 4 devices, as `--tensor-parallel 2` takes them on a bigger host).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
DEVICES = 4
RUNS = {"tiny-llama": (1, 2, 4), "tiny-qwen2": (4,), "tiny-qwen3": (4,), "tiny-qwen3-moe": (2,), "tiny-mixtral": (2,), "tiny-gemma3": (2,)}  # and tiny-qwen2 at 2: odd_vocabulary
# (each checkpoint split 4 ways, where its 2 kv heads are copied; 2 ways, one kv head a device, on
# tiny-llama and the odd tiny-qwen2)
RUNS["tiny-gemma2"] = (2,)  # issue 44: soft-capping, local and global layers
RUNS["tiny-phi3"] = (2,)  # issue 44: Phi-3's fused weights split at load, a window
RUNS["tiny-gpt-oss"] = (2,)  # issue 44: attention sinks split by head, expert biases split with their features
# Checkpoints whose runs here compare ids, logits and each device's share only, with no warm-up
# (so no "nothing compiles after warm-up" under the mesh), decoding through the split sampler's
# greedy variant (tp_worker: the accelerators' step; it gives the one-executable step's greedy ids
# under the mesh, the SPLIT run's claim): which shapes a warm-up covers is decided
# by the configuration's buckets and the layers' shardings, not by a checkpoint's widths, so that
# claim is checked where a sharding differs: the dense layer on tiny-llama (2 ways, kv heads split;
# at 4, where each kv head is copied, the copies widen the cache, not the set of programs, so that
# run compares ids, samples and shares unwarmed), the padded head and q/k/v biases on the odd
# tiny-qwen2 (2 ways), the experts on tiny-qwen3-moe (mesh.py's expert specs, its dense and MoE
# layers side by side; tiny-mixtral shares that sharding). tiny-qwen2 and tiny-qwen3 at 4 add widths (32-wide heads, q/k norms) and
# the other families add layer kinds (soft-caps, local and global windows, fused weights split at
# load, gpt-oss's sinks) whose shapes the in-process tests check on one device; their ids here check
# the splits (the sinks split by head with the heads, one number each: no shape of their own).
IDS_ONLY = frozenset({"tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-gemma3", "tiny-gemma2", "tiny-phi3", "tiny-gpt-oss"})
TWO_SLOTS = "tiny-llama"  # batch invariance, seeded sampling, the split sampler: one checkpoint (more slots, more compiles)
# The run whose model decodes through the split sampler and is warmed up: the accelerators' step
# under a mesh, whose ids, logprobs and seeded samples are compared with the one-device
# reference's one-executable step (TWO_SLOTS at 1), and the programs warm-up leaves out counted
# (none); at 4 ways TWO_SLOTS keeps the one-executable step, unwarmed.
SPLIT = f"{TWO_SLOTS}/2"
ODD = 509

_done: dict = {}


def odd_vocabulary(folder: Path) -> Path:
    """tiny-qwen2 with a tokenizer of 509 ids (V' = 509, prime): the head is padded to 510 at N = 2.
    The golden's greedy ids and top logits are all below 509, so they still hold (its run at N = 2
    is this one, which saves a model's compiles)."""
    shutil.copytree(ASSETS / "tiny-qwen2", folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {t: i for t, i in tokenizer["model"]["vocab"].items() if i < ODD}
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < ODD]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def runs(tmp_path_factory) -> dict:
    """The child's JSON (tp_worker's keys: "NAME/SIZE" per run, "tiny-qwen2/2" the odd
    vocabulary's), run once per test run: the first caller, in whichever
    pytest-xdist worker, runs the child under the run's lock and leaves its JSON in the run's
    directory (conftest, TOKENWIRE_TEST_RUN_DIR) for the other workers, which wait on the lock."""
    if not _done:
        shared = Path(os.environ["TOKENWIRE_TEST_RUN_DIR"]) / "forced-devices.json"
        with open(shared.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not shared.exists():
                shared.write_text(json.dumps(_run_child(tmp_path_factory)))
            _done.update(json.loads(shared.read_text()))
    return _done


def _run_child(tmp_path_factory) -> dict:
    specs = [f"{name}:{','.join(map(str, sizes))}:{2 if name == TWO_SLOTS else 1}" for name, sizes in RUNS.items()]
    specs.append(f"{odd_vocabulary(tmp_path_factory.mktemp('odd') / 'tiny-qwen2-509')}:2")
    # pinned to the CPU platform (so float32) even on a GPU host: greedy ids equal to one
    # device's and batch invariance are float32 CPU claims (tests/support/backend.py)
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(DEVICES), "JAX_PLATFORMS": "cpu"}
    if not os.environ.get("TOKENWIRE_TEST_NO_XLA_CACHE"):  # the run's compilation cache (conftest), as in-process
        env |= {"JAX_COMPILATION_CACHE_DIR": str(Path(os.environ["TOKENWIRE_TEST_RUN_DIR"]) / "xla"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.tp_worker", *specs], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,  # (~100 s of CPU; under the test's own bound)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    out["tiny-qwen2/2"] = next(v for k, v in out.items() if k.endswith("tiny-qwen2-509/2"))
    return out
