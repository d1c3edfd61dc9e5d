"""The memory check at load (engine.jax_backend.memory_plan): its weight and cache figures equal
what the loader and the engine place, its temporaries bound XLA:CPU's own figure, and an
impossible configuration is refused in one line naming the numbers, through JaxModel.load and
through a real `tokenwire decode-server` start, against a stated limit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import pytest
from support import tiny_gguf

from engine.jax_backend import memory_plan, quantize, sampling, transformer
from engine.jax_backend.jax_model import JaxModel
from engine.jax_backend.memory_plan import MemoryLimit, MemoryPlanError, Settings
from engine.jax_backend.weights import load_checkpoint, load_int8, packed_head, with_panels
from engine.model_store.checkpoint import ModelConfig
from engine.model_store.gguf_convert import convert_gguf

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma2")  # untied, tied + qkv bias, q/k norms, Gemma (post norms, a scaled embedding)
GIB = 1 << 30

# Llama-3-8B's dimensions (config.json of meta-llama/Meta-Llama-3-8B): the sizes of a real refusal.
LLAMA3_8B = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
    head_dim=128, ffn_size=14336, rope_theta=500000.0, rope_scaling=None, rms_eps=1e-5, tie_word_embeddings=False,
    qkv_bias=False, qk_norm=False, max_position_embeddings=8192, sliding_window=None,
)


PAGE = 16  # the served page size


def settings(batch: int = 4, context: int = 32, **kw) -> Settings:
    """Settings with the served pool (a whole context of pages per slot and the null page) unless `pages` says."""
    pages = kw.pop("pages", batch * -(-context // PAGE) + 1)
    return Settings(batch, context, 512, pages, PAGE, kw.pop("dtype_bytes", 4), **kw)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float32+copies", "int8"])
def test_weights_and_cache_are_exactly_what_is_placed(name, kind):
    """The arithmetic against the arrays themselves: the loader's weights (with the CPU kernels'
    panel-packed copies, or as int8 blocks), and the engine's page pool and banned-id rows."""
    d = ASSETS / name
    if kind == "int8":
        ckpt, s = load_int8(d), settings(int8=True)
    else:
        dtype = kind.split("+")[0]
        ckpt = load_checkpoint(d, dtype)
        s = settings(dtype_bytes=jnp.dtype(dtype).itemsize, panel_copies=kind.endswith("+copies"))
        if s.panel_copies:
            w = ckpt.weights
            ckpt = replace(ckpt, weights=replace(w, layers=tuple(map(with_panels, w.layers)), lm_head=packed_head(w.lm_head)))
    s = replace(s, kv_pages=7)  # a pool of 6 pages and the null page, whatever the batch and context
    cache_dtype = jnp.float32 if s.int8 else jnp.dtype(kind.split("+")[0])
    k, v = transformer.init_pool(ckpt.config, 7, PAGE, cache_dtype)
    plan = memory_plan.plan(ckpt.config, ckpt.tokenizer_size, s)
    assert plan.weights == quantize.weight_bytes(ckpt.weights)
    assert plan.kv_cache == sum(a.nbytes for a in k + v) + s.max_batch_size * ckpt.tokenizer_size  # + bool rows


