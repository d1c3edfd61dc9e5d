"""The figures of docs/benchmarks.md, drawn from the benchmarks' JSON.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/img]
                               [--transport RUN.json ...] [--gpu-check gpu-check.json]

Writes three PNGs into --out:
- cpu_vs_llamacpp.png: decode tok/s against batch, ours and llama.cpp, from
  RESULTS/cpu_vs_llamacpp.json (vs_llamacpp.py prints a table and writes no JSON, so that file
  holds its figures, with the command, machine and date they came from);
- transport.png: what each service carries as a share of the engine without transport, from
  RESULTS/transport.json and from any `benchmarks/transport.py --json` output given with
  --transport (per-round ratios over the engine path, or over decode.py's steps with --real-model);
- gpu_roofline.png: time per token against the HBM floor (the bytes a step reads over the measured
  bandwidth) by batch, from a `scripts/gpu_check` report (gpu-check.json, or
  RESULTS/gpu_check_*.json, which holds the first H200 run's figures in that report's fields).

A file that lacks a field the figure needs is refused with the file and the field named. matplotlib
comes with the `dev` extra; the Agg backend draws without a display.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL = -1.0  # transport.py's step "time" for --real-model (benchmarks/transport.py: REAL)
TPOT_LIMIT = 1.3  # the GPU check's batch-1 target: within 1.3x the HBM floor (benchmarks/gpu_check/report.py)
PNG_METADATA = {"Software": None}  # no matplotlib version in the file, so a rerun with another one changes only pixels


class BadInput(ValueError):
    """A results file without what a figure needs; the message names the file and the field."""


def _field(doc: dict, key: str, where: str):
    if not isinstance(doc, dict) or key not in doc:
        raise BadInput(f"{where}: no field {key!r}")
    return doc[key]


@dataclass(frozen=True)
class Ratio:
    """One path's share of the baseline: the median of the per-round ratios and their range."""

    median: float
    low: float
    high: float


@dataclass(frozen=True)
class TransportRow:
    label: str
    baseline: str
    baseline_tok_s: float
    paths: dict[str, Ratio]
    target: float | None


def load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: {e}") from None


def cpu_series(doc: dict, where: str) -> tuple[list[int], list[dict]]:
    """The batches and each series (name, ours, median, low, high), every list one value a batch."""
    batches = _field(doc, "batches", where)
    series = _field(doc, "series", where)
    for i, s in enumerate(series):
        for key in ("name", "median", "low", "high"):
            value = _field(s, key, f"{where}: series[{i}]")
            if key != "name" and len(value) != len(batches):
                raise BadInput(f"{where}: series[{i}].{key} has {len(value)} values for {len(batches)} batches")
    return batches, series


def transport_summary(doc: dict, where: str) -> list[TransportRow]:
    """Rows of a summary file: each path's [median, low, high] share of its baseline."""
    rows = []
    for i, row in enumerate(_field(doc, "rows", where)):
        at = f"{where}: rows[{i}]"
        paths = {}
        for name, value in _field(row, "paths", at).items():
            if len(value) != 3:
                raise BadInput(f"{at}.paths[{name!r}]: want [median, low, high], got {value!r}")
            paths[name] = Ratio(*map(float, value))
        rows.append(TransportRow(_field(row, "label", at), _field(row, "baseline", at),
                                 float(_field(row, "baseline_tok_s", at)), paths, row.get("target")))
    return rows


def _tok_s(measurement: dict, where: str) -> float:
    return _field(measurement, "tokens", where) / _field(measurement, "wall_s", where)


def _ratio(values: list[float]) -> Ratio:
    return Ratio(statistics.median(values), min(values), max(values))


def transport_run(doc: dict, where: str) -> list[TransportRow]:
    """Rows of a `transport.py --json` document: per round, each path's tok/s over the engine path's
    (over decode.py's steps of the same round for --real-model, as the script's own table gives it)."""
    by_key: dict[tuple[float, int], dict[str, list[float]]] = {}
    for i, row in enumerate(_field(doc, "results", where)):
        at = f"{where}: results[{i}]"
        key = (float(_field(row, "step_ms", at)), int(_field(row, "streams", at)))
        by_key.setdefault(key, {})[_field(row, "path", at)] = [_tok_s(m, f"{at}.rounds[{r}]") for r, m in enumerate(_field(row, "rounds", at))]
    out = []
    for (step, streams), paths in sorted(by_key.items(), key=lambda kv: (kv[0][0] == REAL, -kv[0][0], -kv[0][1])):
        if step == REAL:
            base_name, base = "decode.py's steps", _field(_field(doc, "engine_only", where), "tok_s", where)
            label, shown = f"real model,\n{streams} streams", paths
        else:
            if "engine" not in paths:
                raise BadInput(f"{where}: {step:g} ms x {streams} streams has no engine path to compare with")
            base_name, base, shown = "engine in-process", paths["engine"], {p: v for p, v in paths.items() if p != "engine"}
            label = f"{step:g} ms steps,\n{streams} streams" if step else f"free steps,\n{streams} streams"
        names = {"engine": "engine in-process", "decode": "decode service", "text": "text service"}
        ratios = {names.get(p, p): _ratio([v / b for v, b in zip(values, base)]) for p, values in shown.items()}
        out.append(TransportRow(label, base_name, statistics.median(base), ratios, None))
    return out


