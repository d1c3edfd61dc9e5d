"""Tensor parallelism (engine.jax_backend.mesh) on forced CPU devices: the same greedy ids as
one device, logits within LOGIT_ATOL of transformers' goldens, batch invariance and seeded
sampling under the mesh, 1/N of the sharded weights and of the KV cache on each device, no
compilation after warm-up, the CPU kernels switched off with a reason; and sizes the model
refuses, each in one line naming its dimension.

The model runs happen in one child interpreter (tests/support/tp_worker.py) started with 4 CPU
devices, because JAX fixes its device count when its backend starts and this session's has one;
tests/test_split_sampler.py reads the same child's runs (tests/support/forced_devices.py).
TP=1 runs for tiny-llama only (the engine's own path, CPU kernels on): the goldens are the
reference for the others, and the single-device path has its own tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.jax_backend.mesh import TensorParallelError, check_sizes
from engine.model_store.checkpoint import parse_config

from support import forced_devices
from support.forced_devices import ODD, RUNS, TWO_SLOTS

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
PARALLEL = [(name, size) for name, sizes in RUNS.items() for size in sizes if size > 1] + [("tiny-qwen2", 2)]
LOGIT_ATOL = 1e-4  # as tests/test_transformer_parity.py: goldens are rounded to 1e-5; f32 all-reduce order moves ~1e-6
LOGPROB_ATOL = 1e-5  # TP against one device, same process


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = forced_devices.runs(tmp_path_factory)  # one child per test run, shared with test_split_sampler
    assert out["devices"] == 4
    return out


def golden(name: str) -> dict:
    return json.loads((ASSETS / name / "golden.json").read_text())["cases"][0]


@pytest.mark.parametrize("name,size", PARALLEL)
def test_greedy_ids_equal_one_device_and_logits_stay_within_tolerance(runs, name, size):
    run, case = runs[f"{name}/{size}"], golden(name)
    assert run["greedy"] == case["greedy_ids"][: len(run["greedy"])]  # what one device gives (test_transformer_parity)
    logits, step = run["logits"], case["steps"][0]  # the prompt's next-token logits; the golden's top 8
    assert max(range(len(logits)), key=logits.__getitem__) == step["ids"][0]
    assert max(abs(logits[i] - want) for i, want in zip(step["ids"], step["logits"])) < LOGIT_ATOL


def test_a_head_width_that_n_does_not_divide_is_padded_and_cut_back(runs):
    run = runs["tiny-qwen2/2"]  # its greedy ids and logits are checked with the others
    assert run["head_shape"] == [64, ODD + 1]  # one zero column, split 255 + 255
    assert len(run["logits"]) == ODD  # cut back to V' before sampling


@pytest.mark.parametrize("size", [2, 4])
def test_logprobs_and_seeded_samples_equal_one_device(runs, size):
    one, many = runs[f"{TWO_SLOTS}/1"], runs[f"{TWO_SLOTS}/{size}"]
    assert many["greedy"] == one["greedy"]
    assert max(abs(a - b) for a, b in zip(many["logprobs"], one["logprobs"])) < LOGPROB_ATOL
    assert many["sampled"] == one["sampled"]  # temperature 0.9, top-k 50, top-p 0.95, one seed
    assert len(set(one["sampled"])) > 1


@pytest.mark.parametrize("size", [2, 4])
def test_batch_invariance_under_the_mesh(runs, size):
    run = runs[f"{TWO_SLOTS}/{size}"]
    assert run["beside"] == run["greedy"]  # in slot 1 beside another request == alone in slot 0


@pytest.mark.parametrize("name,size", PARALLEL)
def test_each_device_holds_a_share_of_the_weights_and_the_cache(runs, name, size):
    run = runs[f"{name}/{size}"]
    assert sorted(run["sharded_per_device"]) == [str(i) for i in range(size)]
    # the head is padded to a multiple of N (none here: 512 ids), kv heads replicated at 4 > 2
    assert all(held == run["sharded_total"] // size for held in run["sharded_per_device"].values())
    assert set(run["specs"]) <= {"P('tp', None)", "P(None, 'tp')", "P('tp',)"}
    assert run["cache_specs"] == ["P('tp',)"]  # the page pools [K, N, P, D] split on K
    kv = run["kv_heads"]
    assert kv == max(2, size)  # the tiny models have 2 kv heads: at 4 devices each is copied twice
    assert all(held == run["cache_total"] // size for held in run["cache_per_device"].values())
    one_device_cache = run["cache_total"] * 2 // kv  # the cache of the model's own 2 kv heads
    assert all(held == one_device_cache // min(size, 2) for held in run["cache_per_device"].values())


@pytest.mark.parametrize("name,size", PARALLEL)
def test_nothing_compiles_after_warm_up_and_the_kernels_say_why_they_are_off(runs, name, size):
    run = runs[f"{name}/{size}"]
    # warmed at 2 ways only; IDS_ONLY's runs compare ids and shares only (forced_devices says why);
    # tiny-qwen2 at 2 is the odd vocabulary's copy (its padded head), warmed up
    warmed = size == 2 and (name not in forced_devices.IDS_ONLY or name == "tiny-qwen2")
    assert run["compiled_after_warm_up"] == (0 if warmed else None)
    assert run["kernel_state"].startswith("off: tensor parallelism over")


def _config(**changes):
    raw = json.loads((ASSETS / "tiny-llama" / "config.json").read_text())
    return parse_config({**raw, **changes})


@pytest.mark.parametrize(
    "size,changes,named",
    [
        (3, {}, "4 attention heads (num_attention_heads)"),
        (8, {}, "4 attention heads (num_attention_heads)"),
        (4, {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16}, "3 kv heads (num_key_value_heads), nor is it a multiple"),
        (2, {"intermediate_size": 129}, "intermediate size 129 (intermediate_size)"),
        (2, {"vocab_size": 513}, "vocabulary of 513 (vocab_size)"),
    ],
)
def test_a_size_that_does_not_divide_is_refused_naming_the_dimension(size, changes, named):
    with pytest.raises(TensorParallelError) as error:
        check_sizes(_config(**changes), size)
    message = str(error.value)
    assert named in message and f"--tensor-parallel {size} does not divide" in message and "\n" not in message


def test_kv_heads_fewer_than_the_devices_are_accepted_when_they_divide_it():
    check_sizes(_config(), 4)  # 4 heads, 2 kv heads: each kv head copied twice
    check_sizes(_config(num_attention_heads=8, num_key_value_heads=1, head_dim=8), 8)


def test_the_cli_refuses_in_one_line_before_loading():
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--local", "--model", str(ASSETS / "tiny-llama"),
         "--tensor-parallel", "3", "hello"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("tokenwire generate:") and "does not divide the model's 4 attention heads" in lines[-1]
