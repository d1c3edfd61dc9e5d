"""Make the tiny random-weight checkpoints and their goldens under tests/assets/.

Regenerate (dev only, never in CI: CI reads the committed files and needs no torch):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors tokenizers numpy
    .venv-ref/bin/python scripts/make_tiny_checkpoints.py              # all of them
    .venv-ref/bin/python scripts/make_tiny_checkpoints.py tiny-mistral # only those named

Naming models remakes only those, with the tokenizer committed in tests/assets/tiny-llama (so
the others and their goldens stay as they are); with no names the tokenizer is trained anew.

Made with Python 3.11, torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3, safetensors 0.8.0,
numpy 2.4.6. The tokenizer is trained on the reference venv's Python standard library sources, so a
different Python may give a different (equally valid) tokenizer; the goldens always match the files
written next to them.

The models share one tokenizer (byte-level BPE, 512 ids, specials <|endoftext|> <|im_start|>
<|im_end|>):
- tiny-llama: LlamaForCausalLM, untied lm head, GQA 4/2, llama3 rope scaling that bites within
  the first few dozen positions (original context 32).
- tiny-qwen2: Qwen2ForCausalLM, tied embeddings, q/k/v biases.
- tiny-qwen3: Qwen3ForCausalLM, untied, q/k RMSNorm, explicit head_dim (32) != hidden / heads (16).
- tiny-mistral: MistralForCausalLM with a sliding window of 8 positions (transformers masks keys
  with q - k >= 8), so every greedy run outgrows it: the prompts of 7-30 tokens plus 16 steps.
- tiny-gemma3: Gemma3ForCausalLM (tests/test_gemma3.py's docstring says how it is shaped).
- tiny-gemma2: Gemma2ForCausalLM, local (window 8) and global layers alternating, soft-caps small
  enough to bite (attention scores at 3, logits at 12), query_pre_attn_scalar 24 != head_dim 16.
- tiny-phi3: Phi3ForCausalLM (fused qkv_proj and gate_up_proj), a sliding window of 12.
- tiny-phi3-longrope: Phi3ForCausalLM with longrope (original context 32, so greedy runs cross
  into the long factors) and partial_rotary_factor 0.5. Its goldens come from transformers'
  cached generation (the prompt once, then one token a step over the cache), not a full forward
  each step: transformers picks longrope's factor set by the longest position of the call, so a
  full forward past 32 positions would rotate every position with the long set, while cached
  generation (what transformers serves, and this engine's rule) rotates each new token by its own.
- tiny-qwen3-moe and tiny-mixtral: mixture-of-experts (`moe_models`).
- tiny-gpt-oss: GptOssForCausalLM (`gpt_oss_model`), its golden.json also holding an MXFP4
  sample unpacked by transformers' own dequantization (`mxfp4_sample`).

Weights are drawn wider than HF's init (std ~ 1/sqrt(fan_in), embeddings std 1) so logits are
peaked and greedy choices are far from ties: parity tests can demand exactly equal ids.
golden.json holds, per prompt, 16 greedy ids (EOS not special: a plain argmax loop), the full
next-token logits after the prompt, and the top-8 logits at every greedy step; weights are redrawn
until no greedy step is within MIN_MARGIN of a tie.
"""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
PROMPTS = [
    "def add(a, b):\n    return",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "import",
]
STEPS = 16
TOP = 8
MIN_MARGIN = 2e-3  # f32 JAX vs torch logits differ by ~1e-5; a closer top-2 gap would make greedy parity luck


def train_tokenizer() -> Tokenizer:
    """A 512-id byte-level BPE on the first stdlib sources, sorted by path for a stable input order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py"))[:300]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 256,
        "chat_template": CHATML,
        "added_tokens_decoder": {},
    }


def randomize(model: torch.nn.Module, tied: bool, seed: int, embed_std: float = 1.0) -> None:
    """Peaked random weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, embed_std), norms ~ 1 +- 0.1.

    A tied random model echoes one token forever (its logits are close to the input embedding's
    scores); a signed N(0, 1) final norm weight breaks the echo so greedy ids vary.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tied and name == "model.norm.weight":
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):  # gpt-oss: on the scores' scale, so each sink takes a real share
                p.copy_(torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)  # fan_in: last axis (3-D experts too)


