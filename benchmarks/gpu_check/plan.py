"""What a GPU check run measures: model shapes and the profiles (gpu, rehearsal, cpu, smoke).

A profile is plain data (`Plan`, JSON-serialisable): the orchestrator writes it to a file and each
phase process reads it back. The GPU profile carries the issue's sizes; `rehearsal` is the same
plan, phase for phase, with the shapes scaled down so that it runs end to end on a CPU; `cpu` and
`smoke` are smaller still (`smoke` is what tests/test_gpu_check.py runs).

Shapes: E hidden, F ffn, H heads, K kv heads, D head dim, L layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, enough to build a config.json (and so an engine ModelConfig)."""

    name: str
    hidden: int  # E
    layers: int  # L
    heads: int  # H
    kv_heads: int  # K
    head_dim: int  # D
    ffn: int  # F
    vocab: int  # V
    tied: bool = False
    rope_theta: float = 500000.0
    max_position: int = 8192

    def scaled(self, factor: int) -> "Shape":
        """Every width and the depth divided by `factor` (head dim kept, at least 1 kv head and 2
        layers), for a rehearsal on a CPU of the code path a full shape takes."""
        if factor == 1:
            return self
        kv = max(1, self.kv_heads // factor)
        heads = max(kv, self.heads // factor // kv * kv)
        return replace(
            self, name=f"{self.name}/{factor}", hidden=heads * self.head_dim, layers=max(2, self.layers // factor),
            heads=heads, kv_heads=kv, ffn=max(64, self.ffn // factor), vocab=max(512, self.vocab // factor),
        )

    def config_json(self) -> dict[str, Any]:
        """The Hugging Face config.json of a Llama with these dimensions."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab, "hidden_size": self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn, "rope_theta": self.rope_theta, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": self.tied, "max_position_embeddings": self.max_position,
            "bos_token_id": None, "eos_token_id": None,
        }

    def parameters(self) -> int:
        e, d = self.hidden, self.head_dim
        layer = e * (self.heads + 2 * self.kv_heads) * d + self.heads * d * e + 3 * e * self.ffn + 2 * e
        return self.layers * layer + self.vocab * e * (1 if self.tied else 2) + e


LLAMA3_8B = Shape("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256)
LLAMA32_1B = Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256, tied=True)


@dataclass(frozen=True)
class Plan:
    profile: str
    dtype: str  # what the speed and golden phases run in
    speed_shapes: tuple[Shape, ...]  # the first one carries the batch-1 TPOT target
    batches: tuple[int, ...]  # decode batch sizes (1 first)
    prompt_len: int  # tokens each decode slot is prefilled with
    rounds: int  # interleaved rounds: bandwidth, then every batch size
    steps: int  # decode steps timed per batch size and round
    prefill_lengths: tuple[int, ...]
    prefill_repeats: int
    bandwidth_gib: float  # the array summed to measure memory read bandwidth
    stack_shape: Shape  # its vocabulary is replaced by the stack tokenizer's
    stack_streams: tuple[int, ...]  # the first one carries the served/engine target
    stack_tokens: int
    stack_rounds: int
    client_procs: int
    goldens: tuple[str, ...]  # tiny checkpoints under tests/assets
    pytest_files: tuple[str, ...]  # run on the device; () = skip
    real_model: bool
    deadline_s: float  # the whole run; phases that would start after it are skipped
    phase_limits_s: dict[str, float] = field(default_factory=dict)  # per phase; default: what is left
    # quantized formats (--weights) the `weights` phase times on the first speed shape at batch 1
    # and the largest batch, against the dtype's own (speed-0); () = skip
    weights: tuple[str, ...] = ()
    weights_batches: tuple[int, ...] = ()  # the batches it times; () = 1 and the largest of `batches`
    # speculative decoding's verify step (issue 45; benchmarks/verify_step.py) on the last speed
    # shape: its cost against a plain step at these batches, and at batch 1 the default model's
    # recorded answers replayed at it (the n-gram proposer's projected gain); () = skip
    speculative_batches: tuple[int, ...] = ()
    speculative_rounds: int = 10
    speculative_guesses: int = 4  # the served default (--speculative-tokens): verify steps of 1, 2 and 4

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        shapes = lambda items: tuple(Shape(**s) for s in items)  # noqa: E731
        raw["speed_shapes"] = shapes(raw["speed_shapes"])
        raw["stack_shape"] = Shape(**raw["stack_shape"])
        for key in ("batches", "prefill_lengths", "stack_streams", "goldens", "pytest_files", "weights", "weights_batches",
                    "speculative_batches"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


DEVICE_TESTS = (
    "tests/test_transformer_parity.py", "tests/test_jax_model.py", "tests/test_prefill_chunked.py",
    "tests/test_jax_stack.py", "tests/test_gpu_weights.py",
)
GOLDENS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")

GPU = Plan(
    profile="gpu", dtype="bfloat16", speed_shapes=(LLAMA3_8B, LLAMA32_1B), batches=(1, 8, 64, 256),
    prompt_len=128, rounds=3, steps=8, prefill_lengths=(512, 2048), prefill_repeats=2, bandwidth_gib=4.0,
    # The stack at 64 streams (batch 64) only: on the first H200 run (2026-12-04), 64 and 256 streams
    # at batch 256 ran past the phase's 180 s before the first measurement (each process compiles
    # row buckets up to 256; the 1B shape's decode warm-up alone took 46 s); 64 streams at batch
    # 64 took 150 s for 3 rounds, every compile included.
    stack_shape=LLAMA32_1B, stack_streams=(64,), stack_tokens=200, stack_rounds=3, client_procs=4,
    # Limits: the first H200 run took 414 s in all; since then each decode model also compiles a
    # greedy and a full sampler per row bucket (JaxModel split_sampler) and speed-0 times the
    # sampler alone (12 small compiles), hence 30-40 s more for speed-0, 20 for speed-1 and the stack.
    # The weights phase (fp8, int8) runs last, its own process, so that its cost (quantizing the 8B
    # shape, two decode row buckets and a prefill compiled per format, 256 prompts filled) takes
    # nothing from the phases before it: within the deadline when time is left, else skipped;
    # alone (docs/benchmarks.md): --skip pytest,real-model,stack,speed-1. Its limit is an
    # estimate, never yet measured on a GPU.
    goldens=GOLDENS, pytest_files=DEVICE_TESTS, real_model=True, deadline_s=510.0,
    phase_limits_s={"env": 60, "pytest": 200, "golden": 60, "real-model": 90, "speed-0": 190, "stack": 230, "speed-1": 110,
                    "weights": 150, "speculative": 120},
    weights=("fp8", "int8"),
    # Issue 45's GPU figure: the 1B shape at batch 1 and 64. Like the weights phase it runs only
    # when its whole limit is left (an estimate: 2 decode and 6 verify shapes compiled, 10 rounds
    # at each batch); alone: --skip pytest,real-model,stack,weights.
    speculative_batches=(1, 64),
)


def _scaled(plan: Plan, factor: int, **changes: Any) -> Plan:
    scaled = replace(plan, speed_shapes=tuple(s.scaled(factor) for s in plan.speed_shapes),
                     stack_shape=plan.stack_shape.scaled(factor))
    return replace(scaled, **changes)


PROFILES: dict[str, Plan] = {
    "gpu": GPU,
    # The GPU plan phase for phase (bfloat16, the batch sizes, prompt lengths, streams), shapes / 16.
    "rehearsal": _scaled(GPU, 16, profile="rehearsal", bandwidth_gib=0.5, deadline_s=3600.0, phase_limits_s={}),
    # Small shapes in the CPU's own dtype: what the CPU serves with.
    "cpu": _scaled(
        GPU, 32, profile="cpu", dtype="float32", batches=(1, 8), prompt_len=32, rounds=2, steps=4,
        prefill_lengths=(64, 256), prefill_repeats=1, bandwidth_gib=0.25, stack_streams=(8, 16), stack_tokens=32,
        stack_rounds=1, client_procs=2, pytest_files=(), real_model=False, deadline_s=900.0, phase_limits_s={},
        speculative_rounds=3,
    ),
    # The least that still runs every phase: tests/test_gpu_check.py.
    "smoke": _scaled(
        GPU, 64, profile="smoke", dtype="float32", speed_shapes=(LLAMA3_8B.scaled(64),), batches=(1, 2), prompt_len=8, rounds=1, steps=2,
        prefill_lengths=(32,), prefill_repeats=1, bandwidth_gib=0.0625, stack_streams=(2,), stack_tokens=6,
        stack_rounds=1, client_procs=1, goldens=("tiny-llama",), pytest_files=(), real_model=False,
        deadline_s=300.0, phase_limits_s={}, weights=("fp8",), weights_batches=(1,),  # (one decode compile: ~5 s here)
        speculative_batches=(1,), speculative_rounds=1, speculative_guesses=1,  # (one verify shape)
    ),
}
