"""Convert a GGUF file into a Hugging Face model directory: llama here, Gemma 3 in gguf_gemma.

Data flow: `model_registry.pull` fetches a .gguf -> `convert_gguf` reads it with the `gguf`
package (memory-mapped, no torch) -> writes `model.safetensors` (float32), `config.json`,
`generation_config.json`, `tokenizer.json` and `tokenizer_config.json`, and keeps the GGUF
itself as `model.gguf` -> the JAX model and the tokenizer service load that directory like any
HF checkpoint; with `--weights int8` the JAX model reads its matrices from `model.gguf` instead
(engine.model_store.gguf_blocks: Q8_0, Q4_0/1 and Q5_0/1 blocks as they are, other types requantized),
so a quantized model is never expanded to float32 to be served as int8. A "gemma3" file is handed
to engine.model_store.gguf_gemma, which writes the same files for Gemma3ForCausalLM.

What must hold for the output to equal the original HF checkpoint:
- Every weight is dequantized to float32 and reshaped to the *reversed* GGUF shape (GGUF lists
  dims fastest-first, ne0 = input features; HF/numpy list them slowest-first).
- llama.cpp permuted the rows of q_proj and k_proj so its rope could rotate adjacent pairs;
  HF rotates the two halves of each head. `unpermute_rope_rows` undoes exactly that.
- Each architecture's fixes live in one `TensorMap` (names, permuted rows, a norm shift), which
  the float32 conversion and gguf_blocks' int8 reader both apply, so the two agree.
- The tokenizer's pre-tokenizer is not stored in the GGUF, only its llama.cpp name
  (`tokenizer.ggml.pre`); `_PRE_TOKENIZERS` maps the names we know to the HF pipeline, and an
  unknown name is an error rather than a silently different tokenization.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.model_store.gguf_reader import open_gguf

GGUF_NAME = "model.gguf"  # the source GGUF, kept in the converted directory for `--weights int8`
_REQUIRED = object()
_TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL: a special token (<|im_start|>, <|endoftext|>, ...)
_TOKEN_TYPE_USER_DEFINED = 4  # matched verbatim in text, but not special


class GGUFConversionError(ValueError):
    """The GGUF file is valid but holds something this converter does not support."""


@dataclass(frozen=True)
class LlamaHParams:
    """Hyperparameters read from `llama.*` GGUF metadata, named as in HF's LlamaConfig."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # K
    head_dim: int  # D
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # V: rows of the embedding, which may exceed the tokenizer's vocabulary
    tie_word_embeddings: bool  # true when the GGUF has no separate output.weight


# ---------------------------------------------------------------------------------------------
# Metadata