def test_int8_blocks_of_every_format_are_counted_from_the_gguf(tmp_path):
    """A GGUF with 4-bit matrices (Q4_1: 4 bits, a scale and an offset; Q4_0), a fused q/k/v whose
    v is Q8_0 (held in 8 bits with offsets), a Q5_0 (5 bits, no offset) and an F16 (requantized)
    one; one of 5-bit matrices (Q5_0 q/k/v, a Q5_1 o with offsets, a gate/up of Q5_0 and Q5_1,
    held in 8 bits); one of Q8_0 matrices only: the plan the loader builds from the file's header
    (jax_model.int8_layout) equals the bytes placed."""
    from engine.jax_backend.jax_model import int8_layout

    T = gguf.GGMLQuantizationType
    mixed = {name: T.Q4_1 for name in tiny_gguf.MATRICES}
    mixed.update({
        "model.embed_tokens.weight": T.Q8_0, "model.layers.{i}.self_attn.v_proj.weight": T.Q8_0,
        "model.layers.{i}.mlp.down_proj.weight": T.Q5_0, "model.layers.{i}.self_attn.o_proj.weight": T.F16,
        "model.layers.{i}.mlp.up_proj.weight": T.Q4_0,
    })
    five = {name: T.Q5_0 for name in tiny_gguf.MATRICES}
    five.update({"model.layers.{i}.self_attn.o_proj.weight": T.Q5_1, "model.layers.{i}.mlp.up_proj.weight": T.Q5_1})
    held = {
        "mixed": [(8, True), (8, False), (4, True), (5, False)],
        "q5": [(5, False), (5, True), (8, True), (5, False)],
        "q8_0": [(8, False)] * 4,
    }
    for name, types in (("mixed", mixed), ("q5", five), ("q8_0", {name: T.Q8_0 for name in tiny_gguf.MATRICES})):
        tiny_gguf.write(tmp_path / f"{name}.gguf", types)
        d = convert_gguf(tmp_path / f"{name}.gguf", tmp_path / name)
        ckpt = load_int8(d)
        layout = int8_layout(d, ckpt.config)
        plan = memory_plan.plan(ckpt.config, ckpt.tokenizer_size, settings(int8=True, int8_layout=layout))
        assert plan.weights == quantize.weight_bytes(ckpt.weights), name
        layer = ckpt.weights.layers[0]
        assert [(m.bits, m.offset is not None) for m in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)] == held[name]


@pytest.mark.parametrize("name, batch, context", [("tiny-llama", 4, 32), ("tiny-qwen3", 8, 256)])
def test_the_temporaries_bound_xla_cpus_own_figure(name, batch, context):
    """The estimate covers what XLA:CPU's buffer assignment reserves for the whole model's prefill
    of the largest chunk and for a decode step with head and sampling (its temp bytes)."""
    ckpt = load_checkpoint(ASSETS / name, "float32")
    cfg, w, v = ckpt.config, ckpt.weights, ckpt.tokenizer_size
    cache = transformer.init_cache(cfg, batch, context, jnp.float32)
    z = jnp.zeros(batch, jnp.int32)
    prefill = jax.jit(transformer.prefill_chunk, static_argnames="cfg", donate_argnums=1).lower(
        w, cache, jnp.zeros(context, jnp.int32), jnp.int32(context), jnp.int32(0), jnp.int32(0), cfg=cfg
    )

    def step(w, cache, tokens, positions, active, params, mask):
        logits, cache = transformer.decode(w, cache, tokens, positions, active, cfg=cfg, attend=context)
        return sampling.sample(logits, params, positions, mask, active), cache

    params = sampling.SlotSampling(jnp.ones(batch), z, jnp.full(batch, 0.9), jnp.zeros(batch), jnp.zeros((batch, 2), jnp.uint32))
    decode = jax.jit(step, donate_argnums=1).lower(w, cache, z, z, jnp.ones(batch, bool), params, jnp.zeros((batch, v), bool))
    xla = max(c.compile().memory_analysis().temp_size_in_bytes for c in (prefill, decode))
    assert memory_plan.plan(cfg, v, settings(batch, context)).temporaries >= xla > 0


