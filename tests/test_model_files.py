"""The one definition of a model's EOS set, shared by the engine and the text service."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.model_store.checkpoint import load_checkpoint
from engine.model_store.model_files import ModelFilesError, eos_token_ids
from tokenizer_svc.tokenizer import TextTokenizer

TINY = Path(__file__).parent / "assets" / "tiny-llama"


def edit(path: Path, **fields) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    path.write_text(json.dumps(data))


def test_union_of_config_generation_config_and_tokenizer(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY, d)
    assert eos_token_ids(d) == {0, 2}  # config 0, generation_config [2, 0], <|im_end|> = 2
    edit(d / "config.json", eos_token_id=[5, 6])
    edit(d / "generation_config.json", eos_token_id=7)
    edit(d / "tokenizer_config.json", eos_token={"content": "<|im_start|>"})
    assert eos_token_ids(d) == {1, 5, 6, 7}
    # the engine and the text service read the same set, so the text service's check compares like with like
    assert load_checkpoint(d).eos_token_ids == TextTokenizer.from_dir(d).eos_token_ids == {1, 5, 6, 7}


def test_nulls_and_missing_files_contribute_nothing(tmp_path):
    assert eos_token_ids(tmp_path) == frozenset()
    edit(tmp_path / "config.json", eos_token_id=None)
    edit(tmp_path / "generation_config.json", eos_token_id=True)  # a bool is not an id
    assert eos_token_ids(tmp_path) == frozenset()


def test_an_eos_token_without_an_id_is_an_error_naming_it(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(TINY, d)
    edit(d / "tokenizer_config.json", eos_token="<|not_there|>")
    with pytest.raises(ModelFilesError, match="not_there"):
        eos_token_ids(d)


def test_unigram_vocab_list(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["<s>", 0], ["</s>", 0]]}}))
    edit(tmp_path / "tokenizer_config.json", eos_token="</s>")
    assert eos_token_ids(tmp_path) == {1}
