"""The GPU check's report: the phases' results joined into one JSON object, the targets checked
(each with by how much it is missed), and the Markdown tables that go into docs/benchmarks.md.

Targets (issue 18): the first speed shape (Llama-3-8B on the GPU) at batch 1 decodes one token
within 1.3x the HBM floor (the bytes a step reads / the measured read bandwidth); through the text
service at the first stream count (64) the stack serves >= 0.8x the engine alone. A missed target
names where the time went: the batch-1 step's pieces, or the decode service's own ratio. Issue
42's for fp8 weights (the weights phase): batch 1 within 1.3x its own floor (the fp8 bytes), and
the largest batch >= 1.4x the dtype's own tok/s at that batch (speed-0's).
"""

from __future__ import annotations

import math
import re
import statistics
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.gpu_check.plan import Plan

TPOT_LIMIT = 1.3  # x the HBM floor
SERVED_MIN = 0.8  # x engine-only tok/s
H100_8B_BATCH1_MS = (7.6, 7.9)  # published anchors, bfloat16 (issue 18)
FP8_TPOT_LIMIT = 1.3  # x fp8's own HBM floor, batch 1 (issue 42)
FP8_SPEEDUP_MIN = 1.4  # x the dtype's own tok/s at the largest batch (issue 42)


def junit_summary(junit: Path, code: int, log: str) -> dict:
    """pytest's outcome from its JUnit XML; from its verbose log (one line per test) when it was
    stopped at its time limit before writing the XML."""
    if not junit.exists():
        outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, re.MULTILINE)
        if not outcomes:
            return {"error": f"pytest exited with {code} and wrote no report", "log_tail": log[-3000:]}
        counts = {k: sum(o == k for _, o in outcomes) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
        return {"tests": len(outcomes), "passed": counts["PASSED"], "failures": counts["FAILED"], "errors": counts["ERROR"],
                "skipped": counts["SKIPPED"], "failed": [t for t, o in outcomes if o in ("FAILED", "ERROR")], "exit": code,
                "unfinished": "stopped at its time limit: the counts are of the tests that ran" if code == 124 else "",
                "log_tail": log[-3000:]}
    suite = ET.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed, "seconds": float(suite.get("time", 0)), "exit": code,
            "log_tail": log[-3000:] if failed or code else ""}


def _median(values):
    return statistics.median(values) if values else math.nan