def test_an_8b_model_at_batch_64_and_context_8192_is_refused_naming_the_numbers():
    s = settings(64, 8192, dtype_bytes=2)  # bfloat16; the served pool: 64 x 8192 positions
    limit = MemoryLimit(72 * GIB, "cuda:0 bytes_limit")  # an 80 GiB GPU at memory fraction 0.9
    plan = memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, s)
    page = 128 * 1024 * PAGE  # K/V: 128 KiB a position
    assert plan.kv_cache == 64 * GIB + page + 64 * LLAMA3_8B.vocab_size  # and the null page; a banned-id row per slot
    with pytest.raises(MemoryPlanError) as refused:
        memory_plan.check(LLAMA3_8B, LLAMA3_8B.vocab_size, s, limit, "gpu")
    message = str(refused.value)
    fits = (limit.bytes - plan.total + plan.kv_cache - 64 * LLAMA3_8B.vocab_size) // page - 1  # pages, the null one aside
    assert memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, replace(s, kv_pages=fits + 1)).total <= limit.bytes
    assert memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, replace(s, kv_pages=fits + 2)).total > limit.bytes
    assert 20_000 < fits * PAGE < 64 * 8192
    assert message == (
        f"the model does not fit in memory: weights {memory_plan.gib(plan.weights)} + KV cache 64.01 GiB (32769 pages "
        f"of 16 = 524288 tokens) + temporaries {memory_plan.gib(plan.temporaries)} = "
        f"{memory_plan.gib(plan.total)} > 72.00 GiB, cuda:0 bytes_limit; lower KV cache tokens 524288 (at most "
        f"{fits * PAGE} fit), max batch size 64, context length 8192"
    )
    assert "\n" not in message


def test_the_limit_is_inclusive_and_what_to_lower_follows_the_settings():
    cfg, s = LLAMA3_8B, settings(8, 2048, panel_copies=True)  # float32 with the CPU kernels' copies
    total = memory_plan.plan(cfg, cfg.vocab_size, s).total
    assert memory_plan.check(cfg, cfg.vocab_size, s, MemoryLimit(total, "stated"), "cpu").total == total
    with pytest.raises(MemoryPlanError, match=r"\(none fit\), max batch size 8, context length 2048, the weights' size "
                       r"\(dtype bfloat16, or weights int8\), CPU kernels off \(drops the projections' second copy\)$"):
        memory_plan.check(cfg, cfg.vocab_size, s, MemoryLimit(GIB, "stated"), "cpu")
    with pytest.raises(MemoryPlanError, match=r"at most 16368 fit\), max batch size 8, context length 2048$"):  # bfloat16: nothing smaller to offer
        s = settings(8, 2048, dtype_bytes=2)
        memory_plan.check(cfg, cfg.vocab_size, s, MemoryLimit(memory_plan.plan(cfg, cfg.vocab_size, s).total - 1, ""), "gpu")


def test_tensor_parallelism_splits_weights_and_cache_over_the_devices():
    one, four = (memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, settings(8, 2048, devices=n)) for n in (1, 4))
    assert four.weights * 4 - one.weights < 4 and four.kv_cache < one.kv_cache / 3.9
    sixteen = memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, settings(8, 2048, devices=16))
    assert sixteen.kv_cache > one.kv_cache / 16  # 8 kv heads replicated to 16: one head per device, not half


def test_host_limit_is_memavailable_or_a_lower_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB available
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert memory_plan.host_limit(meminfo, cgroup) == MemoryLimit(20 * GIB, "the host's available memory (MemAvailable 20.00 GiB)")
    (cgroup / "memory.max").write_text("max\n")  # no limit
    (cgroup / "memory.current").write_text(f"{GIB}\n")
    assert memory_plan.host_limit(meminfo, cgroup).bytes == 20 * GIB
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    assert memory_plan.host_limit(meminfo, cgroup) == MemoryLimit(7 * GIB, "the cgroup's memory limit 8.00 GiB less 1.00 GiB in use")
    assert memory_plan.host_limit(tmp_path / "absent", cgroup) is None


class _Gpu:
    """What device_limit reads of a jax.Device on a GPU (this machine has none): its allocator's stats."""

    platform, id = "gpu", 0

    def memory_stats(self) -> dict:
        return {"bytes_limit": 100 * GIB, "bytes_in_use": GIB, "peak_bytes_in_use": GIB}


