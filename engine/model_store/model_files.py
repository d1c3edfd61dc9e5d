"""What a Hugging Face model directory says about its end-of-sequence ids, read without JAX.

The one definition of the model's EOS set (the contract's invariant 9): the union of config.json's
and generation_config.json's `eos_token_id` (an int, a list, or null) and the id of
tokenizer_config.json's `eos_token` (a string or {"content": ...}) — they often disagree, and any of
them ends text. The engine (ModelInfo) and the text service (its tokenizer) both call it, so they
cannot disagree about a model, and the text service's start-up check compares like with like.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelFilesError(ValueError):
    """A model directory's files contradict each other (e.g. an eos token with no id)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file's object, or {} when the file does not exist."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    model_dir = Path(model_dir)
    ids = _config_ids(read_json(model_dir / "config.json").get("eos_token_id"))
    ids |= _config_ids(read_json(model_dir / "generation_config.json").get("eos_token_id"))
    token = read_json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and token:
        ids.add(_token_id(model_dir, token))
    return frozenset(ids)


def _config_ids(value: object) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


@dataclass(frozen=True)
class TokenizerIds:
    """What a load asks of tokenizer.json besides the tokenizer itself."""

    largest: int | None  # the largest id its model vocab and added tokens name (None: none)
    added: dict[str, int]  # each added (special) token's id, the first entry for a repeated content


def tokenizer_ids(model_dir: str | Path) -> TokenizerIds | None:
    """tokenizer.json's `TokenizerIds` (None where there is no such file), read once per version
    of the file: one load asks for them several times (the memory plan, the weights' head, the
    EOS set), and a large vocabulary's file is tens of MB of JSON (Gemma 3's 262k pieces: 33 MB,
    about a second a parse)."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return _tokenizer_ids(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def _tokenizer_ids(path: str, size: int, mtime_ns: int, ctime_ns: int) -> TokenizerIds:
    """(size and times: part of the cache's key, so a rewritten file is read again)"""
    tokenizer = read_json(Path(path))
    vocab = tokenizer.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]  # Unigram: a list
    added: dict[str, int] = {}
    for entry in tokenizer.get("added_tokens", []):
        ids.append(int(entry["id"]))
        added.setdefault(entry.get("content"), int(entry["id"]))
    return TokenizerIds(max(ids, default=None), added)


def _token_id(model_dir: Path, token: str) -> int:
    """The id of `token` in tokenizer.json: added (special) tokens first, then the model's vocab."""
    summary = tokenizer_ids(model_dir)
    if summary is not None and token in summary.added:
        return summary.added[token]
    tokenizer = read_json(model_dir / "tokenizer.json")  # (an eos token in the model's vocab: rare, read whole)
    vocab = tokenizer.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict) and token in vocab:
        return int(vocab[token])
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the index is the id
        for i, entry in enumerate(vocab):
            if entry and entry[0] == token:
                return i
    raise ModelFilesError(f"the tokenizer's eos token {token!r} has no id in {model_dir / 'tokenizer.json'}")
