"""TextTokenizer loading, ids <-> text and special/eos ids on three real tokenizer families."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.errors import InvalidArgument
from support.examples import examples
from support.tokenizer_assets import ASSETS, load_tokenizer as load
from tokenizer_svc import DecoderTraits, TextTokenizer


@pytest.mark.parametrize(
    "name, vocab_size, eos, special, traits",
    [
        ("gpt2", 50257, {50256}, {50256}, DecoderTraits(byte_level=True, byte_fallback=False)),
        ("sp-bpe", 4000, {2}, {0, 1, 2}, DecoderTraits(byte_level=False, byte_fallback=True)),
        ("qwen3", 151669, {151645}, None, DecoderTraits(byte_level=True, byte_fallback=False)),
    ],
)
def test_loads_sizes_special_and_eos_ids(name, vocab_size, eos, special, traits):
    tok = load(name)
    assert tok.vocab_size == vocab_size
    assert tok.eos_token_ids == frozenset(eos)
    assert tok.vocabulary.decoder_traits == traits
    if special is not None:
        assert tok.special_token_ids == frozenset(special)


def test_qwen_special_ids_are_the_added_tokens_marked_special():
    tok = load("qwen3")
    assert {151643, 151644, 151645} <= tok.special_token_ids
    assert tok.encode("<think>") == [151667] and 151667 not in tok.special_token_ids  # added, not special


def test_eos_ids_are_the_union_of_config_generation_config_and_tokenizer_config(tmp_path: Path):
    shutil.copy(ASSETS / "sp-bpe" / "tokenizer.json", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert TextTokenizer.from_dir(tmp_path).eos_token_ids == frozenset({0, 1, 2})


def test_a_directory_with_only_tokenizer_json_loads_and_one_without_it_fails(tmp_path: Path):
    shutil.copy(ASSETS / "gpt2" / "tokenizer.json", tmp_path)
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == frozenset() and tok.chat_template is None
    with pytest.raises(FileNotFoundError):
        TextTokenizer.from_dir(tmp_path / "missing")


def test_special_token_text_encodes_to_its_id():
    tok = load("qwen3")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 151644
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 151645
    assert load("gpt2").encode("a<|endoftext|>") == [64, 50256]


@pytest.mark.parametrize("name", ["qwen3", "sp-bpe"])
def test_short_and_long_texts_take_their_own_entry_points_to_the_same_ids(name):
    """Up to INLINE_CHARS characters `encode` holds the GIL (plain encode), above them it goes
    through the batch entry point: each gives what the other would, post-processor included."""
    from tokenizer_svc.tokenizer import INLINE_CHARS

    tok = load(name)
    raw = tok._tokenizer
    line = "Hello <|im_start|>, world: 12345 \u00e9\u4e2d! "
    for text in (line, (line * (INLINE_CHARS // len(line) + 2))[: INLINE_CHARS + 7]):
        for special in (False, True):
            want = raw.encode_batch_fast([text], add_special_tokens=special)[0].ids
            assert raw.encode(text, add_special_tokens=special).ids == want
            assert tok.encode(text, add_special_tokens=special) == want


def test_add_special_tokens_runs_the_post_processor():
    tok = load("sp-bpe")
    assert tok.encode("hello", add_special_tokens=True) == [1, *tok.encode("hello")]


def test_decode_skips_special_tokens_unless_kept():
    tok = load("qwen3")
    ids = tok.encode("<|im_start|>assistant\nOK<|im_end|>")
    assert tok.decode(ids) == "assistant\nOK"
    assert tok.decode(ids, keep_special_tokens=True) == "<|im_start|>assistant\nOK<|im_end|>"


@pytest.mark.parametrize("name", ["gpt2", "sp-bpe", "qwen3"])
def test_decode_refuses_ids_outside_the_vocabulary(name):
    tok = load(name)
    with pytest.raises(InvalidArgument, match=rf"^token_ids\[1\]: {tok.vocab_size} is not in the vocabulary"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(InvalidArgument, match=r"^token_ids\[0\]: -1 is not in the vocabulary"):
        tok.decode([-1])


@settings(max_examples=examples(150), deadline=None)
@given(text=st.text(st.characters(blacklist_categories=["Cs"]), max_size=40))
def test_byte_level_round_trips_any_text(text):
    assert load("gpt2").decode(load("gpt2").encode(text)) == text
    assert load("qwen3").decode(load("qwen3").encode(text)) == unicodedata.normalize("NFC", text)


def test_sentencepiece_round_trip_drops_only_the_first_space_and_uses_byte_fallback():
    tok = load("sp-bpe")
    text = "def f(x):\n    return 中文 😀 𠜎"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(" lead")) == "lead"  # Metaspace prepends ▁; the decoder strips one space
    assert [tok.vocabulary.is_byte_token(i) for i in tok.encode("中")] == [False, True, True, True]