def test_device_limit_is_the_allocators_limit_on_a_gpu_and_the_hosts_memory_on_the_cpu(tmp_path):
    limit = memory_plan.device_limit(_Gpu())
    assert limit.bytes == 99 * GIB and limit.source.startswith("gpu:0 bytes_limit 100.00 GiB") and "1.00 GiB in use" in limit.source
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 1048576 kB\n")
    cpu = jax.devices("cpu")[0]
    assert memory_plan.device_limit(cpu, meminfo, tmp_path) == MemoryLimit(GIB, "the host's available memory (MemAvailable 1.00 GiB)")


MB = 10**6


def test_a_memory_fraction_of_an_h100_holds_llama_3_1_8b_and_this_many_pages():
    """An 80 GB H100 at fraction 0.9, Llama-3.1-8B's shape in bfloat16: 128 KiB of K and V per
    token (2 x 32 layers x 8 kv heads x 128 x 2 bytes), its 8,030,261,248 parameters as 16.06 GB of
    weights, and 2 GiB of working memory: (72,000,000,000 - 16,060,522,496 - 2 GiB) // 2 MiB a
    page = 25,650 pages, one of them the null page."""
    s = settings(64, 8192, dtype_bytes=2)
    token = memory_plan.position_bytes(LLAMA3_8B, s)
    weights = memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, s).weights
    assert (token, weights) == (128 * 1024, 2 * 8_030_261_248)
    pages = memory_plan.fraction_pages(80_000 * MB, weights, 2 * GIB, token, PAGE, 0.9, 64)
    assert pages == 25_649 and pages * PAGE == 410_384
    # the pool that gives fits the fraction with the rest of the plan, and one page more does not
    rest = memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, replace(s, kv_pages=0))
    working = rest.kv_cache + rest.temporaries
    pages = memory_plan.fraction_pages(80_000 * MB, weights, working, token, PAGE, 0.9, 64)
    assert memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, replace(s, kv_pages=pages + 1)).total <= 72_000 * MB
    assert memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, replace(s, kv_pages=pages + 2)).total > 72_000 * MB


def test_a_memory_fraction_under_tensor_parallelism_is_per_shard():
    """Two devices each hold half the weights and half of each token's kv heads, so the same
    fraction of each holds twice the tokens and more; 16 devices over 8 kv heads replicate them,
    so a token's share is one head's, not half of one."""
    one, two, sixteen = (settings(64, 8192, dtype_bytes=2, devices=n) for n in (1, 2, 16))
    assert [memory_plan.position_bytes(LLAMA3_8B, s) for s in (one, two, sixteen)] == [128 * 1024, 64 * 1024, 16 * 1024]
    weights = [memory_plan.plan(LLAMA3_8B, LLAMA3_8B.vocab_size, s).weights for s in (one, two)]
    assert weights == [16_060_522_496, 8_030_261_248]
    alone = memory_plan.fraction_pages(80_000 * MB, weights[0], 2 * GIB, 128 * 1024, PAGE, 0.9, 64)
    split = memory_plan.fraction_pages(80_000 * MB, weights[1], 2 * GIB, 64 * 1024, PAGE, 0.9, 64)
    assert split == (72_000 * MB - 8_030_261_248 - 2 * GIB) // (64 * 1024 * PAGE) - 1 == 58_957
    assert split > 2 * alone


