#!/usr/bin/env python3
"""Do the test run's XLA flags (tests/support/xla_flags.py) give what decode-server computes, bit for
bit? Runs the same programs in two child processes, one with XLA's defaults and one with the test
flags, each without a compilation cache, and compares digests of their outputs:

  * the default model's logits after every position of two prompts, read layer by layer
    (transformer.prefill_layers), in float32, bfloat16, and bfloat16 with int8 and fp8 weights;
  * its greedy ids served by JaxModel in decode-server's configuration (int8 on the C++ kernels)
    and in float32;
  * tiny-llama's greedy ids in the tests' shared served configuration (tests/support/tiny_served.py).

Exit 0 when every digest is equal, 1 otherwise. Needs the default model pulled (`tokenwire pull`).
Usage: .venv/bin/python scripts/test_xla_flags.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is Paris.",
    "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n# and the rest",
)


def _digest(value) -> str:
    return hashlib.sha1(value if isinstance(value, bytes) else json.dumps(value).encode()).hexdigest()[:16]


def digests() -> dict[str, str]:
    """Every program's output digest, in this process's XLA flags."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tokenizers import Tokenizer

    from engine.jax_backend import transformer
    from engine.jax_backend.jax_model import JaxModel
    from engine.jax_backend.weights import load_channels, load_checkpoint
    from engine.model_store import registry
    from support import tiny_served
    from support.greedy import greedy_ids

    real = registry.pull(registry.DEFAULT_MODEL, log=lambda _: None)
    tok = Tokenizer.from_file(str(real / "tokenizer.json"))
    seqs = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]

    def every_position(weights, cfg, ids, dtype) -> bytes:
        layer = jax.jit(transformer.prefill_layers, static_argnames=("cfg", "kernels"))
        head = jax.jit(lambda x, w: transformer.logits(x, w.final_norm, w.lm_head, cfg))
        length = -(-len(ids) // 16) * 16
        cache = transformer.init_cache(cfg, 1, length, jnp.dtype(dtype))
        tokens = np.zeros(length, np.int32)
        tokens[: len(ids)] = ids
        x = jax.jit(transformer.embed)(weights.embed, jnp.asarray(tokens)[None])  # [1, T, E]
        for w, k, v in zip(weights.layers, cache.k, cache.v, strict=True):
            x, _, _ = layer((w,), (k,), (v,), x, cache.tables[0], jnp.int32(0), jnp.int32(0), jnp.int32(len(ids)), cfg=cfg)
        return np.asarray(head(x[0], weights), np.float32)[: len(ids)].tobytes()  # [T, V]

    out = {}
    for dtype, formats in (("float32", (None,)), ("bfloat16", (None, "int8", "fp8"))):
        ckpt = load_checkpoint(real, dtype)
        for fmt in formats:
            weights = ckpt.weights if fmt is None else load_channels(real, fmt, dtype).weights
            out[f"default model logits, {dtype} {fmt or ''}".strip()] = _digest(
                b"".join(every_position(weights, ckpt.config, s, dtype) for s in seqs))
    for weights in ("auto", "float32"):
        model = JaxModel.load(real, max_batch_size=2, max_context_length=128, weights=weights, compilation_cache=False)
        out[f"default model served greedy ids, weights {weights}"] = _digest(greedy_ids(model, [tuple(s[:20]) for s in seqs], 24))
    tiny = tiny_served.load("tiny-llama", compilation_cache=False)
    out["tiny-llama served greedy ids"] = _digest(greedy_ids(tiny, [(1, 5, 9, 33, 2, 7), (4, 4, 4, 8, 100)], 30))
    return out


def main() -> int:
    if sys.argv[1:] == ["--digests"]:
        print(json.dumps(digests()))
        return 0
    from support.xla_flags import TEST_XLA_FLAGS

    results = {}
    for label, flags in (("served", ""), ("tests", " ".join(TEST_XLA_FLAGS))):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"XLA_FLAGS": flags}
        run = subprocess.run([sys.executable, __file__, "--digests"], env=env, capture_output=True, text=True, check=True)
        results[label] = json.loads(run.stdout.strip().splitlines()[-1])
    same = True
    for name, served in results["served"].items():
        equal = served == results["tests"][name]
        same &= equal
        print(f"{'same' if equal else 'DIFFERENT':9}  {name}")
    print(f"test flags {' '.join(TEST_XLA_FLAGS)}: {'the served bits' if same else 'NOT the served bits'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
