"""scripts/gpu_check (benchmarks/gpu_check): the shapes it builds, the targets it checks, and the
whole check end to end in its smallest profile (smoke: every phase that the CPU can run, in
child processes, as on the GPU). No speed is asserted: the machine is shared and noisy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import phases, report
from benchmarks.gpu_check.plan import GPU, LLAMA3_8B, LLAMA32_1B, PROFILES, Plan

ROOT = Path(__file__).resolve().parent.parent


def test_model_shapes_have_the_published_parameter_counts():
    assert LLAMA3_8B.parameters() == 8_030_261_248
    assert LLAMA32_1B.parameters() == 1_235_814_400


@pytest.mark.parametrize("factor", [8, 16, 64])
def test_scaled_shapes_stay_valid_llamas(factor):
    for shape in (LLAMA3_8B, LLAMA32_1B):
        small = shape.scaled(factor)
        assert small.heads % small.kv_heads == 0 and small.hidden == small.heads * small.head_dim
        assert small.layers >= 2 and small.parameters() < shape.parameters() / factor


def test_profiles_round_trip_and_the_rehearsal_is_the_gpu_plan_scaled():
    for plan in PROFILES.values():
        assert Plan.from_json(plan.to_json()) == plan
    rehearsal = PROFILES["rehearsal"]
    same = ("dtype", "batches", "prompt_len", "prefill_lengths", "stack_streams", "stack_tokens", "goldens", "pytest_files")
    assert all(getattr(rehearsal, k) == getattr(GPU, k) for k in same)
    assert [s.name for s in rehearsal.speed_shapes] == [f"{s.name}/16" for s in GPU.speed_shapes]


def _results(tpot_s: float, floor_s: float, text_vs_engine: float) -> dict:
    engine = {"tokens": 1000, "wall_s": 1.0, "itl_p50_s": 0.01, "itl_p99_s": 0.02, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2}
    text = {**engine, "wall_s": 1.0 / text_vs_engine}
    return {
        "speed-0": {"decode": {"batches": [{"batch": 1, "tpot_s": tpot_s, "floor_s": floor_s}],
                               "batch1_profile": {"step, read at once": {"s": 0.001, "bytes": 10**9}}}},
        "stack": {"results": [{"streams": 64, "path": p, "rounds": [m]} for p, m in
                              (("engine", engine), ("decode", engine), ("text", text))]},
    }


def test_targets_say_met_or_by_how_much_they_are_missed():
    met, served, *fp8 = report.targets(GPU, _results(tpot_s=0.004, floor_s=0.0034, text_vs_engine=0.9))
    assert [t["status"] for t in fp8] == ["not measured", "not measured"]  # no weights phase in these results
    assert (met["status"], served["status"]) == ("met", "met") and "where" not in met
    missed, served, *_ = report.targets(GPU, _results(tpot_s=0.0068, floor_s=0.0034, text_vs_engine=0.6))
    assert missed["ratio"] == pytest.approx(2.0) and missed["status"].startswith("missed by 54%")
    assert missed["where"] == {"step, read at once": {"s": 0.001, "bytes": 10**9}}  # the step's pieces
    assert served["status"] == "missed by 25%" and "the decode service alone serves 1.00x" in served["where"]


def test_the_fp8_targets_set_batch_1_against_its_own_floor_and_the_largest_batch_against_the_dtype():
    """Issue 42: fp8 at batch 1 within 1.3x the floor of the bytes fp8 reads, and at the largest
    batch (256) >= 1.4x bfloat16's tok/s there (speed-0's row)."""
    def row(batch, tok_s, tpot_s=0.0, floor_s=1.0):
        return {"batch": batch, "tok_s": tok_s, "tpot_s": tpot_s, "floor_s": floor_s}
    results = {"speed-0": {"decode": {"batches": [row(1, 200.0), row(256, 20000.0)]}},
               "weights": {"formats": {"fp8": {"decode": {"batches": [row(1, 350.0, 0.0026, 0.002), row(256, 30000.0)]}}}}}
    floor, speedup = report.fp8_targets(GPU, results)
    assert floor["ratio"] == pytest.approx(1.3) and floor["status"] == "met"
    assert speedup["ratio"] == pytest.approx(1.5) and speedup["status"] == "met"
    results["weights"]["formats"]["fp8"]["decode"]["batches"][1]["tok_s"] = 21000.0
    results["weights"]["formats"]["fp8"]["decode"]["batches"][0]["tpot_s"] = 0.0039
    floor, speedup = report.fp8_targets(GPU, results)
    assert floor["status"] == "missed by 50%" and speedup["status"] == "missed by 25%"
    for b in results["weights"]["formats"]["fp8"]["decode"]["batches"]:
        b["mbu"] = 0.5
    results["weights"] |= {"shape": "llama-3-8b", "dtype": "bfloat16"}
    results["weights"]["formats"]["fp8"]["decode"]["weight_bytes"] = 8.5e9
    table = "\n".join(report.weights_lines(results))
    assert "| fp8 | 256 | 21000 | 0.00 | 1000.00 | 0.50 | 8.50 | 1.05 |" in table  # x bfloat16's 20,000 tok/s


def test_a_failed_batch_1_profile_says_why_and_the_stack_is_set_against_decode_steps_alone():
    assert report.where_text({"error": "ModelUsageError: a position past the context"}) == (
        "not profiled (ModelUsageError: a position past the context)")
    assert report.where_text({"step": {"s": 0.002, "bytes": 10**9}}) == "step 2.00 ms (500 GB/s)"
    assert report.where_text({"step": {"s": 0.002, "bytes": 10**9}, "host: dispatch": {"s": 0.0012}}) == (
        "step 2.00 ms (500 GB/s), host: dispatch 1.20 ms")  # host time reads no weights: no GB/s
    stack = _results(tpot_s=0.0068, floor_s=0.0034, text_vs_engine=0.9)["stack"]
    assert report.engine_only_lines(stack) == []  # a scripted stack has no decode.py steps
    stack["engine_only"] = {"batch": 64, "tok_s": [2000.0, 4000.0, 2500.0]}  # median 2500
    # the engine path's 1,000 tok/s and the text path's 900 over the median of decode.py's steps
    assert report.engine_only_lines(stack)[-1].endswith(
        "at batch 64 (2500 tok/s, no prefill in the window): decode 0.40x, engine 0.40x, text 0.36x")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_decode_speed_context_holds_every_step_slot_0_takes(name):
    """Slot 0 is in every step: per batch size one untimed and rounds x steps timed, then the
    batch-1 profile's 5 single steps, 5 runs of 8 lagged ones, 5 steps for the host's own
    timings and 5 with the full sampler (where it is split off). The first H200 run's context
    left room for 2, and the profile failed with a position past the context."""
    plan = PROFILES[name]
    taken = len(plan.batches) * (1 + plan.rounds * plan.steps) + 5 * (1 + 8 + 1 + 1)
    assert phases.decode_context(plan) >= plan.prompt_len + taken + 1
    assert phases.decode_context(plan) % 64 == 0


def test_device_tests_stopped_at_their_limit_are_counted_from_the_log_and_fail_the_check(tmp_path):
    log = ("tests/test_a.py::test_x PASSED [ 10%]\ntests/test_a.py::test_y[p-1] FAILED [ 20%]\n"
           "tests/test_b.py::test_z SKIPPED (no kernels) [ 30%]\n")
    tests = report.junit_summary(tmp_path / "absent.xml", 124, log)  # killed before writing its XML
    assert (tests["passed"], tests["failures"], tests["skipped"]) == (1, 1, 1) and tests["unfinished"]
    assert tests["failed"] == ["tests/test_a.py::test_y[p-1]"]
    (check,) = report.checks({"pytest": tests})
    assert not check["ok"] and "test_y[p-1]" in check["detail"]
    table = report.markdown(report.build(GPU, {"pytest": tests}, 1.0))
    assert "| device tests (pytest) | 1 passed, 1 skipped, 1 failed" in table and "| pytest | skipped" not in table


def test_the_gpu_profile_refuses_a_machine_without_an_accelerator(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--profile", "gpu", "--out", str(tmp_path),
                          "--work", str(tmp_path / "work")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--profile rehearsal" in run.stderr


def test_the_smoke_profile_runs_every_phase_and_writes_the_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--profile", "smoke", "--out", str(tmp_path),
                          "--work", str(tmp_path / "work")],  # (pytest's tmp, not a new folder under /tmp each run)
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert run.returncode == 0, (summary["errors"], run.stdout[-3000:], run.stderr[-3000:])
    assert summary["ok"] and not summary["errors"]
    phases = summary["phases"]
    assert phases["env"]["backend"] == "cpu" and phases["env"]["devices"]
    checks = {c["name"]: c for c in summary["checks"]}
    assert checks["tiny checkpoints in float32 vs float32 goldens"]["ok"]
    assert checks["compilations after warm-up"]["detail"] == "speed-0 decode 0, speed-0 prefill 0, weights fp8 decode 0"
    decode = phases["speed-0"]["decode"]
    assert [b["batch"] for b in decode["batches"]] == [1, 2]
    assert all(b["tok_s"] > 0 and 0 < b["mbu"] and b["floor_s"] > 0 for b in decode["batches"])
    assert decode["bandwidth_gbs"] > 0 and decode["compilations_at_warm_up"] > 0
    assert decode["attention"] == "cpu kernels"  # (the report says which attention ran; "pallas" on a GPU)
    profile = decode["batch1_profile"]
    assert set(profile) == {"step, read at once", "step, host one behind", "host: dispatch", "host: collect a finished step"}
    assert all(p["s"] > 0 for p in profile.values()) and profile["step, read at once"]["bytes"] > 0
    # No comparison of these times with one another: on a tiny CPU model the step and the host's
    # part are both a fraction of a millisecond, so their order is the host's noise, not a property.
    sampling = phases["speed-0"]["sampling"]
    assert sampling["platform"] == "cpu" and [r["batch"] for r in sampling["rows"]] == [1, 2]
    assert all(len(r["s"]) == 6 and all(t > 0 for t in r["s"].values()) for r in sampling["rows"])
    assert [p["tokens"] for p in phases["speed-0"]["prefill"]["lengths"]] == [32]
    rows = {r["path"]: r for r in report.stack_rows(phases["stack"])}
    assert set(rows) == {"engine", "decode", "text"} and rows["engine"]["vs_engine"] == 1.0
    assert all(r["tok_s"] > 0 and math.isfinite(r["ttft_p99_s"]) and math.isfinite(r["itl_p50_s"]) for r in rows.values())
    # the last two: fp8's, batch 1 against its floor, and (not timed in smoke: weights_batches (1,)) the largest batch
    assert [t.get("ratio", -1) > 0 for t in summary["targets"]] == [True, True, True, False]
    fp8 = phases["weights"]["formats"]["fp8"]["decode"]
    assert [b["batch"] for b in fp8["batches"]] == [1] and all(b["tok_s"] > 0 and b["floor_s"] > 0 for b in fp8["batches"])
    assert fp8["weight_bytes"] < 0.3 * decode["weight_bytes"]  # float32's own here: a byte a parameter against 4
    table = (tmp_path / "gpu-check.md").read_text()
    assert "| model | batch | tok/s | TPOT ms | HBM floor ms | MBU |" in table and "| 2 | text |" in table
    assert phases["stack"]["engine_only"]["batch"] == 2 and len(phases["stack"]["engine_only"]["tok_s"]) == 1
    assert "Over decode.py's decode steps alone at batch 2 (" in table
    assert "| piece | batch 1 | batch 2 |" in table and "| sampling.greedy (the split step's greedy variant) |" in table
    assert "| weights | batch | tok/s | TPOT ms | HBM floor ms | MBU | weight GB | x float32 tok/s |" in table
    assert "| int8 / fp8 weights | timed on this cpu: fp8" in table and "| tensor parallelism |" in table and "| pytest | skipped: not in this profile |" in table
    # speculative decoding's verify step (issue 45), on the one smoke shape: its one guess bucket
    # against a plain step and the pipelined loop, and batch 1's projection from the recorded answers
    sp = phases["speculative"]
    assert sp["shape"] == phases["speed-0"]["shape"] and [b["batch"] for b in sp["batches"]] == [1]
    cases = sp["batches"][0]["cases"]
    assert set(cases) == {"decode", "pipelined", "verify K=1"} and all(c["median_ms"] > 0 for c in cases.values())
    projected = sp["batches"][0]["projected"]
    assert set(projected) == {"copy", "chat"} and all(r["on_off"] > 0 and r["verify"] > 0 for r in projected.values())
    assert "| batch | plain step ms | pipelined ms a token | verify ms (K=1) | verify K=1 / plain step |" in table
    assert "Projected at batch 1, copy (the default model's recorded answers" in table


def test_the_paged_attention_benchmark_runs_its_smoke_shape_and_the_kernels_agree(tmp_path):
    """benchmarks/paged_attention.py, issue 41's GPU micro-benchmark (paged against contiguous
    decode attention), in its --smoke shape (Pallas interpret mode off a GPU, ~3 s of CPU): both
    kernels run on both cases over the same KV and agree, and each case reports its ratio.
    Without a GPU, the full shape is refused rather than run for hours in interpret mode."""
    import jax

    from benchmarks import paged_attention

    out = tmp_path / "paged.json"
    assert paged_attention.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["interpret"] == (jax.default_backend() != "gpu")
    assert set(result["cases"]) == {"full", "ragged"}
    for case in result["cases"].values():
        assert set(case) == {"paged", "contiguous"}
        assert case["paged"]["agree"] and case["paged"]["max_abs_diff"] <= 1e-5
        assert all(len(row["s"]) == 1 and row["s"][0] > 0 for row in case.values())
        assert case["paged"]["median_ratio"] > 0 and "target_met" in case["paged"]
    if jax.default_backend() != "gpu":
        assert paged_attention.main([]) == 2


def test_a_skipped_stack_writes_no_stack_model(tmp_path):
    """--skip stack leaves out the stack's model too (2 GB written on the GPU plan). Every other
    phase is skipped as well: what runs when it is not skipped is the smoke test's above."""
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run([str(ROOT / "scripts" / "gpu_check"), "--profile", "smoke", "--out", str(tmp_path),
                          "--work", str(tmp_path / "work"), "--skip", "env,golden,real-model,speed-0,stack,pytest,weights"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["phases"]["stack"] == {"skipped": "--skip"}, (run.stdout[-2000:], run.stderr[-2000:])
    assert "stack-model" not in summary["phases"]


def test_the_step_profile_reads_the_full_sampler_too_where_the_sampler_is_split_off():
    """An accelerator's model splits its sampler off (JaxModel `split_sampler`): the profile's
    greedy steps take the greedy variant, and one more line times the full one, after which the
    model picks variants as before. Not warmed up: the claim is which variant each of the
    profile's steps takes, and its batch-1 steps compile what they run (a few of the executables
    a warm-up compiles; nothing compiling after warm-up is test_split_sampler's claim)."""
    from benchmarks.decode import Slots
    from support import tiny_served

    model = tiny_served.load(split_sampler=True)  # test_split_sampler's split model: what it compiled is read back
    slots = Slots(model, 1, 4)
    model.sampler_calls.clear()
    profile = phases.step_profile(model, slots)
    assert profile["step, read at once, full sampler"]["s"] > 0, profile
    assert model.greedy_variant and model.sampler_calls["full"] == 5 and model.sampler_calls["greedy"] > 5