def test_a_memory_fraction_too_small_for_the_batch_is_refused_with_the_figures():
    """The least pool is a page per sequence decoded together and one to admit with (as for
    --kv-cache-tokens); at that it is accepted, a page short it is refused in one line."""
    # 1 MiB, nothing else held, 1 KiB a token: 64 pages of 16 KiB, the null page among them
    assert memory_plan.fraction_pages(1 << 20, 0, 0, 1024, PAGE, 1.0, 62) == 63
    with pytest.raises(MemoryPlanError) as refused:
        memory_plan.fraction_pages(1 << 20, 0, 0, 1024, PAGE, 1.0, 63)
    assert str(refused.value) == (
        "KV cache memory fraction 1.0 leaves 1.00 MiB for the KV cache (1.0 x 1.00 MiB = 1.00 MiB, less weights "
        "0.00 MiB and working memory 0.00 MiB): 63 pages of 16 tokens at 0.02 MiB a page, the null page aside; max "
        "batch size 63 needs at least 64 pages (1024 tokens): raise the fraction (--kv-cache-memory-fraction), lower "
        "--max-batch-size, or give the pool in tokens (--kv-cache-tokens)"
    )
    with pytest.raises(MemoryPlanError, match=r"leaves 0\.03 MiB .*: 1 page of 16 tokens"):  # one page, said as one
        memory_plan.fraction_pages(1 << 20, 992 * 1024, 0, 1024, PAGE, 1.0, 1)
    # the weights alone are more than the share: nothing is left, and the message says by how much
    with pytest.raises(MemoryPlanError, match=r"fraction 0\.2 leaves -916\.03 MiB .*: 0 pages of 16 tokens"):
        memory_plan.fraction_pages(80_000 * MB, 16_060_522_496, 900 * MB, 128 * 1024, PAGE, 0.2, 8)
    for wrong in (0.0, -0.5, 1.5):
        with pytest.raises(MemoryPlanError, match=r"must be in \(0, 1\]"):
            memory_plan.fraction_pages(80_000 * MB, 0, 0, 1024, PAGE, wrong, 8)


class _Cpu:
    platform, id = "cpu", 0

    def memory_stats(self) -> dict:  # as if a CPU reported a figure: still not an accelerator's
        return {"bytes_limit": 100 * GIB}


def test_the_fractions_device_memory_is_the_smallest_bytes_limit_and_none_on_the_cpu():
    small = type("_SmallGpu", (_Gpu,), {"id": 1, "memory_stats": lambda self: {"bytes_limit": 40 * GIB}})()
    assert memory_plan.accelerator_bytes([_Gpu(), small]) == MemoryLimit(40 * GIB, "gpu:1 bytes_limit 40.00 GiB")
    assert memory_plan.accelerator_bytes([_Gpu()]).bytes == 100 * GIB  # the limit, not less what is in use
    assert memory_plan.accelerator_bytes(jax.devices("cpu")) is None
    assert memory_plan.accelerator_bytes([_Cpu()]) is None
    assert memory_plan.accelerator_bytes([_Gpu(), _Cpu()]) is None


def test_the_load_path_resolves_a_fraction_to_tokens_and_says_where_the_pool_came_from():
    """loading.sized_pool, on a GPU's figures: the pool fraction_pages gives from the plan's
    own parts, now in kv_cache_tokens, and the source the memory-plan line names."""
    from engine.core.model_options import ModelOptions
    from engine.jax_backend import loading
    from engine.model_store.checkpoint import parse_config
    import json

    cfg = parse_config(json.loads((ASSETS / "tiny-llama" / "config.json").read_text()))
    s = replace(settings(4, 256), kv_pages=0)
    o, source = loading.sized_pool(ModelOptions(kv_cache_memory_fraction=0.5), cfg, cfg.vocab_size, s, [_Gpu()])
    rest = memory_plan.plan(cfg, cfg.vocab_size, s)
    pages = memory_plan.fraction_pages(100 * GIB, rest.weights, rest.kv_cache + rest.temporaries,
                                       memory_plan.position_bytes(cfg, s), PAGE, 0.5, 4)
    assert o.kv_cache_memory_fraction is None and o.kv_cache_tokens == pages * PAGE > 0
    assert loading.pool_pages(o, 4, 256) == pages + 1
    assert source == "--kv-cache-memory-fraction 0.5 of gpu:0 bytes_limit 100.00 GiB, less the weights and working memory"
    assert loading.sized_pool(ModelOptions(kv_cache_tokens=512), cfg, cfg.vocab_size, s, [_Gpu()])[1] == "--kv-cache-tokens 512"
    assert loading.sized_pool(ModelOptions(), cfg, cfg.vocab_size, s, [_Gpu()])[1] == (
        "--kv-cache-tokens 0: max batch size 4 x context 256"
    )


