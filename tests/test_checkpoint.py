"""engine.model_store.checkpoint on the tiny Hugging Face directories (tests/assets/tiny-*): config fields,
EOS union, sharded loading, and errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.jax_backend import weights as device_weights
from engine.model_store.checkpoint import CheckpointError, RopeScaling, load_checkpoint, parse_config, tokenizer_size
from engine.jax_backend.jax_model import JaxModel

ASSETS = Path(__file__).parent / "assets"
EOT, IM_END = 0, 2  # <|endoftext|>, <|im_end|> in the shared tiny tokenizer


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ASSETS / name, tmp_path / name))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "name, arch, layers, head_dim, tied, qkv_bias, qk_norm, theta",
    [
        ("tiny-llama", "LlamaForCausalLM", 2, 16, False, False, False, 10000.0),
        ("tiny-qwen2", "Qwen2ForCausalLM", 3, 16, True, True, False, 1e6),
        ("tiny-qwen3", "Qwen3ForCausalLM", 2, 32, False, False, True, 1e6),
    ],
)
def test_loads_config_and_weights(name, arch, layers, head_dim, tied, qkv_bias, qk_norm, theta):
    ckpt = load_checkpoint(ASSETS / name)
    c = ckpt.config
    assert (c.architecture, c.n_layers, c.head_dim) == (arch, layers, head_dim)
    assert (c.vocab_size, c.hidden_size, c.n_heads, c.n_kv_heads, c.ffn_size) == (512, 64, 4, 2, 128)
    assert (c.tie_word_embeddings, c.qkv_bias, c.qk_norm, c.rope_theta) == (tied, qkv_bias, qk_norm, theta)
    assert (c.max_position_embeddings, c.rms_eps, c.sliding_window) == (256, 1e-6, None)
    hash(c)  # static argument of jit
    w = ckpt.weights
    assert w.embed.shape == (512, 64) and w.embed.dtype == np.float32
    assert len(w.layers) == layers
    first = w.layers[0]
    assert first.w_qkv.shape == (64, (4 + 2 * 2) * head_dim)
    assert first.w_o.shape == (4 * head_dim, 64)
    assert first.w_gate_up.shape == (64, 256) and first.w_down.shape == (128, 64)
    assert w.lm_head.shape == (64, 512)  # [E, V'], its own array even when tied
    if tied:
        np.testing.assert_array_equal(w.lm_head, np.asarray(w.embed).T)
    assert ckpt.tokenizer_size == 512
    assert (first.b_qkv is not None) == qkv_bias
    assert (first.q_norm is not None) == qk_norm
    assert ckpt.eos_token_ids == frozenset({EOT, IM_END})


def test_llama3_rope_scaling_in_both_config_styles(tmp_path):
    """transformers 5 writes `rope_parameters`; hub checkpoints have `rope_scaling` + `rope_theta`."""
    new = json.loads((ASSETS / "tiny-llama" / "config.json").read_text())
    expected = RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert parse_config(new).rope_scaling == expected
    scaling = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    old = dict(new, rope_theta=10000.0, rope_scaling=scaling)
    del old["rope_parameters"]
    assert parse_config(old) == parse_config(new)


def test_eos_is_the_union_of_config_generation_config_and_tokenizer(tmp_path):
    d = _copy("tiny-qwen3", tmp_path)
    _edit_json(d / "config.json", eos_token_id=[5, 6])
    _edit_json(d / "generation_config.json", eos_token_id=7)
    _edit_json(d / "tokenizer_config.json", eos_token={"content": "<|im_start|>", "special": True})
    assert load_checkpoint(d).eos_token_ids == frozenset({1, 5, 6, 7})
    (d / "generation_config.json").unlink()
    _edit_json(d / "config.json", eos_token_id=None)
    assert load_checkpoint(d).eos_token_ids == frozenset({1})


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    d = _copy("tiny-qwen2", tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in halves.items():
        save_file({n: tensors[n] for n in part}, d / shard)
        weight_map.update({n: shard for n in part})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded, single = load_checkpoint(d), load_checkpoint(ASSETS / "tiny-qwen2")
    assert sharded.config == single.config
    for a, b in zip(jax.tree_util.tree_leaves(sharded.weights), jax.tree_util.tree_leaves(single.weights)):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_on_request():
    w = device_weights.load_checkpoint(ASSETS / "tiny-llama", dtype="bfloat16").weights
    assert w.embed.dtype.name == "bfloat16" and w.layers[1].w_qkv.dtype.name == "bfloat16"


def test_unsupported_architecture_is_named(tmp_path):
    d = _copy("tiny-llama", tmp_path)
    _edit_json(d / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_checkpoint(d)


def test_missing_tensor_is_named(tmp_path):
    d = _copy("tiny-llama", tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"LlamaForCausalLM: tensor model\.layers\.1\.mlp\.up_proj\.weight miss"):
        load_checkpoint(d)


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path):
    d = _copy("tiny-qwen3", tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="lm_head.weight missing"):
        load_checkpoint(d)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    d = _copy("tiny-qwen3", tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(48, 64\), expected \(64, 64\)"):
        load_checkpoint(d)


def test_mistral_loads_with_or_without_a_window_and_refuses_a_bad_one(tmp_path):
    d = _copy("tiny-llama", tmp_path)
    _edit_json(d / "config.json", architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert load_checkpoint(d).config.architecture == "MistralForCausalLM"
    _edit_json(d / "config.json", sliding_window=16)  # below the context: served (tests/test_sliding_window.py)
    assert load_checkpoint(d).config.sliding_window == 16
    for bad in (0, -4, 2.5, "16"):
        _edit_json(d / "config.json", sliding_window=bad)
        with pytest.raises(CheckpointError, match="sliding_window must be a whole number >= 1"):
            load_checkpoint(d)


def test_unsupported_rope_type_and_activation_are_named(tmp_path):
    raw = json.loads((ASSETS / "tiny-llama" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="'yarn'"):
        parse_config(dict(raw, rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(CheckpointError, match="gelu"):
        parse_config(dict(raw, hidden_act="gelu"))
    with pytest.raises(CheckpointError, match="lacks intermediate_size"):
        parse_config({k: v for k, v in raw.items() if k != "intermediate_size"})


def test_tokenizer_json_is_read_once_per_version_of_the_file_for_the_size_and_the_eos_set(tmp_path, monkeypatch):
    """A load asks for the size several times (the memory plan, the weights, the service) and for
    the EOS token's id: the file is parsed once for all of them (each read of it counted as
    model_files reads it), and an edited file (another size or time) is parsed again."""
    from engine.model_store import model_files

    reads, read_json = [], model_files.read_json
    monkeypatch.setattr(model_files, "read_json", lambda path: (reads.append(path.name), read_json(path))[1])
    d = _copy("tiny-llama", tmp_path)
    assert [tokenizer_size(d, 512), tokenizer_size(d, 300), tokenizer_size(d, 512)] == [512, 300, 512]
    assert model_files.eos_token_ids(d) == {0, 2}  # tokenizer_config.json's eos_token, an added token: from the same parse
    assert reads.count("tokenizer.json") == 1
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    _edit_json(d / "tokenizer.json", added_tokens=[*tokenizer["added_tokens"], {"id": 700, "content": "<x>"}])
    assert tokenizer_size(d, 1024) == 701 and reads.count("tokenizer.json") == 2


def test_tokenizer_size_is_one_past_the_largest_id_and_caps_the_head(tmp_path):
    """Model vocab (a dict, or a Unigram list) and added tokens count; at most the embedding rows;
    no tokenizer.json means every embedded id can be produced."""
    d = _copy("tiny-llama", tmp_path)
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    small = {t: i for t, i in vocab.items() if i < 300}
    _edit_json(d / "tokenizer.json", model=dict(tokenizer["model"], vocab=small))
    assert tokenizer_size(d, 512) == 300
    _edit_json(d / "tokenizer.json", added_tokens=[*tokenizer["added_tokens"], {"id": 400, "content": "<x>"}])
    assert tokenizer_size(d, 512) == 401
    assert tokenizer_size(d, 350) == 350
    assert load_checkpoint(d).weights.lm_head.shape == (64, 401)
    _edit_json(d / "tokenizer.json", model={"type": "Unigram", "vocab": [["a", 0.0]] * 10}, added_tokens=[])
    assert tokenizer_size(d, 512) == 10
    (d / "tokenizer.json").unlink()
    assert tokenizer_size(d, 512) == 512
