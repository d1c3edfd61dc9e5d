"""How long `JaxModel.load` takes, each load in a fresh process, for one checkout or two side by
side (rounds interleaved, the order alternating): wall time, user and system CPU, minor page
faults. A load reads the checkpoint, places it on the device, builds the panel copies where the
CPU kernels run and moves what a step reads into huge pages; no warm-up, nothing compiled but the
head's transpose.

    python benchmarks/model_load.py [--before CHECKOUT] [--models gemma-3-270m,smollm2-135m-instruct]
        [--weights float32] [--rounds 3]

The models are registered names, pulled (`tokenwire pull NAME`) into the default cache first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: the checkout's own engine (first on sys.path), one load, one JSON line.
CHILD = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from engine.jax_backend.jax_model import JaxModel
from engine.model_store.registry import model_dir
start, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
JaxModel.load(model_dir(sys.argv[2]), max_batch_size=8, max_context_length=1024, weights=sys.argv[3])
end = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": time.perf_counter() - wall, "user": end.ru_utime - start.ru_utime,
                  "sys": end.ru_stime - start.ru_stime, "faults": end.ru_minflt - start.ru_minflt}))
"""


def load_once(checkout: Path, model: str, weights: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(checkout), model, weights], cwd=checkout,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{checkout}: the load of {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None, help="a baseline checkout (e.g. a git worktree of main)")
    parser.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct", help="comma-separated registered names")
    parser.add_argument("--weights", default="float32", choices=("float32", "int8", "auto"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    arms = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    print(f"load average before: {os.getloadavg()[0]:.2f}; weights {args.weights}; {args.rounds} rounds")
    got: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for name in args.models.split(","):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                got.setdefault((name, arm), []).append(load_once(arms[arm], name, args.weights))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| model | checkout | wall s, median (range) | user + system CPU s, median | minor faults, median |")
    print("|---|---|---|---|---|")
    for (name, arm), runs in got.items():
        walls = [g["wall"] for g in runs]
        cpu = statistics.median(g["user"] + g["sys"] for g in runs)
        faults = statistics.median(g["faults"] for g in runs)
        print(f"| {name} | {arm} | {statistics.median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f}) | {cpu:.1f} | {faults:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