def test_jax_model_load_refuses_a_memory_fraction_on_the_cpu_and_with_tokens(tmp_path):
    """From config.json alone (no weights file), before anything is placed."""
    d = tmp_path / "tiny-llama"
    shutil.copytree(ASSETS / "tiny-llama", d)
    (d / "model.safetensors").unlink()
    with pytest.raises(MemoryPlanError, match=r"^the KV cache memory fraction \(--kv-cache-memory-fraction 0\.5\) is a "
                       r"share of an accelerator's memory, and cpu:0 reports none: give the pool in tokens with --kv-cache-tokens$"):
        JaxModel.load(d, max_batch_size=4, kernels=False, kv_cache_memory_fraction=0.5)
    with pytest.raises(ValueError, match="both size the KV pool"):
        JaxModel.load(d, max_batch_size=4, kernels=False, kv_cache_memory_fraction=0.5, kv_cache_tokens=256)


def test_jax_model_load_refuses_before_reading_a_weight(tmp_path):
    """Against a stated limit: refused from config.json alone (the weights file is not even
    there), and the same settings load under a limit that holds them."""
    d = tmp_path / "tiny-llama"
    shutil.copytree(ASSETS / "tiny-llama", d)
    (d / "model.safetensors").unlink()
    # the served pool, 4 x 256 positions: the limit is sized so that the pool is what must give
    with pytest.raises(MemoryPlanError, match=r"^the model does not fit in memory: weights 0\.53 MiB \+ KV cache 0\.51 MiB "
                       r"\(65 pages of 16 = 1024 tokens\) .* > 5\.15 MiB, the limit stated by configuration; lower KV "
                       r"cache tokens 1024 \(at most 432 fit\)"):
        JaxModel.load(d, max_batch_size=4, max_context_length=256, dtype="float32", kernels=False, memory_limit_bytes=5_400_000)
    model = JaxModel.load(ASSETS / "tiny-llama", max_batch_size=4, max_context_length=256, dtype="float32", kernels=False,
                          memory_limit_bytes=5_400_000, kv_cache_tokens=256)  # a smaller pool fits
    assert model.info.max_batch_size == 4 and model.kv.num_pages == 256 // 16 + 1


def test_decode_server_refuses_an_impossible_configuration_in_one_line():
    """The real start: the engine process refuses at load, the log says why in one line, the
    process's last, and the process exits 2, a configuration error (a supervisor's restart will
    not help; the message says what to lower)."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "decode-server", "--model", str(ASSETS / "tiny-llama"), "--port", "0",
         "--max-batch-size", "4", "--max-context-length", "256", "--cpu-kernels", "off", "--compilation-cache", "off",
         "--memory-limit-bytes", "4000000"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    refusals = [line for line in result.stderr.splitlines() if "does not fit in memory" in line]
    assert refusals == result.stderr.splitlines()[-1:], result.stderr
    assert "CRITICAL tokenwire.decode refusing to serve: the model does not fit" in refusals[0]
    assert "lower KV cache tokens 1024" in refusals[0] and "Traceback" not in result.stderr
    assert "supervisor" not in result.stderr  # no word of a restart: a supervisor would restart it forever


def test_decode_server_refuses_a_memory_fraction_on_the_cpu_and_exits_2():
    """The real start on this CPU: the engine process refuses at load, and the last line says
    to size the pool in tokens."""
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "decode-server", "--model", str(ASSETS / "tiny-llama"), "--port", "0",
         "--cpu-kernels", "off", "--compilation-cache", "off", "--kv-cache-memory-fraction", "0.9"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "refusing to serve: the KV cache memory fraction" in last and "cpu:0 reports none" in last, result.stderr
    assert last.endswith("give the pool in tokens with --kv-cache-tokens") and "Traceback" not in result.stderr
