"""benchmarks/plots.py: the figures of docs/benchmarks.md, drawn from small inputs in a temporary
directory in the formats the benchmarks write (transport.py --json, a gpu-check.json), and the
committed results files read the same way."""

import json
from dataclasses import astuple
import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from PIL import Image

from benchmarks import plots

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _round(tokens: int, wall_s: float) -> dict:
    return {"tokens": tokens, "wall_s": wall_s, "itl_p50_s": 0.002, "itl_p99_s": 0.004, "ttft_p50_s": 0.05,
            "ttft_p99_s": 0.1, "cpu_s": {}, "steal_share": 0.0, "messages": tokens // 3}


def _transport_run() -> dict:
    """transport.py --json's layout: two rounds of 2 ms steps x 4 streams, and of a real model's text path."""
    return {"machine": "test", "results": [
        {"step_ms": 2.0, "streams": 4, "path": "engine", "rounds": [_round(1000, 1.0), _round(1000, 0.5)]},
        {"step_ms": 2.0, "streams": 4, "path": "decode", "rounds": [_round(900, 1.0), _round(1000, 0.625)]},
        {"step_ms": -1.0, "streams": 4, "path": "text", "rounds": [_round(300, 1.0), _round(300, 1.0)]},
    ], "engine_only": {"batch": 4, "tok_s": [400.0, 250.0]}}


def _small_inputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    results = tmp_path / "results"
    results.mkdir()
    (results / "cpu_vs_llamacpp.json").write_text(json.dumps({
        "machine": "a test host, 2 vCPUs", "date": "2026-12-06", "batches": [1, 8],
        "series": [{"name": "ours", "ours": True, "median": [50, 300], "low": [45, 280], "high": [55, 310]},
                   {"name": "llama.cpp", "ours": False, "median": [48, 200], "low": [40, 190], "high": [52, 230]}]}))
    run = tmp_path / "transport-run.json"
    run.write_text(json.dumps(_transport_run()))
    gpu = tmp_path / "gpu-check.json"  # report.build's layout: a skipped phase, two speed phases
    rows = [{"batch": b, "tok_s": b / t, "tpot_s": t, "floor_s": t / 2, "mbu": 0.5} for b, t in ((1, 0.008), (8, 0.009))]
    gpu.write_text(json.dumps({"date": "2026-12-04 10:00 UTC", "plan": {"dtype": "bfloat16"}, "phases": {
        "nvidia-smi": {"gpus": [{"name": "Test GPU"}]}, "speed-1": {"skipped": "--skip"},
        "speed-0": {"shape": "llama-3-8b", "decode": {"batches": rows}}}}))
    return results, run, gpu


def _assert_a_drawn_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    with Image.open(path) as im:
        im.verify()  # the whole file decodes: chunks and checksums
    pixels = image.imread(path)  # [H, W, 4], floats in [0, 1]
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, pixels.shape
    colours = np.unique((pixels[::4, ::4, :3] * 255).astype(np.int64) @ np.array([1, 256, 65536]))  # [H/4 * W/4] -> distinct
    assert colours.size > 20 and (pixels[..., :3].max(axis=-1) < 0.5).mean() > 0.002, f"{path} is nearly blank"


def test_the_script_draws_three_pngs_from_the_benchmarks_json(tmp_path, capsys):
    results, run, gpu = _small_inputs(tmp_path)
    out = tmp_path / "img"
    assert plots.main(["--results", str(results), "--out", str(out), "--transport", str(run), "--gpu-check", str(gpu)]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == ["cpu_vs_llamacpp.png", "gpu_roofline.png", "transport.png"]
    for name in written:
        _assert_a_drawn_png(out / name)
    assert capsys.readouterr().out.split() == [str(out / n) for n in ("cpu_vs_llamacpp.png", "transport.png", "gpu_roofline.png")]


def test_a_transport_run_gives_each_paths_per_round_share_of_its_baseline():
    scripted, real = plots.transport_run(_transport_run(), "run")
    assert scripted.baseline == "engine in-process" and scripted.baseline_tok_s == 1500
    assert list(scripted.paths) == ["decode service"]  # the engine is the baseline, not a bar
    assert astuple(scripted.paths["decode service"]) == pytest.approx((0.85, 0.8, 0.9))  # 900/1000 and 1600/2000
    assert real.baseline == "decode.py's steps" and real.baseline_tok_s == 325
    assert astuple(real.paths["text service"]) == pytest.approx((0.975, 0.75, 1.2))  # 300/400 and 300/250


def test_a_file_without_a_needed_field_is_refused_naming_it(tmp_path, capsys):
    results, run, gpu = _small_inputs(tmp_path)
    doc = json.loads(gpu.read_text())
    del doc["phases"]["speed-0"]["decode"]["batches"][1]["floor_s"]
    gpu.write_text(json.dumps(doc))
    argv = ["--results", str(results), "--out", str(tmp_path / "img"), "--transport", str(run), "--gpu-check", str(gpu)]
    assert plots.main(argv) == 2
    assert "phases['speed-0'].decode.batches[1]: no field 'floor_s'" in capsys.readouterr().err


def test_the_committed_results_read_and_the_page_shows_the_committed_plots():
    results = ROOT / "benchmarks" / "results"
    batches, series = plots.cpu_series(plots.load_json(results / "cpu_vs_llamacpp.json"), "cpu")
    assert batches == [1, 8, 32] and {s["name"].split(" (")[0] for s in series} >= {"ours float32", "llama.cpp F32"}
    assert len(plots.transport_rows(plots.load_json(results / "transport.json"), "transport")) >= 2
    shapes = plots.gpu_decode(plots.load_json(results / "gpu_check_h200_2026-12-04.json"), "gpu")
    assert set(shapes) == {"llama-3-8b", "llama-3.2-1b"}
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", page)
    assert {"img/cpu_vs_llamacpp.png", "img/transport.png", "img/gpu_roofline.png"} <= set(shown)
    for png in shown:
        _assert_a_drawn_png(ROOT / "docs" / png)


@pytest.mark.parametrize("field", ["median", "batches"])
def test_a_cpu_file_that_does_not_add_up_is_refused(field):
    doc = {"batches": [1, 8], "series": [{"name": "ours", "median": [1, 2], "low": [1, 2], "high": [1, 2]}]}
    if field == "median":
        doc["series"][0]["median"] = [1]
    else:
        del doc["batches"]
    with pytest.raises(plots.BadInput, match=field):
        plots.cpu_series(doc, "cpu")