def field_value(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFConversionError(f"GGUF file lacks required metadata key {key!r}")
        return default
    return field.contents()


def shortest_f32(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.999999747e-06. Keep the shortest
    decimal that round-trips through f32, i.e. what the original config said."""
    return float(str(np.float32(value)))


def read_llama_hparams(reader: gguf.GGUFReader) -> LlamaHParams:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")
    if field_value(reader, "llama.expert_count", 0):
        raise GGUFConversionError("mixture-of-experts llama GGUFs are not supported")
    scaling = field_value(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFConversionError(f"rope scaling {scaling!r} is not supported")

    heads = int(field_value(reader, "llama.attention.head_count"))
    hidden = int(field_value(reader, "llama.embedding_length"))
    head_dim = int(field_value(reader, "llama.attention.key_length", hidden // heads))
    rope_dims = int(field_value(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFConversionError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFConversionError("GGUF file has no token_embd.weight tensor")
    return LlamaHParams(
        num_hidden_layers=int(field_value(reader, "llama.block_count")),
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(field_value(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=shortest_f32(field_value(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=shortest_f32(field_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field_value(reader, "llama.context_length")),
        vocab_size=int(embed.shape[1]),  # GGUF shape [hidden, V]
        tie_word_embeddings="output.weight" not in names,
    )


# ---------------------------------------------------------------------------------------------
# Weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown -> error."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFConversionError(f"unsupported tensor {gguf_name!r} in a llama GGUF")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter did, per head, rows (2, R/2) -> (R/2, 2): it interleaved the first and
    second halves of each head so that rope rotates adjacent pairs. Here the rows of each head
    are read as (R/2, 2) and transposed back to (2, R/2), the half-split layout HF rotates.
    """
    rows = w.shape[0]  # H*D for q, K*D for k
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: gguf.ReaderTensor) -> np.ndarray:
    """Dequantize to float32, shaped as HF expects (reversed GGUF dims: [out, in] for matrices)."""
    try:
        flat = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise GGUFConversionError(f"tensor {t.name!r} has unsupported type {t.tensor_type.name}") from e
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.asarray(flat, dtype=np.float32).reshape(shape)


@dataclass(frozen=True)
class TensorMap:
    """How one architecture's GGUF tensors become its HF checkpoint's: the names, the matrices
    whose rows llama.cpp permuted for its rope (HF name suffix -> heads), and what llama.cpp added
    to every norm weight (Gemma: 1, which HF's Gemma models add themselves at run time). The float32
    conversion and `--weights int8` (gguf_blocks) both read through it, so they agree."""

    hf_name: Callable[[str], str]
    permuted_heads: dict[str, int]
    norm_shift: float = 0.0

    def fix_rows(self, name: str, w: np.ndarray) -> np.ndarray:
        """Rows of matrix `name` in HF's order ([out, ...], any trailing dims)."""
        for suffix, n_heads in self.permuted_heads.items():
            if name.endswith(suffix):
                return unpermute_rope_rows(w, n_heads)
        return w

    def fix_vector(self, name: str, w: np.ndarray) -> np.ndarray:
        """A 1-D tensor as HF holds it: a norm weight less the shift llama.cpp added."""
        return w - np.float32(self.norm_shift) if self.norm_shift and name.endswith("norm.weight") else w


def llama_tensor_map(hp: LlamaHParams) -> TensorMap:
    return TensorMap(hf_tensor_name, {"self_attn.q_proj.weight": hp.num_attention_heads,
                                      "self_attn.k_proj.weight": hp.num_key_value_heads})


def tensor_map(reader: gguf.GGUFReader) -> TensorMap:
    """The TensorMap for the file's `general.architecture` (llama or gemma3)."""
    if field_value(reader, "general.architecture") == "gemma3":
        from engine.model_store import gguf_gemma  # (it builds on this module)

        return gguf_gemma.GEMMA3_TENSORS
    return llama_tensor_map(read_llama_hparams(reader))


def hf_tensors(reader: gguf.GGUFReader, tmap: TensorMap, expected: set[str]) -> dict[str, np.ndarray]:
    """All GGUF tensors as float32 arrays under HF names, fixed as `tmap` says; every name in
    `expected` must be among them."""
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = tmap.hf_name(t.name)
        w = dequantize_tensor(t)
        w = tmap.fix_vector(name, w) if w.ndim == 1 else tmap.fix_rows(name, w)  # matrices: [out, in]
        out[name] = np.ascontiguousarray(w)
    if missing := sorted(expected - out.keys()):
        raise GGUFConversionError(f"GGUF file lacks tensors for {missing[:5]} ({len(missing)} missing)")
    return out


def convert_tensors(reader: gguf.GGUFReader, hp: LlamaHParams) -> dict[str, np.ndarray]:
    """A llama GGUF's tensors as float32 arrays under HF names, q/k rows un-permuted."""
    return hf_tensors(reader, llama_tensor_map(hp), _expected_tensor_names(hp))


def _expected_tensor_names(hp: LlamaHParams) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not hp.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(hp.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _LAYER_NAMES.values()}
    return names


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


# llama.cpp's `tokenizer.ggml.pre` name -> the HF pre-tokenizer it stands for.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "smollm": _smollm_pre_tokenizer,
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool


def read_special_tokens(reader: gguf.GGUFReader) -> SpecialTokens:
    def opt_id(key: str) -> int | None:
        value = field_value(reader, f"tokenizer.ggml.{key}", None)
        return None if value is None else int(value)

    return SpecialTokens(
        bos_id=opt_id("bos_token_id"),
        eos_id=opt_id("eos_token_id"),
        pad_id=opt_id("padding_token_id"),
        unk_id=opt_id("unknown_token_id"),
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equal to the one the GGUF was made from."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(f"tokenizer model {kind!r} is not supported: only 'gpt2' (byte-level BPE)")
    pre = field_value(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConversionError(f"pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZERS)})")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFConversionError("GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()

    specials = read_special_tokens(reader)
    special_ids = {i for i, ty in enumerate(types) if ty == _TOKEN_TYPE_CONTROL}
    special_ids |= {i for i in (specials.bos_id, specials.eos_id, specials.pad_id) if i is not None}
    user_ids = {i for i, ty in enumerate(types) if ty == _TOKEN_TYPE_USER_DEFINED} - special_ids
    # Added tokens already in the vocab keep their ids; ids ascend so the file reads in order.
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_ids)])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])

    byte_level = processors.ByteLevel(trim_offsets=False)
    if specials.add_bos and specials.bos_id is not None:
        bos = tokens[specials.bos_id]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, specials.bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def tokenizer_config(reader: gguf.GGUFReader, tok: Tokenizer, hp: LlamaHParams) -> dict[str, Any]:
    """`tokenizer_config.json`: special token strings, the chat template, added tokens by id."""
    specials = read_special_tokens(reader)
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": specials.add_bos,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp.max_position_embeddings,
    }
    for role, token_id in (("bos", specials.bos_id), ("eos", specials.eos_id),
                           ("pad", specials.pad_id), ("unk", specials.unk_id)):
        if token_id is not None:
            config[f"{role}_token"] = tokens[token_id]
    template = field_value(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return config


# ---------------------------------------------------------------------------------------------
# Configs and the whole conversion


def model_config(hp: LlamaHParams, specials: SpecialTokens) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp.vocab_size,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.max_position_embeddings,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": hp.tie_word_embeddings,
        "bos_token_id": specials.bos_id,
        "eos_token_id": specials.eos_id,
        "pad_token_id": specials.pad_id,
        "torch_dtype": "float32",
    }


