"""A Gemma 3 GGUF (`general.architecture` "gemma3") as a Hugging Face Gemma3ForCausalLM directory.

Data flow: `gguf_convert.convert_gguf` sees "gemma3" -> `convert` reads the `gemma3.*` metadata,
dequantizes every tensor to float32 under HF's names (`GEMMA3_TENSORS`), builds tokenizer.json
from the SentencePiece vocabulary (gguf_tokenizer) and writes config.json, generation_config.json
and tokenizer_config.json beside model.safetensors, keeping the GGUF as model.gguf for `--weights
int8` (gguf_blocks reads it through the same GEMMA3_TENSORS).

What must hold for the directory to equal google's checkpoint (tests/test_pull_gemma3.py checks it
against transformers' own reading of the GGUF):
- llama.cpp's converter added 1 to every RMSNorm weight (Gemma multiplies by 1 + w); an HF
  checkpoint stores w, and its model adds the 1. `GEMMA3_TENSORS` subtracts it again, from the
  input, post-attention, pre- and post-feedforward, q, k and final norms alike.
- Gemma's q and k rows are not permuted (llama.cpp rotates Gemma's halves as HF does).
- What the file does not say, llama.cpp takes from the architecture, and so do we: five sliding
  layers to each global one, a local rope base of 10000, queries scaled by 1/sqrt(head_dim) (the
  27B model alone by 1/sqrt(hidden / heads)); a key present in the file wins.
- The file has no chat template (llama.cpp's GGUF-my-repo did not copy one), so the directory gets
  Gemma's turn format, `GEMMA_CHAT_TEMPLATE`; a template in the file wins. Generation ends at the
  file's EOS (<eos>) and at <end_of_turn>, as llama.cpp ends it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf

from engine.model_store.gguf_convert import (
    GGUF_NAME,
    GGUFConversionError,
    SpecialTokens,
    TensorMap,
    field_value,
    hf_tensors,
    read_special_tokens,
    write_json,
    write_safetensors,
    shortest_f32,
)
from engine.model_store.gguf_tokenizer import build_sentencepiece_tokenizer

END_OF_TURN = "<end_of_turn>"  # ends a turn of Gemma's chat format; generation stops at it
_SLIDING_PATTERN = 6  # every sixth layer is global (llama.cpp's default for gemma3)
_LOCAL_ROPE_BASE = 10000.0  # rope base of the sliding layers (likewise)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}


def gemma3_tensor_name(gguf_name: str) -> str:
    """`blk.3.post_ffw_norm.weight` -> `model.layers.3.post_feedforward_layernorm.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise GGUFConversionError(f"unsupported tensor {gguf_name!r} in a gemma3 GGUF (a tied head has no output.weight)")


GEMMA3_TENSORS = TensorMap(gemma3_tensor_name, permuted_heads={}, norm_shift=1.0)

# Gemma's turn format: a system message opens the first user turn; "assistant" is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = namespace(text='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set system.text = system.text + (message['content'] | trim) -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if system.text and role != 'model' -%}{{ system.text + '\\n\\n' }}{%- set system.text = '' -%}{%- endif -%}"
    "{{ (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Gemma3HParams:
    """Hyperparameters read from `gemma3.*` GGUF metadata, named as in HF's Gemma3TextConfig."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # K
    head_dim: int  # D
    sliding_window: int
    sliding_window_pattern: int  # layer i is global when (i + 1) % pattern == 0
    rope_theta: float  # the global layers' rope base
    rope_local_base_freq: float  # the sliding layers'
    query_pre_attn_scalar: int  # queries are scaled by its inverse square root
    final_logit_softcapping: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # V: rows of the embedding

    @property
    def layer_types(self) -> list[str]:
        pattern = self.sliding_window_pattern
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(self.num_hidden_layers)]


def read_gemma3_hparams(reader: gguf.GGUFReader) -> Gemma3HParams:
    def key(name: str, default: Any = None) -> Any:
        value = field_value(reader, f"gemma3.{name}", default)
        if value is None:
            raise GGUFConversionError(f"GGUF file lacks required metadata key 'gemma3.{name}'")
        return value

    if (arch := field_value(reader, "general.architecture")) != "gemma3":
        raise GGUFConversionError(f"not a gemma3 GGUF: its architecture is {arch!r}")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFConversionError("GGUF file has no token_embd.weight tensor")
    if any(t.name == "output.weight" for t in reader.tensors):
        raise GGUFConversionError("a gemma3 GGUF with its own output.weight (an untied head) is not supported")
    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 256))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise GGUFConversionError("gemma3 GGUF with value_length != key_length is not supported")
    softcap = field_value(reader, "gemma3.final_logit_softcapping", None)
    return Gemma3HParams(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        sliding_window=int(key("attention.sliding_window")),
        sliding_window_pattern=int(key("attention.sliding_window_pattern", _SLIDING_PATTERN)),
        rope_theta=shortest_f32(key("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=shortest_f32(key("rope.freq_base_swa", _LOCAL_ROPE_BASE)),
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,  # 62 layers: the 27B model
        final_logit_softcapping=None if softcap is None else shortest_f32(softcap),
        rms_norm_eps=shortest_f32(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        vocab_size=int(embed.shape[1]),  # GGUF shape [hidden, V]
    )


def expected_tensor_names(hp: Gemma3HParams) -> set[str]:
    names = set(_GLOBAL_NAMES.values())
    for i in range(hp.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _LAYER_NAMES.values()}
    return names


def eos_ids(reader: gguf.GGUFReader, specials: SpecialTokens) -> list[int]:
    """The file's EOS, then <end_of_turn> where the vocabulary has it."""
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    ids = [] if specials.eos_id is None else [specials.eos_id]
    if END_OF_TURN in tokens and tokens.index(END_OF_TURN) not in ids:
        ids.append(tokens.index(END_OF_TURN))
    return ids


def model_config(hp: Gemma3HParams, specials: SpecialTokens) -> dict[str, Any]:
    """config.json with the keys (and the values) of google's Gemma 3 checkpoints' own."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": hp.vocab_size,
        "hidden_size": hp.hidden_size,
        "intermediate_size": hp.intermediate_size,
        "num_hidden_layers": hp.num_hidden_layers,
        "num_attention_heads": hp.num_attention_heads,
        "num_key_value_heads": hp.num_key_value_heads,
        "head_dim": hp.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": hp.max_position_embeddings,
        "rms_norm_eps": hp.rms_norm_eps,
        "rope_theta": hp.rope_theta,
        "rope_local_base_freq": hp.rope_local_base_freq,
        "rope_scaling": None,
        "sliding_window": hp.sliding_window,
        "_sliding_window_pattern": hp.sliding_window_pattern,
        "layer_types": hp.layer_types,
        "query_pre_attn_scalar": hp.query_pre_attn_scalar,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": hp.final_logit_softcapping,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": True,
        "bos_token_id": specials.bos_id,
        "eos_token_id": specials.eos_id,  # as google's config.json; generation_config.json adds <end_of_turn>
        "pad_token_id": specials.pad_id,
        "torch_dtype": "float32",
    }


def tokenizer_config(reader: gguf.GGUFReader, tok, hp: Gemma3HParams, specials: SpecialTokens) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' text, the chat template, added tokens by id."""
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": specials.add_bos,
        "add_eos_token": bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp.max_position_embeddings,
    }
    for role, token_id in (("bos", specials.bos_id), ("eos", specials.eos_id),
                           ("pad", specials.pad_id), ("unk", specials.unk_id)):
        if token_id is not None:
            config[f"{role}_token"] = tokens[token_id]
    config["chat_template"] = field_value(reader, "tokenizer.chat_template", GEMMA_CHAT_TEMPLATE)
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    return config


def convert(reader: gguf.GGUFReader, gguf_path: Path, out: Path, log: Callable[[str], None]) -> Path:
    """Write the HF directory for the gemma3 GGUF `reader` reads (at `gguf_path`) into `out`.
    Everything is read and checked before anything is written."""
    hp = read_gemma3_hparams(reader)
    specials = read_special_tokens(reader)
    eos = eos_ids(reader, specials)
    tok = build_sentencepiece_tokenizer(reader)
    tok_config = tokenizer_config(reader, tok, hp, specials)
    log(f"dequantizing {len(reader.tensors)} tensors ({hp.num_hidden_layers} layers, hidden {hp.hidden_size}), "
        "norm weights less llama.cpp's +1")
    tensors = hf_tensors(reader, GEMMA3_TENSORS, expected_tensor_names(hp))

    out.mkdir(parents=True, exist_ok=True)
    log(f"writing {len(tensors)} float32 tensors ({sum(w.nbytes for w in tensors.values()) >> 20} MiB), the config "
        "and the tokenizer")
    write_safetensors(out, tensors)
    write_json(out / "config.json", model_config(hp, specials))
    write_json(out / "generation_config.json",
               {"bos_token_id": specials.bos_id, "eos_token_id": eos, "pad_token_id": specials.pad_id})
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tok_config)
    shutil.copyfile(gguf_path, out / GGUF_NAME)
    return out

