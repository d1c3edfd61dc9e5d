"""The memory check at load: what a configuration will hold on one device, against what the
device has, so that an impossible configuration fails at start in one line that names the
numbers and what to lower, instead of with a raw out-of-memory error at warm-up or mid-serving.

Data flow: `JaxModel.load` reads the model's config, builds a `MemoryPlan` (`plan`) for its
settings before any weight is placed, asks `device_limit` what one device offers (or takes a
stated limit), and `check` raises MemoryPlanError when the plan's total exceeds it.

What is counted, per device (1/N of the sharded parts under tensor parallelism over N):
- weights: exactly the arrays the loader places (engine.model_store.checkpoint's layout: fused
  qkv and gate_up, the head's V' columns as a separate array even when tied; an MoE layer's
  router and stacked experts in place of its dense MLP, and with the CPU kernels each expert
  packed again for the grouped product's kernel), in the serving
  dtype or as int8 blocks with float16 scales in panels of 16 outputs (engine.jax_backend.quantize; a tied head that
  covers every row shares the embedding; with `int8_layout`, the formats of a GGUF's blocks, each
  matrix's bits and offsets as it is held), or as engine.jax_backend.channel_quant's matrices
  (`channels`: a byte a parameter and a float32 scale per output row), plus the panel-packed copies of the projections and the head that the
  CPU kernel of products of a few rows reads when the CPU kernels are on (each output count
  rounded up to whole panels of 32) (tests/test_memory_plan.py checks these
  figures against the loaded arrays);
- KV cache: the page pool, L x 2 buffers of [K, N, P, D] in the cache dtype (N pages of P
  positions, the null page included: `--kv-cache-tokens`, by default B x S positions, or the
  memory fraction below), and each slot's banned-id row [B, V']; prefix caching keeps pages of
  this pool and costs nothing more;
- temporaries: the larger of the two biggest calls' working sets, from the model's dimensions:
  one prefill chunk of C = min(S, max_chunk) tokens through one layer (activations, q/k/v, the
  blocked attention's float32 scores, the MLP's 2F features, rope in float32) and one decode
  step of B rows (the same per row, plus float32 scores over S positions, the head's [B, V']
  float32 logits with the sampler's copies of them and its exact select's tables, and the K and V
  of S positions per row that the XLA attention gathers from the pages; for a mixture of
  experts, k routed rows a token and the expert matrices its grouped products gather); with int8
  weights, a matrix dequantized to float32 where more than quantize.SLICED_ROWS rows multiply
  it; with `channels`, the widest matrix in the activations' dtype (where XLA does not fuse
  the convert into the product). Counted whole under tensor parallelism. This is an estimate of the largest arrays alive at
  once, not XLA's buffer assignment: the sampler's share is calibrated on XLA:CPU's own figures
  (docs/benchmarks.md, "Design measurements"), and tests/test_memory_plan.py checks that it bounds
  XLA:CPU's figure for whole prefill and decode steps of the tiny checkpoints.
Not counted: XLA's and the CUDA libraries' own workspaces, which live in the part of the GPU
that JAX's memory fraction leaves out (compose.gpu.yaml sets XLA_PYTHON_CLIENT_MEM_FRACTION).

The pool's size: `--kv-cache-tokens` (`loading.pool_pages`), or `--kv-cache-memory-fraction` F
(`fraction_pages`, as vLLM's gpu_memory_utilization): F x the smallest `bytes_limit` of the
model's devices (`accelerator_bytes`), less the plan's weights and its other parts per device,
in whole pages at one device's share of a position (`position_bytes`: a shard of the kv heads
under tensor parallelism). Accelerators only: the CPU reports no such figure.

The limit (`device_limit`): on a GPU, the allocator's `bytes_limit` from
`device.memory_stats()` (the device's memory times XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's
default 0.75) less what is already in use there; on the CPU, the host memory available now
(MemAvailable, or a cgroup's limit less its usage when lower), since the weights, the cache and
the temporaries all live in host memory and none of it is placed yet when the check runs; None
(no check, said in the log) where neither can be read. An operator or a test may state the
limit instead (`JaxModel.load(memory_limit_bytes=...)`, `--memory-limit-bytes`).

Shapes: B slots, S context, N pool pages, P page size, C prompt chunk, L layers, E hidden, F ffn, H heads, K kv heads, D head
dim, V embedding rows, V' head columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.core.model_options import least_kv_pages
from engine.jax_backend.quantize import BLOCK as INT8_BLOCK, LAYER_MATRICES, PANEL as INT8_PANEL, SLICED_ROWS as INT8_SLICED_ROWS, Int8Layout
from engine.model_store.gguf_blocks import SYMMETRIC, BlockFormat
from engine.jax_backend.cpu_kernels import PANEL
from engine.jax_backend.moe import copied_experts
from engine.model_store.checkpoint import ModelConfig
from engine.model_store.families import FAMILIES

GIB = 1 << 30
ATTENTION_BLOCK = 256  # key positions per block of prefill's chunk attention (transformer.chunk_attention)
# Head and sampling, per row: [V'] float32 arrays alive at once (with room over what XLA:CPU held,
# docs/benchmarks.md), and the exact select's histogram tables: bounded by four int32 tables of
# 2^16 (engine.jax_backend.sampling's RADIX_BITS levels are at most 16 bits wide).
SAMPLER_COPIES = 12
SELECT_TABLE_BYTES = 4 * 4 * 2**16


class MemoryPlanError(ValueError):
    """A configuration that cannot fit on the device: one line with the numbers and what to lower."""


@dataclass(frozen=True)
class Settings:
    """What the engine is asked to hold; the sizes a MemoryPlan is made of."""

    max_batch_size: int  # B
    context: int  # S
    max_chunk: int  # the largest prompt chunk one prefill call runs (capped at S)
    kv_pages: int  # N: pages in the KV pool, the null page included (loading.pool_pages)
    kv_page_size: int  # P: positions per page
    dtype_bytes: int  # the serving dtype: 4 float32, 2 bfloat16 (activations and cache)
    int8: bool = False  # weight-only int8 (activations and cache float32)
    int8_layout: Int8Layout | None = None  # int8 from a GGUF: each matrix's format; None: 8 bits and a scale
    panel_copies: bool = False  # the CPU kernels' panel-packed copies of the projections
    channels: str | None = None  # "int8" / "fp8": engine.jax_backend.channel_quant's matrices (activations in the dtype)
    devices: int = 1  # tensor parallelism: the devices the model is split over


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device will hold (module docstring for what each part counts)."""

    weights: int
    kv_cache: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.temporaries