def generation_config(specials: SpecialTokens) -> dict[str, Any]:
    return {"bos_token_id": specials.bos_id, "eos_token_id": specials.eos_id, "pad_token_id": specials.pad_id}


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_safetensors(out: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it 0600; the rest is 0644


def convert_gguf(gguf_path: Path | str, out_dir: Path | str, log: Callable[[str], None] = lambda _: None) -> Path:
    """Write an HF model directory for `gguf_path` into `out_dir` (created if absent) and return it;
    the GGUF itself is copied in as `model.gguf` (GGUF_NAME) for `--weights int8`.

    Everything is validated (arch, tokenizer, tensor names and types) before anything is written,
    so an unsupported file leaves no partial output behind.
    """
    out = Path(out_dir)
    log("reading the GGUF's metadata and tokenizer")
    reader = open_gguf(gguf_path)
    if field_value(reader, "general.architecture") == "gemma3":
        from engine.model_store import gguf_gemma  # (it builds on this module)

        return gguf_gemma.convert(reader, Path(gguf_path), out, log)
    hp = read_llama_hparams(reader)
    specials = read_special_tokens(reader)
    tok = build_tokenizer(reader)
    tok_config = tokenizer_config(reader, tok, hp)
    log(f"dequantizing {len(reader.tensors)} tensors ({hp.num_hidden_layers} layers, hidden {hp.hidden_size})")
    tensors = convert_tensors(reader, hp)

    out.mkdir(parents=True, exist_ok=True)
    log(f"writing {len(tensors)} float32 tensors ({sum(w.nbytes for w in tensors.values()) >> 20} MiB), the config "
        "and the tokenizer")
    write_safetensors(out, tensors)
    write_json(out / "config.json", model_config(hp, specials))
    write_json(out / "generation_config.json", generation_config(specials))
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tok_config)
    shutil.copyfile(gguf_path, out / GGUF_NAME)
    return out
