"""A tiny llama GGUF written with `gguf.GGUFWriter`, each matrix in the type a test asks for
(F32, Q8_0, Q4_0, Q4_1, ...), q and k rows permuted as llama.cpp's converter does: what
`--weights int8` reads straight from a GGUF (tests/test_int8.py).

Shapes: 2 layers, hidden 64, 4 heads / 2 kv heads of 16 dims, FFN 96 (every input a multiple of
the 32-value blocks), a byte-level vocabulary of 3 specials, the 256 byte symbols and one merge (260 rows).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers import pre_tokenizers

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 2, 64, 4, 2, 16, 96
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
T = gguf.GGMLQuantizationType

# HF name (with {i} for the layer) -> GGUF name
MATRICES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
VECTORS = {
    "model.norm.weight": "output_norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
}


def tokens() -> list[str]:
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]  # one merge: GGUF needs a list


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights ([out, in] matrices), scaled so activations stay moderate."""
    rng = np.random.default_rng(seed)
    shapes = {
        "model.embed_tokens.weight": (len(tokens()), HIDDEN),
        "model.layers.{i}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.{i}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.{i}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.{i}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.layers.{i}.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.{i}.mlp.up_proj.weight": (FFN, HIDDEN),
        "model.layers.{i}.mlp.down_proj.weight": (HIDDEN, FFN),
    }
    w = {}
    for name, shape in shapes.items():
        for i in range(LAYERS if "{i}" in name else 1):
            w[name.format(i=i)] = rng.standard_normal(shape).astype(np.float32) * 0.2
    for name in VECTORS:
        for i in range(LAYERS if "{i}" in name else 1):
            w[name.format(i=i)] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    return w


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation: per head, rows (2, R/2) -> (R/2, 2)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path: Path, types: dict[str, gguf.GGMLQuantizationType], seed: int = 0) -> dict[str, np.ndarray]:
    """Write the tiny model; `types` maps an HF matrix name (as in MATRICES, `{i}` for every
    layer) to its GGUF type, F32 where absent. Returns the HF float32 weights before quantization."""
    hf = hf_weights(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens()) - len(SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for pattern, gguf_pattern in {**MATRICES, **VECTORS}.items():
        for i in range(LAYERS if "{i}" in pattern else 1):
            name, array = pattern.format(i=i), hf[pattern.format(i=i)]
            if name.endswith("q_proj.weight"):
                array = permute(array, HEADS)
            elif name.endswith("k_proj.weight"):
                array = permute(array, KV_HEADS)
            qtype = types.get(pattern, T.F32)
            if qtype == T.F32:
                w.add_tensor(gguf_pattern.format(i=i), array)
            else:
                w.add_tensor(gguf_pattern.format(i=i), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