def stack_rows(stack: dict) -> list[dict]:
    """transport.py's measurements -> one row per (streams, path), medians over rounds, and the
    ratio to the engine path taken within each round."""
    runs = {(r["streams"], r["path"]): r["rounds"] for r in stack.get("results", [])}
    rows = []
    for (streams, path), rounds in sorted(runs.items()):
        engine = runs.get((streams, "engine"), [])
        tok_s = [m["tokens"] / m["wall_s"] for m in rounds]
        ratios = [t / (e["tokens"] / e["wall_s"]) for t, e in zip(tok_s, engine)]
        rows.append({
            "streams": streams, "path": path, "tok_s": _median(tok_s), "vs_engine": _median(ratios),
            **{k: _median([m[k] for m in rounds]) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")},
        })
    return rows


def where_text(where: dict | str) -> str:
    """A missed target's `where`: the batch-1 step's pieces (time and GB/s each), or why the
    profile failed, or the served target's sentence."""
    if isinstance(where, dict) and "error" in where:
        return f"not profiled ({where['error']})"
    if isinstance(where, dict):
        return ", ".join(f"{k} {v['s'] * 1e3:.2f} ms" + (f" ({v['bytes'] / max(v['s'], 1e-9) / 1e9:.3g} GB/s)" if v.get("bytes") else "")
                         for k, v in where.items() if isinstance(v, dict))
    return where


def sampling_lines(speed: dict) -> list[str]:
    """The sampler's pieces alone on the device (phases.sampling_profile), a table with a column
    per batch size, or why they were not measured."""
    profile = speed.get("sampling")
    if not profile:
        return []
    if "error" in profile:
        return ["", f"Sampling alone: not measured ({profile['error']})"]
    rows = profile["rows"]
    out = ["", f"Sampling alone on {profile['platform']}, every row greedy, no alternatives (ms a call, best of 5, "
               f"vocabulary {rows[0]['vocab']:,}):", "",
           "| piece | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for name in rows[0]["s"]:
        out.append(f"| {name} | " + " | ".join(f"{r['s'][name] * 1e3:.3f}" for r in rows) + " |")
    return out


def engine_only_lines(stack: dict) -> list[str]:
    """The stack's streams over decode.py's decode steps alone at the same batch (same rounds):
    what prefill, first tokens and the scheduler cost before any transport."""
    only = stack.get("engine_only")
    if not only:
        return []
    steps = _median(only["tok_s"])
    served = ", ".join(f"{r['path']} {r['tok_s'] / steps:.2f}x" for r in stack_rows(stack) if r["streams"] == only["batch"])
    return ["", f"Over decode.py's decode steps alone at batch {only['batch']} ({steps:.0f} tok/s, no prefill in "
                f"the window): {served}"]


def targets(plan: Plan, results: dict) -> list[dict]:
    out = []
    speed = results.get("speed-0", {})
    row = next((r for r in speed.get("decode", {}).get("batches", []) if r["batch"] == 1), None)
    target = {"name": f"{plan.speed_shapes[0].name} {plan.dtype} batch-1 TPOT <= {TPOT_LIMIT}x HBM floor"}
    if row is None:
        target |= {"status": "not measured"}
    else:
        ratio = row["tpot_s"] / row["floor_s"]
        target |= {"measured": f"{row['tpot_s'] * 1e3:.2f} ms = {ratio:.2f}x the floor ({row['floor_s'] * 1e3:.2f} ms)",
                   "ratio": ratio, "status": "met" if ratio <= TPOT_LIMIT else
                   f"missed by {ratio / TPOT_LIMIT - 1:.0%} ({row['tpot_s'] * 1e3:.2f} ms against {TPOT_LIMIT * row['floor_s'] * 1e3:.2f} ms)"}
        if ratio > TPOT_LIMIT:
            target["where"] = speed["decode"].get("batch1_profile", {})
    out.append(target)
    rows = {(r["streams"], r["path"]): r for r in stack_rows(results.get("stack", {}))}
    n = plan.stack_streams[0]
    target = {"name": f"served through the text service at {n} streams >= {SERVED_MIN}x engine-only tok/s"}
    text, decode = rows.get((n, "text")), rows.get((n, "decode"))
    if text is None or math.isnan(text["vs_engine"]):
        target |= {"status": "not measured"}
    else:
        ratio = text["vs_engine"]
        target |= {"measured": f"{ratio:.2f}x ({text['tok_s']:.0f} tok/s)", "ratio": ratio,
                   "status": "met" if ratio >= SERVED_MIN else f"missed by {1 - ratio / SERVED_MIN:.0%}"}
        if ratio < SERVED_MIN and decode is not None:
            target["where"] = (f"the decode service alone serves {decode['vs_engine']:.2f}x engine-only; the text service "
                               f"{ratio:.2f}x; ITL p99 decode {decode['itl_p99_s'] * 1e3:.1f} ms, text "
                               f"{text['itl_p99_s'] * 1e3:.1f} ms")
    out.append(target)
    return out + fp8_targets(plan, results)


def fp8_targets(plan: Plan, results: dict) -> list[dict]:
    """Issue 42's two fp8 targets, from the weights phase (and speed-0 for the dtype's own); none
    when the plan times no fp8."""
    if "fp8" not in plan.weights:
        return []
    big = max(plan.batches)
    fp8 = results.get("weights", {}).get("formats", {}).get("fp8", {})
    rows = {r["batch"]: r for r in fp8.get("decode", {}).get("batches", [])}
    own = {r["batch"]: r for r in results.get("speed-0", {}).get("decode", {}).get("batches", [])}
    name = plan.speed_shapes[0].name
    floor = {"name": f"{name} fp8 batch-1 TPOT <= {FP8_TPOT_LIMIT}x its HBM floor"}
    if 1 not in rows:
        floor["status"] = "not measured"
    else:
        r = rows[1]
        ratio = r["tpot_s"] / r["floor_s"]
        floor |= {"measured": f"{r['tpot_s'] * 1e3:.2f} ms = {ratio:.2f}x the floor ({r['floor_s'] * 1e3:.2f} ms)", "ratio": ratio,
                  "status": "met" if ratio <= FP8_TPOT_LIMIT else f"missed by {ratio / FP8_TPOT_LIMIT - 1:.0%}"}
    speedup = {"name": f"{name} fp8 batch-{big} tok/s >= {FP8_SPEEDUP_MIN}x {plan.dtype}'s"}
    if big not in rows or big not in own:
        speedup["status"] = "not measured"
    else:
        ratio = rows[big]["tok_s"] / own[big]["tok_s"]
        speedup |= {"measured": f"{ratio:.2f}x ({rows[big]['tok_s']:.0f} against {own[big]['tok_s']:.0f} tok/s)", "ratio": ratio,
                    "status": "met" if ratio >= FP8_SPEEDUP_MIN else f"missed by {1 - ratio / FP8_SPEEDUP_MIN:.0%}"}
    return [floor, speedup]


def checks(results: dict) -> list[dict]:
    """Correctness: each must hold for the run to pass."""
    out = []
    golden = results.get("golden", {})
    if "checkpoints" in golden:
        worst = max(c["max_abs_diff"] for c in golden["checkpoints"].values())
        decisive = sum(c["decisive_steps"] for c in golden["checkpoints"].values())
        agree = sum(c["greedy_agree"] for c in golden["checkpoints"].values())
        tol = golden["tolerance"]
        out.append({"name": f"tiny checkpoints in {golden['dtype']} vs float32 goldens", "ok": golden["ok"],
                    "detail": f"max |d logit| {worst:.4f} (bound {tol['atol']} + {tol['rtol']} x row scale), "
                              f"greedy {agree}/{decisive} decisive steps"})
    compiles = {f"{name} {part}": r[part]["compilations_after_warm_up"] for name, r in results.items()
                if name.startswith("speed-") for part in ("decode", "prefill") if part in r}
    for fmt, r in results.get("weights", {}).get("formats", {}).items():
        compiles[f"weights {fmt} decode"] = r["decode"]["compilations_after_warm_up"]
    if "compilations_after_warm_up" in results.get("real-model", {}):
        compiles["real-model"] = results["real-model"]["compilations_after_warm_up"]
    if compiles:
        out.append({"name": "compilations after warm-up", "ok": not any(compiles.values()),
                    "detail": ", ".join(f"{k} {v}" for k, v in compiles.items())})
    real = results.get("real-model", {})
    if "answer" in real:
        out.append({"name": "the default model's answer", "ok": real["ok"],
                    "detail": f"{real['answer']!r} ({real['finish']}, {len(real['token_ids'])} tokens, {real['dtype']})"})
    tests = results.get("pytest", {})
    if "tests" in tests:
        out.append({"name": "device tests (pytest)", "ok": not tests["failures"] and not tests["errors"] and not tests.get("unfinished"),
                    "detail": f"{tests['passed']} passed, {tests['skipped']} skipped, {tests['failures']} failed, "
                              f"{tests['errors']} errors" + (f": {', '.join(tests['failed'][:8])}" if tests["failed"] else "")
                              + (f"; {tests['unfinished']}" if tests.get("unfinished") else "")})
    return out


def build(plan: Plan, results: dict, seconds: float) -> dict:
    errors = {name: r["error"] for name, r in results.items() if isinstance(r, dict) and "error" in r}
    found = checks(results)
    return {
        "profile": plan.profile, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": seconds,
        "plan": {"dtype": plan.dtype, "batches": plan.batches, "bandwidth_gib": plan.bandwidth_gib, "prefill_lengths": plan.prefill_lengths,
                 "stack_streams": plan.stack_streams, "stack_tokens": plan.stack_tokens},
        "checks": found, "targets": targets(plan, results), "errors": errors,
        "ok": not errors and all(c["ok"] for c in found), "phases": results,
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _ms(s: float) -> str:
    return "-" if s is None or math.isnan(s) else f"{s * 1e3:.2f}"


def _env_lines(summary: dict) -> list[str]:
    phases = summary["phases"]
    env = phases.get("env", {})
    devices = env.get("devices", [])
    kinds = sorted({f"{d['platform']} {d['kind']}" for d in devices})
    lines = [f"- JAX {env.get('versions', {}).get('jax')} (jaxlib {env.get('versions', {}).get('jaxlib')}), "
             f"Python {env.get('python')}, {env.get('cpus')} CPUs; devices: {len(devices)} x {', '.join(kinds) or '?'}"]
    for gpu in phases.get("nvidia-smi", {}).get("gpus", []):
        lines.append(f"- {gpu['name']}: {gpu['memory_free_mib'] / 1024:.1f} GiB free of {gpu['memory_total_mib'] / 1024:.1f} "
                     f"GiB (nvidia-smi, before the run), driver {gpu['driver']}")
    for d in devices:
        limit = d.get("memory", {}).get("bytes_limit")
        if limit:
            lines.append(f"- {d['kind']} {d['id']}: JAX's allocator may use {limit / 2**30:.1f} GiB")
    speed = phases.get("speed-0", {})
    if "bandwidth_gbs" in speed:
        lo, hi = speed["decode"]["bandwidth_gbs_range"]
        lines.append(f"- memory read bandwidth, measured (a jitted sum over {summary['plan']['bandwidth_gib']} GiB, "
                     f"median of rounds): {speed['bandwidth_gbs']:.0f} GB/s (range {lo:.0f}-{hi:.0f})")
    return lines


def markdown(summary: dict) -> str:
    phases = summary["phases"]
    out = [f"GPU check, profile `{summary['profile']}`, {summary['date']}, {summary['seconds']:.0f} s", ""]
    out += _env_lines(summary) + [""]
    out += ["| check | result | ok |", "|---|---|---|"]
    out += [f"| {c['name']} | {c['detail']} | {'yes' if c['ok'] else '**no**'} |" for c in summary["checks"]]
    out += ["", "| target | measured | status |", "|---|---|---|"]
    out += [f"| {t['name']} | {t.get('measured', '-')} | {t['status']} |" for t in summary["targets"]]
    for t in summary["targets"]:
        if "where" in t:
            out.append(f"\nWhere the time went ({t['name']}): {where_text(t['where'])}")
    decode_rows = [(r["shape"], r) for name, r in sorted(phases.items()) if name.startswith("speed-") and "decode" in r]
    if decode_rows:
        out += ["", "| model | batch | tok/s | TPOT ms | HBM floor ms | MBU |", "|---|---|---|---|---|---|"]
        for shape, r in decode_rows:
            for b in r["decode"]["batches"]:
                out.append(f"| {shape} | {b['batch']} | {b['tok_s']:.0f} | {_ms(b['tpot_s'])} | {_ms(b['floor_s'])} | {b['mbu']:.2f} |")
        out += ["", "| model | prompt tokens | prefill tok/s | seconds |", "|---|---|---|---|"]
        for shape, r in decode_rows:
            for p in r["prefill"]["lengths"]:
                out.append(f"| {shape} | {p['tokens']} | {p['tok_s']:.0f} | {p['s']:.3f} |")
        for _, r in decode_rows:
            out += sampling_lines(r)
        out += ["", "| model | warm-up s (compilations): decode | prefill | weights built s |", "|---|---|---|---|"]
        for shape, r in decode_rows:
            d, p = r["decode"], r["prefill"]
            out.append(f"| {shape} | {d['warm_up_s']:.1f} ({d['compilations_at_warm_up']}; rows {d['row_buckets']}) | "
                       f"{p['warm_up_s']:.1f} ({p['compilations_at_warm_up']}) | {r['weights_build_s']:.1f} |")
    out += weights_lines(phases)
    out += speculative_lines(phases)
    rows = stack_rows(phases.get("stack", {}))
    if rows:
        model = phases["stack"].get("model", {})
        out += ["", f"Stack: {model.get('shape')} ({_count(model.get('parameters', 0))} parameters, random), "
                f"{summary['plan']['stack_tokens']} tokens a stream:", "",
                "| streams | path | tok/s | x engine | TTFT p50 / p99 ms | ITL p50 / p99 ms |", "|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['streams']} | {r['path']} | {r['tok_s']:.0f} | {r['vs_engine']:.2f} | "
                       f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])} |")
        out += engine_only_lines(phases["stack"])
    out += ["", "| also | status |", "|---|---|",
            f"| int8 / fp8 weights | {_weights_line(phases)} |",
            f"| tensor parallelism | {_tp_line(phases)} |"]
    skipped = {k: v["skipped"] for k, v in phases.items() if isinstance(v, dict) and isinstance(v.get("skipped"), str)}
    for name, why in skipped.items():
        out.append(f"| {name} | skipped: {why} |")
    for name, error in summary["errors"].items():
        out.append(f"| {name} | **error**: {str(error).splitlines()[0][:200]} |")
    return "\n".join(out) + "\n"


def weights_lines(phases: dict) -> list[str]:
    """The weights phase's table: each quantized format at each batch, against its own floor and
    against the dtype's own tok/s at that batch (speed-0)."""
    w = phases.get("weights", {})
    if not w.get("formats"):
        return []
    own = {r["batch"]: r["tok_s"] for r in phases.get("speed-0", {}).get("decode", {}).get("batches", [])}
    out = ["", f"Quantized weights ({w['shape']}, activations {w['dtype']}):", "",
           "| weights | batch | tok/s | TPOT ms | HBM floor ms | MBU | weight GB | x " + w["dtype"] + " tok/s |",
           "|---|---|---|---|---|---|---|---|"]
    for fmt, r in w["formats"].items():
        for b in r["decode"]["batches"]:
            vs = f"{b['tok_s'] / own[b['batch']]:.2f}" if b["batch"] in own else "-"
            out.append(f"| {fmt} | {b['batch']} | {b['tok_s']:.0f} | {_ms(b['tpot_s'])} | {_ms(b['floor_s'])} | {b['mbu']:.2f} | "
                       f"{r['decode']['weight_bytes'] / 1e9:.2f} | {vs} |")
    return out


def speculative_lines(phases: dict) -> list[str]:
    """The speculative phase's table (issue 45): a verify step of K guesses against a plain step
    and the pipelined loop's time a token, per batch; at batch 1 the projected gain."""
    sp = phases.get("speculative", {})
    if "batches" not in sp:
        return []
    out = ["", f"Speculative decoding's verify step ({sp['shape']}, {sp['dtype']}, random weights; "
               "benchmarks/verify_step.py):", "",
           f"| batch | plain step ms | pipelined ms a token | verify ms ({', '.join(f'K={k}' for k in _guess_buckets(sp))}) | "
           f"verify K={sp['guesses']} / plain step |", "|---|---|---|---|---|"]
    for b in sp["batches"]:
        c = b["cases"]
        verify = ", ".join(f"{v['median_ms']:.2f}" for name, v in c.items() if name.startswith("verify"))
        ratio = c.get(f"verify K={sp['guesses']}", {}).get("over_decode", math.nan)
        out.append(f"| {b['batch']} | {c['decode']['median_ms']:.2f} | {c['pipelined']['median_ms']:.2f} | {verify} | {ratio:.2f} |")
    for b in sp["batches"]:
        for name, r in b.get("projected", {}).items():
            out.append(f"\nProjected at batch {b['batch']}, {name} (the default model's recorded answers replayed at these "
                       f"costs): on / off {r['on_off']:.2f}; a flawless lookup {r['every copy found']:.2f}, "
                       f"every guess right {r['every guess right']:.2f}")
    return out


def _guess_buckets(sp: dict) -> list[str]:
    return [name.removeprefix("verify K=") for name in sp["batches"][0]["cases"] if name.startswith("verify K=")]


def _weights_line(phases: dict) -> str:
    env = phases.get("env", {})
    if phases.get("weights", {}).get("formats"):
        return f"timed on this {env.get('backend')}: {', '.join(phases['weights']['formats'])} (the quantized weights table)"
    if not env.get("channel_weights"):
        return "not measured: the engine has no int8 path off the CPU kernels"
    return "not measured by this check: `--weights int8` and `fp8` exist on every backend; the weights phase did not run"


def _tp_line(phases: dict) -> str:
    devices = len(phases.get("env", {}).get("devices", []))
    if devices < 2:
        return f"not measured: `--tensor-parallel N` splits a model over N devices, and this machine has {devices}"
    return f"not measured by this check ({devices} devices): run `tokenwire decode-server --tensor-parallel {devices}`"
