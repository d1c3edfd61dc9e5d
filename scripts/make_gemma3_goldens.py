"""Regenerate tests/assets/gemma3-270m-goldens.json from transformers' own reading of the GGUF.

    python scripts/make_gemma3_goldens.py GGUF_DIR MODEL_DIR

GGUF_DIR holds gemma-3-270m-q4_k_m.gguf (the file `tokenwire pull gemma-3-270m` keeps as
MODEL_DIR/model.gguf: a copy under that name will do); MODEL_DIR is the pulled directory, whose
chat template is rendered here by transformers. Needs torch, transformers, gguf and accelerate
(not tokenwire's own environment); the header records their versions. Greedy continuations are
transformers' on its own dequantization of the GGUF, float32, 16 new tokens.
"""

import json
import sys
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
OUT = Path(__file__).resolve().parent.parent / "tests" / "assets" / "gemma3-270m-goldens.json"
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading spaces, and   runs   of spaces  ",
    "line one\nline two\n\n\nthree\n",
    "tabs\tand\r\nwindows newlines",
    "Ünïcödé café naïve — “quotes” 日本語のテキスト 中文 한국어",
    "emoji 🤖🦙 and rare bytes \u0001\u007f\u0600",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal specials <eos> and <pad> [multimodal] <start_of_image>",
    "def f(x):\n    return x ** 2  # square\n",
    "1234567890 3.14159 -42 1e-6",
    "<b>bold</b> <h1>html</h1>",
    "a" * 40,
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]
_ITEMS = ["red box", "blue jar", "green cup", "old book", "small lamp"] * 16
LONG = " ".join(f"Item {i}: the {w} sits on shelf {i % 7}." for i, w in enumerate(_ITEMS))
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<start_of_turn>user\nWhat is the largest planet in the solar system?<end_of_turn>\n<start_of_turn>model\n",
    "Translate to German: Good morning, how are you?\nGerman:",
    LONG + "\nQuestion: what sits on shelf 3 in item 3? Answer: the",  # past the 512-token window
]
CONFIG_KEYS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar", "rms_norm_eps", "vocab_size",
    "max_position_embeddings", "hidden_activation", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "final_logit_softcapping", "attn_logit_softcapping", "model_type",
]


def main(gguf_dir: str, model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    cfg = AutoConfig.from_pretrained(gguf_dir, gguf_file=GGUF_NAME).to_dict()
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    norms = {k: v[:4].tolist() for k, v in model.state_dict().items()
             if k in ("model.norm.weight", "model.layers.0.self_attn.q_norm.weight",
                      "model.layers.5.post_feedforward_layernorm.weight")}
    greedy = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False, top_p=None, top_k=None)
        new = out[0, ids.shape[1]:].tolist()
        greedy.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "output_ids": new, "text": tok.decode(new)})
    ours = AutoTokenizer.from_pretrained(model_dir)
    versions = {p: metadata.version(p) for p in ("torch", "transformers", "tokenizers", "gguf")}
    goldens = {
        "_generated_by": f"python scripts/make_gemma3_goldens.py GGUF_DIR MODEL_DIR with {versions}",
        "config": {k: cfg[k] for k in CONFIG_KEYS} | {"rope_parameters": cfg["rope_parameters"]},
        "norm_weights_first4": norms,
        "tokenizer": [{"text": t, "ids": tok(t).input_ids} for t in TEXTS],
        "chat": {"messages": CHAT, "text": ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)},
        "greedy": greedy,
    }
    OUT.write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