def golden(model: torch.nn.Module, tok: Tokenizer, cached: bool = False) -> dict:
    """Plain greedy loop, full forward each step (no cache, no stopping): the reference to match;
    `cached`: the prompt once, then each greedy token over transformers' cache."""
    cases = []
    for text in PROMPTS:
        ids = tok.encode(text).ids
        seq = list(ids)
        greedy, steps_top, first_logits, cache = [], [], None, None
        with torch.no_grad():
            for _ in range(STEPS):
                if cached:
                    out = model(torch.tensor([seq if cache is None else seq[-1:]]), cache=cache, use_cache=True)
                    cache = out.cache
                else:
                    out = model(torch.tensor([seq]))
                logits = out.logits[0, -1].float()  # [V]
                if first_logits is None:
                    first_logits = [round(float(x), 5) for x in logits]
                top = torch.topk(logits, TOP)
                steps_top.append(
                    {"ids": top.indices.tolist(), "logits": [round(float(x), 5) for x in top.values]}
                )
                nxt = int(torch.argmax(logits))
                greedy.append(nxt)
                seq.append(nxt)
        cases.append(
            {"prompt": text, "prompt_ids": ids, "greedy_ids": greedy, "first_logits": first_logits, "steps": steps_top}
        )
    return {
        "made_by": "scripts/make_tiny_checkpoints.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "cases": cases,
    }


def margin(gold: dict) -> float:
    """The smallest gap between the best and second-best logit over all greedy steps."""
    return min(s["logits"][0] - s["logits"][1] for case in gold["cases"] for s in case["steps"])


def make(name: str, config: transformers.PretrainedConfig, cls: type, tok: Tokenizer, gen_eos: list[int]) -> None:
    """Draw weights (first seed from 1234 whose greedy steps are all >= MIN_MARGIN from a tie) and save."""
    out = ASSETS / name
    shutil.rmtree(out, ignore_errors=True)
    for seed in range(1234, 1264):
        torch.manual_seed(0)
        model = cls(config).eval()
        randomize(model, tied=config.tie_word_embeddings, seed=seed, embed_std=EMBED_STD.get(name, 1.0))
        gold = golden(model, tok, cached=name in CACHED_GOLDENS)
        if margin(gold) >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no seed gave greedy steps {MIN_MARGIN} away from a tie")
    gold["weight_seed"] = seed
    if name in EXTRAS:
        gold.update(EXTRAS[name]())
    model.save_pretrained(out, safe_serialization=True)
    gen = transformers.GenerationConfig(eos_token_id=gen_eos, do_sample=False)
    gen.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / "golden.json").write_text(json.dumps(gold) + "\n")
    print(name, sorted(p.name for p in out.iterdir()))


MISTRAL_WINDOW = 8
GEMMA3_WINDOW = 8
# Gemma scales its embeddings by sqrt(hidden) = 8: drawn at N(0, 1) they would swamp every layer's
# output and the tied model would echo one token forever; drawn at 1/8 they enter at N(0, 1).
EMBED_STD = {"tiny-gemma3": 64 ** -0.5, "tiny-gemma2": 64 ** -0.5}
GEMMA2_WINDOW = 8
PHI3_WINDOW = 12
CACHED_GOLDENS = {"tiny-phi3-longrope"}  # see the module docstring
GPT_OSS_WINDOW = 8