def transport_rows(doc: dict, where: str) -> list[TransportRow]:
    if isinstance(doc, dict) and "rows" in doc:
        return transport_summary(doc, where)
    if isinstance(doc, dict) and "results" in doc:
        return transport_run(doc, where)
    raise BadInput(f"{where}: neither a summary (field 'rows') nor transport.py --json output (field 'results')")


def gpu_decode(doc: dict, where: str) -> dict[str, list[dict]]:
    """Each model shape's decode rows (batch, tpot_s, floor_s) from a gpu-check.json, or from one
    speed phase's own result file."""
    phases = doc.get("phases", {"speed": doc}) if isinstance(doc, dict) else {}
    out = {}
    for name, phase in phases.items():
        if not name.startswith("speed") or not isinstance(phase, dict) or "decode" not in phase:
            continue  # other phases, and speed phases that were skipped or failed
        at = f"{where}: phases[{name!r}]"
        rows = _field(_field(phase, "decode", at), "batches", at + ".decode")
        for i, row in enumerate(rows):
            for key in ("batch", "tpot_s", "floor_s"):
                _field(row, key, f"{at}.decode.batches[{i}]")
        out[_field(phase, "shape", at)] = rows
    if not out:
        raise BadInput(f"{where}: no speed phase with decode rows")
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("benchmarks/plots.py needs matplotlib: pip install -e '.[dev]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cpu(batches: list[int], series: list[dict], title: str, out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in series:
        lower = [m - lo for m, lo in zip(s["median"], s["low"])]
        upper = [hi - m for m, hi in zip(s["median"], s["high"])]
        ax.errorbar(batches, s["median"], yerr=[lower, upper], marker="o", capsize=3,
                    linestyle="-" if s.get("ours") else "--", label=s["name"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (concurrent streams)")
    ax.set_ylabel("decode tok/s (median, range of rounds)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def plot_transport(rows: list[TransportRow], out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 2.8 * len(rows)), 4.8))
    names = list(dict.fromkeys(p for row in rows for p in row.paths))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs, ys, err = [], [], [[], []]
        for i, row in enumerate(rows):
            if name in row.paths:
                r = row.paths[name]
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                ys.append(r.median)
                err[0].append(r.median - r.low)
                err[1].append(r.high - r.median)
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=name)
    for i, row in enumerate(rows):
        if row.target:
            ax.hlines(row.target, i - 0.45, i + 0.45, colors="black", linestyles=":", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r.label}\nover {r.baseline}\n({r.baseline_tok_s:,.0f} tok/s)" for r in rows], fontsize=7)
    ax.set_ylabel("tok/s served / tok/s of the baseline")
    ax.set_ylim(0, 1.25)
    ax.set_title("What the services carry against the engine alone (dotted: the target)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def plot_roofline(shapes: dict[str, list[dict]], title: str, out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (shape, rows) in enumerate(shapes.items()):
        color = f"C{k}"
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["tpot_s"] * 1e3 for r in rows], marker="o", color=color, label=f"{shape}: time per step")
        ax.plot(batches, [r["floor_s"] * 1e3 for r in rows], linestyle="--", color=color, label=f"{shape}: HBM floor")
        ax.plot(batches, [TPOT_LIMIT * r["floor_s"] * 1e3 for r in rows], linestyle=":", color=color, alpha=0.6,
                label=f"{shape}: {TPOT_LIMIT}x the floor (target at batch 1)")
    all_batches = sorted({r["batch"] for rows in shapes.values() for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(all_batches, [str(b) for b in all_batches])
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per decode step (one token a stream)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def draw(results: Path, out: Path, transport_runs: list[Path], gpu_check: Path | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    cpu_path = results / "cpu_vs_llamacpp.json"
    cpu = load_json(cpu_path)
    batches, series = cpu_series(cpu, str(cpu_path))
    plot_cpu(batches, series, f"SmolLM2-135M on the CPU, {cpu.get('machine', '?').split(',')[0]}, {cpu.get('date', '?')}",
             out / "cpu_vs_llamacpp.png")
    written.append(out / "cpu_vs_llamacpp.png")

    rows = []
    for path in [results / "transport.json", *transport_runs]:
        if path.exists() or path in transport_runs:
            rows += transport_rows(load_json(path), str(path))
    if not rows:
        raise BadInput(f"{results}: no transport.json, and no --transport given")
    plot_transport(rows, out / "transport.png")
    written.append(out / "transport.png")

    gpu_path = gpu_check or max(results.glob("gpu_check_*.json"), default=None)
    if gpu_path is None:
        raise BadInput(f"{results}: no gpu_check_*.json, and no --gpu-check given")
    gpu = load_json(gpu_path)
    gpus = [g.get("name", "?") for g in gpu.get("phases", {}).get("nvidia-smi", {}).get("gpus", [])]
    device = gpu.get("device") or " + ".join(gpus) or "the device"  # "device": the committed files' own field
    plot_roofline(gpu_decode(gpu, str(gpu_path)), f"Decode on {device}, {gpu.get('date', '?')[:10]}: random weights, "
                  f"{gpu.get('plan', {}).get('dtype', '?')}", 
                  out / "gpu_roofline.png")
    written.append(out / "gpu_roofline.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="the committed results files")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go")
    parser.add_argument("--transport", type=Path, action="append", default=[], help="a transport.py --json output to add (repeatable)")
    parser.add_argument("--gpu-check", type=Path, default=None, help="a gpu-check.json (default: the last RESULTS/gpu_check_*.json by name)")
    args = parser.parse_args(argv)
    try:
        for path in draw(args.results, args.out, args.transport, args.gpu_check):
            print(path)
    except BadInput as e:
        print(f"plots: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