@dataclass(frozen=True)
class MemoryLimit:
    """What one device offers, and where the figure comes from (said in the error and the log)."""

    bytes: int
    source: str


def plan(cfg: ModelConfig, head_size: int, s: Settings) -> MemoryPlan:
    """The bytes one device holds for model `cfg` (its head `head_size` = V' columns wide) as
    `s` says. Pure arithmetic on the dimensions."""
    n = s.devices
    kv = max(cfg.n_kv_heads, n) if n > 1 else cfg.n_kv_heads  # kv heads are replicated up to N
    act = 4 if s.int8 else s.dtype_bytes  # activations and cache: float32 under int8 weights
    cache = s.kv_pages * s.kv_page_size * position_bytes(cfg, s) + s.max_batch_size * head_size  # + banned-id rows [B, V'] bool
    return MemoryPlan(
        weights=-(-_weight_bytes(cfg, head_size, s, kv) // n),
        kv_cache=cache,
        temporaries=_temporaries(cfg, head_size, s, act),
    )


def position_bytes(cfg: ModelConfig, s: Settings) -> int:
    """One cached position's K and V over every layer, on one device: the pool is sharded on the
    kv-head axis, and its kv heads are replicated up to the devices when there are fewer."""
    n = s.devices
    kv = max(cfg.n_kv_heads, n) if n > 1 else cfg.n_kv_heads
    act = 4 if s.int8 else s.dtype_bytes  # the cache is float32 under int8 weights
    return -(-2 * cfg.n_layers * kv * cfg.head_dim * act // n)


def _weight_bytes(cfg: ModelConfig, head_size: int, s: Settings, kv: int) -> int:
    e, f, d, h = cfg.hidden_size, cfg.ffn_size, cfg.head_dim, cfg.n_heads
    qkv = (h + 2 * kv) * d  # the fused projection's width
    matrices = [e * qkv, h * d * e, e * 2 * f, f * e]  # w_qkv, w_o, w_gate_up, w_down
    vectors = 2 * e + (qkv if cfg.qkv_bias else 0) + (2 * d if cfg.qk_norm else 0)  # norms, bias, q/k norms
    vectors += (e if cfg.o_bias else 0) + (h if cfg.attention_sinks else 0)  # gpt-oss: o's bias, the sinks
    family = FAMILIES[cfg.architecture]
    vectors += 2 * e if family.post_norms else 0  # Gemma: the attention's and the MLP's outputs normed
    if s.channels:  # 1 byte a parameter and a float32 scale per output row; int8 embedding and head
        rows = [qkv, e, 2 * f, e]  # each matrix's outputs, in `matrices`' order
        head = 0 if cfg.tie_word_embeddings and head_size == cfg.vocab_size else head_size * (e + 4)
        layer = sum(matrices) + 4 * sum(rows) + vectors * s.dtype_bytes
        return cfg.n_layers * layer + cfg.vocab_size * (e + 4) + e * s.dtype_bytes + head
    if s.int8:
        layout = s.int8_layout or Int8Layout(((SYMMETRIC,) * len(LAYER_MATRICES),) * cfg.n_layers, SYMMETRIC, SYMMETRIC)
        dims = {"w_qkv": (e, qkv), "w_o": (h * d, e), "w_gate_up": (e, 2 * f), "w_down": (f, e)}  # [in, out]

        def per(fmt: BlockFormat, inputs: int, outputs: int) -> int:  # its blocks, outputs in whole panels
            return -(-outputs // INT8_PANEL) * INT8_PANEL * inputs // INT8_BLOCK * fmt.block_bytes

        head = 0 if cfg.tie_word_embeddings and head_size == cfg.vocab_size else per(layout.head, e, head_size)
        embed = per(layout.embed, e, cfg.vocab_size)
        if family.embed_scale:  # quantize.scaled: the embedding's scales (and offsets) again, in float32
            blocks = -(-cfg.vocab_size // INT8_PANEL) * INT8_PANEL * e // INT8_BLOCK
            copies = 1 + layout.embed.offset
            embed += blocks * copies * (4 if head == 0 else 2)  # beside the shared head's float16 ones, else instead
        layers = sum(
            sum(per(fmt, *dims[field]) for (field, _), fmt in zip(LAYER_MATRICES, formats, strict=True)) + vectors * 4
            for formats in layout.layers
        )
        return layers + embed + e * 4 + head
    panels = [k * -(-n // PANEL) * PANEL for k, n in ((e, qkv), (h * d, e), (e, 2 * f), (f, e))] if s.panel_copies else []
    layer = (sum(matrices) + sum(panels) + vectors) * s.dtype_bytes
    moe_layers = sum(cfg.moe_layers or ())  # each holds its router and experts (and their panels), no dense MLP
    moe_layer = layer + (_expert_parameters(cfg, s.panel_copies) - sum(matrices[2:]) - sum(panels[2:])) * s.dtype_bytes
    head_panels = e * -(-head_size // PANEL) * PANEL if s.panel_copies else 0
    return ((cfg.n_layers - moe_layers) * layer + moe_layers * moe_layer
            + (cfg.vocab_size * e + e + e * head_size + head_panels) * s.dtype_bytes)


def _expert_parameters(cfg: ModelConfig, panel_copies: bool) -> int:
    """An MoE layer's router [E, X] and experts (gate_up [X, E, 2F'], down [X, F', E]), and with
    `panel_copies` each expert packed again for the grouped product's kernel."""
    e, x, f = cfg.hidden_size, cfg.n_experts, cfg.expert_ffn_size
    panels = x * (e * -(-2 * f // PANEL) * PANEL + f * -(-e // PANEL) * PANEL) if panel_copies else 0
    biases = x + x * 2 * f + x * e if cfg.expert_bias else 0  # the router's, each expert's gate_up and down (gpt-oss)
    return e * x + x * 3 * e * f + panels + biases


def _temporaries(cfg: ModelConfig, head_size: int, s: Settings, act: int) -> int:
    """The larger working set of a prefill chunk and a decode step (module docstring)."""
    e, f, d, h, kv = cfg.hidden_size, cfg.ffn_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    per_token = (
        act * (3 * e + (h + 2 * kv) * d + h * d + 3 * f)  # x, normed x, new x; q/k/v; attention out; gate_up, act
        + 4 * 2 * (h + kv) * d  # rope's float32 rotation of q and k (in and out)
    )
    chunk = min(s.context, s.max_chunk)
    block = min(ATTENTION_BLOCK, s.context)
    prefill = chunk * per_token + 4 * h * chunk * (2 * block + d + 2)  # scores and p per block, acc, m and l (f32)
    b = s.max_batch_size
    sampler = SAMPLER_COPIES * 4 * head_size + SELECT_TABLE_BYTES  # per row
    window = 2 * kv * -(-s.context // s.kv_page_size) * s.kv_page_size * d * act  # K and V gathered per row
    decode = b * per_token + 4 * 2 * b * h * s.context + b * sampler + b * window
    if cfg.n_experts:  # the routed rows' activations and the expert matrices the grouped products gather
        prefill, decode = prefill + _moe_temporaries(cfg, chunk, act), decode + _moe_temporaries(cfg, b, act)
    if s.int8:  # the many-row path dequantizes a whole matrix to float32 (quantize.matmul)
        widest = max(e * (h + 2 * kv) * d, h * d * e, e * 2 * f, f * e)
        prefill += 4 * widest if chunk > INT8_SLICED_ROWS else 0
        decode += 4 * max(widest, head_size * e) if b > INT8_SLICED_ROWS else 0
    if s.channels:  # where XLA does not fuse the convert, one matrix widened to the dtype (channel_quant)
        widest = max(e * (h + 2 * kv) * d, h * d * e, e * 2 * f, f * e, head_size * e)
        prefill, decode = prefill + act * widest, decode + act * widest
    return max(prefill, decode)


def _moe_temporaries(cfg: ModelConfig, tokens: int, act: int) -> int:
    """One MoE MLP's working set for `tokens` tokens (engine.jax_backend.moe): k rows a token
    (their inputs, 2F' + F' features and float32 outputs), and the widest matrices gathered."""
    e, x, f, k = cfg.hidden_size, cfg.n_experts, cfg.expert_ffn_size, cfg.experts_per_token
    rows = tokens * k
    return rows * (act * (e + 3 * f) + 4 * (2 * f + e)) + copied_experts(rows, x) * e * 2 * f * act


def device_limit(device, meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> MemoryLimit | None:
    """What `device` (a jax.Device) offers now (module docstring); None where it cannot be read."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        in_use = stats.get("bytes_in_use", 0)
        source = (
            f"{device.platform}:{device.id} bytes_limit {gib(stats['bytes_limit'])} (its memory x "
            f"XLA_PYTHON_CLIENT_MEM_FRACTION) less {gib(in_use)} in use"
        )
        return MemoryLimit(stats["bytes_limit"] - in_use, source)
    if device.platform == "cpu":
        return host_limit(meminfo, cgroup)
    return None


def accelerator_bytes(devices) -> MemoryLimit | None:
    """The memory JAX's allocator may use on each of `devices` (jax.Devices: `bytes_limit`, the
    device's memory x XLA_PYTHON_CLIENT_MEM_FRACTION), the smallest of them, since each device of
    a mesh holds the same share of the pool; None where one reports none (the CPU, whose
    host memory is not the accelerator budget a fraction is meant for)."""
    limits = []
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append((stats["bytes_limit"], f"{device.platform}:{device.id}"))
    limit, name = min(limits)
    return MemoryLimit(limit, f"{name} bytes_limit {gib(limit)}")


def fraction_pages(
    device_bytes: int, weight_bytes: int, working_bytes: int, token_bytes: int, page_size: int, fraction: float,
    max_batch_size: int,
) -> int:
    """The KV pool's pages (the null page not counted) that `fraction` of one device's
    `device_bytes` holds once that device's `weight_bytes` and `working_bytes` (the temporaries
    and the banned-id rows) are taken out, at `token_bytes` per position on that device (one
    shard under tensor parallelism), in whole pages of `page_size` positions; the null page is paid
    for from the same share. Pure arithmetic, like vLLM's gpu_memory_utilization. MemoryPlanError,
    one line with the figures, for a fraction outside (0, 1] or one that leaves fewer pages than
    `max_batch_size` sequences need (model_options.least_kv_pages)."""
    if not 0 < fraction <= 1:
        raise MemoryPlanError(f"the KV cache memory fraction must be in (0, 1], got {fraction}")
    share = int(fraction * device_bytes)
    left = share - weight_bytes - working_bytes
    page_bytes = token_bytes * page_size
    pages = max(left // page_bytes - 1, 0)
    least = least_kv_pages(max_batch_size)
    if pages < least:
        raise MemoryPlanError(
            f"KV cache memory fraction {fraction} leaves {gib(left)} for the KV cache ({fraction} x {gib(device_bytes)} "
            f"= {gib(share)}, less weights {gib(weight_bytes)} and working memory {gib(working_bytes)}): "
            f"{plural(pages, 'page')} of {page_size} tokens at {gib(page_bytes)} a page, the null page aside; max batch "
            f"size {max_batch_size} needs at least {least} pages ({least * page_size} tokens): raise the fraction "
            f"(--kv-cache-memory-fraction), lower --max-batch-size, or give the pool in tokens (--kv-cache-tokens)"
        )
    return pages


def plural(n: int, noun: str) -> str:
    """"1 page", "0 pages", "9 pages"."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def host_limit(meminfo: Path, cgroup: Path) -> MemoryLimit | None:
    """The host's available memory: MemAvailable, or a cgroup's (v2, then v1) limit less its
    usage when that is lower; None when /proc/meminfo cannot be read (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # "21052868 kB"
    except (OSError, KeyError, ValueError):
        return None
    best = MemoryLimit(available, f"the host's available memory (MemAvailable {gib(available)})")
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit, usage = int((cgroup / limit_file).read_text()), int((cgroup / usage_file).read_text())
        except (OSError, ValueError):  # absent, or "max" (no limit)
            continue
        if limit - usage < best.bytes:
            best = MemoryLimit(limit - usage, f"the cgroup's memory limit {gib(limit)} less {gib(usage)} in use")
        break
    return best


def check(cfg: ModelConfig, head_size: int, s: Settings, limit: MemoryLimit, backend: str) -> MemoryPlan:
    """The plan when it fits `limit`; else MemoryPlanError, one line: the parts, the total, the
    limit and its source, the largest KV pool that would fit with the rest unchanged, and the
    other settings that lower it (those not already at their smallest)."""
    need = plan(cfg, head_size, s)
    if need.total <= limit.bytes:
        return need
    tokens = (s.kv_pages - 1) * s.kv_page_size
    fits = _most_pages(cfg, head_size, s, limit)
    pool = f"KV cache tokens {tokens} (" + (f"at most {fits * s.kv_page_size} fit)" if fits else "none fit)")
    lower = [pool, f"max batch size {s.max_batch_size}", f"context length {s.context}"]
    if s.dtype_bytes == 4 and not s.int8:
        lower.append("the weights' size (dtype bfloat16" + (", or weights int8)" if backend == "cpu" and s.devices == 1 else ")"))
    if s.panel_copies:
        lower.append("CPU kernels off (drops the projections' second copy)")
    raise MemoryPlanError(
        f"the model does not fit in memory: weights {gib(need.weights)} + KV cache {gib(need.kv_cache)} "
        f"({pool_words(s)}) + temporaries {gib(need.temporaries)} = {gib(need.total)} > {gib(limit.bytes)}, "
        f"{limit.source}; lower " + ", ".join(lower)
    )


def pool_words(s: Settings) -> str:
    """The pool for people: "1025 pages of 16 = 16384 tokens" (the null page not counted in tokens)."""
    return f"{s.kv_pages} pages of {s.kv_page_size} = {(s.kv_pages - 1) * s.kv_page_size} tokens"


def _most_pages(cfg: ModelConfig, head_size: int, s: Settings, limit: MemoryLimit) -> int:
    """The most KV pages (the null page not counted) that fit with the rest of `s` unchanged; 0: none."""
    lo, hi = 0, s.kv_pages - 1  # lo fits (or is 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(cfg, head_size, replace(s, kv_pages=mid + 1)).total <= limit.bytes else (lo, mid)
    return lo


def gib(n: int) -> str:
    """Bytes for people, 2 decimals: GiB from 1 GiB up (12.50 GiB), MiB below (0.53 MiB)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.2f} MiB"