def mxfp4_sample() -> dict:
    """MXFP4 blocks [2, 3, 2, 16] and scales [2, 3, 2] (2 experts, 3 outputs, 64 inputs: random
    bytes and exponents 2 ** -6 .. 2 ** 6) with transformers' dequantization of them,
    [2, 64, 3] float32 ([X, in, out], as its GptOssExperts hold the matrix)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(44)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 134, (2, 3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    out = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    return {"mxfp4": {"blocks": blocks.tolist(), "scales": scales.tolist(), "dequantized": out.tolist()}}


EXTRAS = {"tiny-gpt-oss": mxfp4_sample}


def main(names: list[str]) -> None:
    tok = train_tokenizer() if not names else Tokenizer.from_file(str(ASSETS / "tiny-llama" / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager",
    )
    llama = transformers.LlamaConfig(
        **common, num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=eot, bos_token_id=None,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    )
    models = {}
    models["tiny-llama"] = (llama, transformers.LlamaForCausalLM, [im_end, eot])
    qwen2 = transformers.Qwen2Config(
        **common, num_hidden_layers=3, tie_word_embeddings=True, eos_token_id=eot, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
    )
    models["tiny-qwen2"] = (qwen2, transformers.Qwen2ForCausalLM, [im_end])
    qwen3 = transformers.Qwen3Config(
        **common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, eos_token_id=im_end,
        bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
    )
    models["tiny-qwen3"] = (qwen3, transformers.Qwen3ForCausalLM, [eot])
    mistral = transformers.MistralConfig(
        **common, num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=eot, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=MISTRAL_WINDOW,
    )
    models["tiny-mistral"] = (mistral, transformers.MistralForCausalLM, [im_end])
    gemma3 = transformers.Gemma3TextConfig(
        **common, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, tie_word_embeddings=True,
        eos_token_id=eot, bos_token_id=None, pad_token_id=eot, sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    )
    models["tiny-gemma3"] = (gemma3, transformers.Gemma3ForCausalLM, [im_end])
    gemma2 = transformers.Gemma2Config(
        **common, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, tie_word_embeddings=True,
        eos_token_id=eot, bos_token_id=None, pad_token_id=eot, sliding_window=GEMMA2_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=3.0, final_logit_softcapping=12.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    models["tiny-gemma2"] = (gemma2, transformers.Gemma2ForCausalLM, [im_end])
    phi3 = transformers.Phi3Config(
        **common, num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=eot, bos_token_id=None,
        pad_token_id=eot, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, sliding_window=PHI3_WINDOW,
    )
    models["tiny-phi3"] = (phi3, transformers.Phi3ForCausalLM, [im_end])
    phi3_longrope = transformers.Phi3Config(
        **common, num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=eot, bos_token_id=None,
        pad_token_id=eot, original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.3, 1.8, 2.5], "long_factor": [1.5, 3.0, 6.0, 12.0],
        },
    )
    models["tiny-phi3-longrope"] = (phi3_longrope, transformers.Phi3ForCausalLM, [im_end])
    models.update(moe_models(common, eot, im_end))
    models["tiny-gpt-oss"] = gpt_oss_model(common, eot, im_end)
    unknown = set(names) - set(models)
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {sorted(models)}")
    for name, (config, cls, gen_eos) in models.items():
        if not names or name in names:
            make(name, config, cls, tok, gen_eos=gen_eos)


def moe_models(common: dict, eot: int, im_end: int) -> dict:
    """The mixture-of-experts checkpoints (engine.jax_backend.moe):
    - tiny-qwen3-moe: Qwen3MoeForCausalLM, 8 experts of 32 features, top-2 without renormalising
      (norm_topk_prob False), q/k norms, its middle layer a dense MLP (mlp_only_layers).
    - tiny-mixtral: MixtralForCausalLM, 4 experts of 64 features, top-2 (renormalised), no window.
    """
    qwen3_moe = transformers.Qwen3MoeConfig(
        **common, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False, eos_token_id=im_end,
        bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
    )
    mixtral = transformers.MixtralConfig(
        **{**common, "intermediate_size": 64}, num_hidden_layers=2, tie_word_embeddings=False,
        eos_token_id=eot, bos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
    )
    return {
        "tiny-qwen3-moe": (qwen3_moe, transformers.Qwen3MoeForCausalLM, [eot]),
        "tiny-mixtral": (mixtral, transformers.MixtralForCausalLM, [im_end]),
    }


def gpt_oss_model(common: dict, eot: int, im_end: int) -> tuple:
    """tiny-gpt-oss: GptOssForCausalLM with head_dim 16, 4 experts of 64 features, top-2; local
    (window 8), global, local layers; YaRN (factor 4 over an original context of 64 at base 1000,
    so pairs 0-2 blend and the rest are interpolated, cos/sin scaled by 1 + 0.1 ln 4); the SwiGLU
    clamp at 1.0 (it bites at these weights; the released models clamp at 7); sinks ~ N(0, 1),
    every bias ~ N(0, 0.25)."""
    config = transformers.GptOssConfig(
        **{**common, "intermediate_size": 64}, num_hidden_layers=3, head_dim=16, tie_word_embeddings=False,
        eos_token_id=eot, bos_token_id=None, pad_token_id=eot, sliding_window=GPT_OSS_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0, attention_bias=True,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64,
        },
    )
    return config, transformers.GptOssForCausalLM, [im_end]


if __name__ == "__main__":
    main(sys.argv[1:])
