"""Gemma 3 270M side by side with llama.cpp on the same GGUF (issue 44: "its CPU decode speed at
batch 1 and 8 >= llama.cpp's on the same file, side by side in one run").

    python benchmarks/vs_llamacpp_gemma.py [--rounds 3] [--batches 1,8] [--threads 2]
                                           [--weights auto] [--llama-dir /work/llama.cpp]

Ours: one `tokenwire decode-server` on the pulled gemma-3-270m (`tokenwire pull gemma-3-270m`),
with its default weights unless --weights says otherwise (auto: int8 on the CPU kernels, read from
the model's own Q4_K_M file: Q8_0 blocks as they are, Q5_0 as 5-bit blocks (a fused q/k/v with
a Q8_0 v in 8 bits), Q4_K as 4-bit blocks, Q6_K requantized to 8 bits; the log line "weights
auto: ..." is printed). llama.cpp: `llama-batched-bench` on that
very file (model.gguf in the pulled directory), the same thread count. Both decode random 64-token
prompts for 128 greedy tokens at each batch size; rounds interleave the two, in reversed order every
other round (vs_llamacpp.round_order says why). Build, server, client and the figures' definitions
are benchmarks/vs_llamacpp.py's ("decode only": tokens after every prompt is in, over that
window; llama.cpp's S_TG). An optional extra, never part of CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks import vs_llamacpp as vs  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.summary import median_range  # noqa: E402

MODEL = "gemma-3-270m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="auto", help="ours: decode-server's --weights (default: its own default)")
    parser.add_argument("--llama-dir", type=Path, default=Path("/work/llama.cpp"), help="where llama.cpp is built")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from engine.model_store.gguf_convert import GGUF_NAME
    from engine.model_store.registry import pull

    model_dir = pull(MODEL)
    gguf_path = model_dir / GGUF_NAME
    bin_dir = vs.build_llamacpp(args.llama_dir, args.jobs)
    kind = file_kind(gguf_path)
    print(describe("jax", "grpcio"), flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    log_dir = args.llama_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = vs.Server(args.weights, args.threads, str(model_dir), max(batches))
    try:
        server.start(log_dir)
        server.wait_ready()
        chose = [line.strip() for line in server.log.read_text().splitlines() if "weights auto:" in line]
        print(f"ours: --weights {args.weights}" + (f" ({chose[-1].split('weights auto:', 1)[1].strip()})" if chose else ""), flush=True)
        ours, theirs = rounds(args, server, bin_dir, gguf_path, kind, batches)
        rss = server.peak_rss_mb()
    finally:
        server.stop()
    report(args, ours, theirs, kind, batches, rss)
    print(f"load average at end: {os.getloadavg()}", flush=True)


def file_kind(path: Path) -> str:
    """The GGUF's declared type (general.file_type, e.g. "Q4_K_M"): its mix of block types."""
    import gguf

    from engine.model_store.gguf_reader import open_gguf

    value = open_gguf(path).get_field("general.file_type").contents()
    return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")


def rounds(args, server: vs.Server, bin_dir: Path, gguf_path: Path, kind: str, batches: list[int]):
    """Interleaved rounds: (ours, llama.cpp), each {batch: {"s_tg": [...], "s_all": [...]}}."""
    ours, theirs = vs.Results(), vs.Results()
    vs.ours_round(server, 1, seed=0)  # untimed: the server compiled every shape at warm-up
    for r in range(args.rounds):
        for b in batches:
            pair = [("ours", lambda: vs.ours_round(server, b, seed=r + 1)),
                    ("llama.cpp", lambda: vs.llama_batched_bench(bin_dir, gguf_path, b, args.threads))]
            for who, measure in (pair if r % 2 == 0 else pair[::-1]):
                figures = measure()
                (ours if who == "ours" else theirs).add(who, b, figures)
                print(f"  {who} B={b}: decode only {figures['s_tg']:.1f}, prefill incl. {figures['s_all']:.1f} tok/s", flush=True)
        print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()}", flush=True)
    return ours.rows["ours"], theirs.rows["llama.cpp"]


def report(args, ours: dict, theirs: dict, kind: str, batches: list[int], rss: float) -> None:
    threads = vs._threads(args.threads)
    print(f"\nGemma 3 270M ({kind} file), prompt {vs.PROMPT_LEN}, {vs.NEW_TOKENS} new tokens, {args.rounds} "
          f"interleaved rounds, {threads}: tok/s, median (range); cells are decode only / prefill included")
    print("| tok/s | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for label, cells in ((f"ours --weights {args.weights}", ours), (f"llama.cpp {kind}", theirs)):
        line = " | ".join(f"{median_range(cells[b]['s_tg'], '{:.1f}')} / {median_range(cells[b]['s_all'], '{:.1f}')}" for b in batches)
        print(f"| {label} | {line} |")
    medians = ", ".join(f"B={b} {statistics.median(ours[b]['s_tg']) / statistics.median(theirs[b]['s_tg']):.2f}x" for b in batches)
    per_round = ", ".join(
        f"B={b} {median_range([x / y for x, y in zip(ours[b]['s_tg'], theirs[b]['s_tg'])], '{:.2f}')}" for b in batches)
    print(f"\nours / llama.cpp, decode only: ratio of medians {medians}; per round {per_round}")
    print(f"Peak RSS of the decode server (VmHWM): {rss:.0f} MB")


if __name__ == "__main__":
    main()
