"""Loading a model: a Hugging Face directory into a `JaxModel`, with the served defaults.

Data flow: `load` resolves what to run from `ModelOptions` (default: engine.core.model_options.
SERVED, what decode-server runs with no flags) and the backend's profile
(engine.jax_backend.backend_profile): whether the CPU kernels run (`kernel_state`, decided here
once), the weights' format (`auto_weights`), then checks the sizes on config.json and the memory
they take against the device (engine.jax_backend.memory_plan) before any weight is placed, reads
the weights (float32 or bfloat16, int8, or split over a mesh) and builds the model.

Its keywords are `ModelOptions` fields (three under the names JaxModel.load has always taken them:
`LOAD_NAMES`) and the compile-time `ShapeKnobs`; anything not given is the served choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.core.model import ModelInfo
from engine.core.model_options import ModelOptions
from engine.jax_backend import cpu_kernels, memory_plan, mesh, quantize
from engine.jax_backend.backend_profile import BackendProfile, profile
from engine.jax_backend.shapes import ShapeKnobs
from engine.jax_backend.weights import load_channels, load_checkpoint, load_int8, load_sharded
from engine.model_store.checkpoint import ModelConfig, parse_config, tokenizer_size

log = logging.getLogger(__name__)

# JaxModel.load's keywords for three ModelOptions fields (the flags' names are the fields')
LOAD_NAMES = {"kernels": "cpu_kernels", "max_chunk": "max_prefill_chunk", "fused_chunk_tokens": "max_step_tokens"}


def settings(options: ModelOptions, overrides: dict) -> tuple[ModelOptions, ShapeKnobs]:
    """JaxModel's keywords `overrides` applied: -> (the options, the shape knobs). An unknown
    keyword is a TypeError, as for any function."""
    knob_names = {f.name for f in dataclasses.fields(ShapeKnobs)}
    knobs = ShapeKnobs(**{k: v for k, v in overrides.items() if k in knob_names})
    changes = {LOAD_NAMES.get(k, k): v for k, v in overrides.items() if k not in knob_names}
    return dataclasses.replace(options, **changes), knobs


def build_options(options: ModelOptions) -> cpu_kernels.BuildOptions:
    """Where the kernels are looked for and built, and with which compiler."""
    return cpu_kernels.BuildOptions(options.cache_dir, options.compiler)


def kernel_state(
    requested: bool, dtype: jnp.dtype, build: cpu_kernels.BuildOptions, tensor_parallel: int, backend: BackendProfile
) -> str:
    """Whether a model's decode steps use the CPU kernels, as `JaxModel.kernel_state` says it:
    "on: ...", "off: <reason>" or "not applicable: <reason>"; the log says the same (at WARNING
    when they would apply here but cannot be loaded, engine.jax_backend.cpu_kernels.status)."""
    if not requested:
        log.info("CPU decode kernels off: turned off by configuration; using plain JAX")
        return f"{cpu_kernels.OFF}: turned off by configuration"
    if tensor_parallel > 1 and backend.cpu:
        # An XLA custom call is opaque to the SPMD partitioner; the kernels read whole packed
        # weights and whole cache rows, so under a mesh they would need shard_map wrappers.
        reason = f"tensor parallelism over {tensor_parallel} devices (the partitioner cannot split their custom calls)"
        log.info("CPU decode kernels off: %s; using plain JAX", reason)
        return f"{cpu_kernels.OFF}: {reason}"
    if backend.cpu and dtype != jnp.float32:
        log.info("CPU decode kernels not applicable: they are float32 only, the dtype is %s; using plain JAX", dtype)
        return f"{cpu_kernels.NOT_APPLICABLE}: the dtype is {dtype}, and they are float32 only"
    return cpu_kernels.status(build).state


def cpu_kernels_for(
    o: ModelOptions, dtype: jnp.dtype, devices: int, backend: BackendProfile, state: str | None,
    build: cpu_kernels.BuildOptions | None,
) -> tuple[str, int]:
    """A model's kernel state (`state` when `load` decided it already, else decided here) and
    its threads per kernel call (the CPUs this process may use, or options.cpu_threads; set in
    the library), or 1 without the kernels."""
    build = build or build_options(o)
    state = state or kernel_state(o.cpu_kernels, dtype, build, devices, backend)
    if not kernels_on(state):
        return state, 1
    threads = o.cpu_threads or cpu_kernels.available_cpus()
    cpu_kernels.set_threads(cpu_kernels.status(build).kernels, threads)
    return state, threads


def kernels_on(state: str) -> bool:
    return state.split(":", 1)[0] == cpu_kernels.ON


def auto_weights(model_dir: Path, kernels: bool) -> str:
    """What `weights="auto"` (the servers' default) serves: "int8" where the CPU kernels run
    (`kernels`: the CPU backend, one device, float32, a library loaded; as `kernel_state`
    decides, and says why not) for a model that brings its own GGUF (a pulled model keeps it as
    model.gguf, whose Q8_0, Q4_0/1 and Q5_0/1 blocks are served as the file has them, in their own
    8, 4 and 5 bits: the values float32 holds). There int8 decodes faster than float32 in less memory and passes the quality
    gates (docs/benchmarks.md, issue 15). Elsewhere "float32", also for a checkpoint with no GGUF
    (its int8 would be our own quantization of it, not gated on that model), and for a mixture of
    experts (its experts have no int8 product: `check_moe_weights`). Logs the choice."""
    from engine.model_store.gguf_convert import GGUF_NAME  # (gguf_convert imports the gguf package: only here)

    reasons = []
    config = parse_config(json.loads((model_dir / "config.json").read_text())) if (model_dir / "config.json").is_file() else None
    if config is not None and config.n_experts:
        reasons.append(f"{config.architecture}: {MOE_FLOAT_ONLY}")
    if not kernels:
        reasons.append("the CPU kernels are off")
    if not (model_dir / GGUF_NAME).is_file():
        reasons.append(f"no {GGUF_NAME} in the model directory")
    choice = "float32" if reasons else "int8"
    log.info("weights auto: %s (%s)", choice, ", ".join(reasons) or f"the CPU kernels and the model's {GGUF_NAME}: its 4- and 5-bit blocks held as they are")
    return choice


MOE_FLOAT_ONLY = "a mixture of experts runs in float32 or bfloat16 (int8 and fp8 experts are not supported)"


def check_moe_weights(cfg: ModelConfig, weights: str) -> None:
    """Refuse int8 / fp8 for a mixture of experts (engine.jax_backend.moe multiplies its experts
    in the dtype only): ValueError naming the flag and why, before anything is read."""
    if cfg.n_experts and weights in ("int8", "fp8"):
        raise ValueError(f"--weights {weights} cannot serve {cfg.architecture}: {MOE_FLOAT_ONLY}; use --weights float32")


def int8_layout(model_dir: Path, cfg) -> quantize.Int8Layout | None:
    """The formats `--weights int8` holds this directory's matrices in, for the memory check:
    from its model.gguf's header (engine.model_store.gguf_blocks), or None (no GGUF: 8 bits and a
    scale everywhere)."""
    from engine.model_store import gguf_blocks, gguf_convert  # (the gguf package: only here)

    path = model_dir / gguf_convert.GGUF_NAME
    return quantize.gguf_layout(gguf_blocks.block_formats(path), cfg) if path.is_file() else None


def _check_weights(o: ModelOptions) -> None:
    """The weight format against the rest, before anything is read."""
    if o.weights not in (*quantize.WEIGHTS, quantize.AUTO):
        raise ValueError(f"weights must be one of {', '.join((*quantize.WEIGHTS, quantize.AUTO))}, got {o.weights!r}")
    if o.weights in ("int8", "fp8") and o.tensor_parallel > 1:
        raise ValueError(f"{o.weights} weights run on one device: they cannot be combined with tensor parallelism")


def _context(cfg: ModelConfig, max_batch_size: int, max_context_length: int | None) -> int:
    """The context a model of `cfg` serves (checked against it)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if max_context_length is not None and not 1 <= max_context_length <= cfg.max_position_embeddings:
        raise ValueError(
            f"max_context_length must be in 1..{cfg.max_position_embeddings} (the model's "
            f"max_position_embeddings), got {max_context_length}"
        )
    return max_context_length or min(cfg.max_position_embeddings, 2048)


def pool_pages(o: ModelOptions, max_batch_size: int, context: int) -> int:
    """N, the KV pool's pages, the null page 0 included: `kv_cache_tokens` in whole pages, or
    with 0 a whole context's pages for each of the `max_batch_size` slots (today's slot cache: B
    sequences of the longest length fit at once, so nothing is ever preempted)."""
    if o.kv_page_size < 1:
        raise ValueError(f"kv_page_size must be >= 1, got {o.kv_page_size}")
    if o.kv_cache_tokens < 0:
        raise ValueError(f"kv_cache_tokens must be >= 0, got {o.kv_cache_tokens}")
    if o.kv_cache_memory_fraction is not None:
        raise ValueError("kv_cache_memory_fraction is resolved to kv_cache_tokens by load (sized_pool), not here")
    if o.kv_cache_tokens == 0:
        return max_batch_size * -(-context // o.kv_page_size) + 1
    return -(-o.kv_cache_tokens // o.kv_page_size) + 1


def sized_pool(
    o: ModelOptions, cfg: ModelConfig, head_size: int, s: memory_plan.Settings, devices: list | None = None
) -> tuple[ModelOptions, str]:
    """`o` with the KV pool's size in kv_cache_tokens, and where that size came from (for the
    memory plan's line): a memory fraction is resolved here, once, on `devices` (default: this
    process's; memory_plan.fraction_pages, from the rest of the plan `s` for model `cfg` with its
    head `head_size` columns wide); MemoryPlanError where they report no memory figure (the CPU)
    or the share is too small. `s.kv_pages` is not read. The processes of a multi-host group each
    resolve it on their own devices, alike where the devices are alike (their bytes_limit, not
    what is in use)."""
    fraction = o.kv_cache_memory_fraction
    if fraction is None:
        if o.kv_cache_tokens:
            return o, f"--kv-cache-tokens {o.kv_cache_tokens}"
        return o, f"--kv-cache-tokens 0: max batch size {s.max_batch_size} x context {s.context}"
    if o.kv_cache_tokens:
        raise ValueError("kv_cache_tokens and kv_cache_memory_fraction both size the KV pool: give one of them")
    devices = devices or jax.local_devices()
    limit = memory_plan.accelerator_bytes(devices)
    if limit is None:
        raise memory_plan.MemoryPlanError(
            f"the KV cache memory fraction (--kv-cache-memory-fraction {fraction}) is a share of an accelerator's memory, "
            f"and {devices[0].platform}:{devices[0].id} reports none: give the pool in tokens with --kv-cache-tokens"
        )
    rest = memory_plan.plan(cfg, head_size, dataclasses.replace(s, kv_pages=0))  # kv_cache: the banned-id rows alone
    pages = memory_plan.fraction_pages(
        limit.bytes, rest.weights, rest.kv_cache + rest.temporaries, memory_plan.position_bytes(cfg, s),
        o.kv_page_size, fraction, s.max_batch_size,
    )
    resolved = dataclasses.replace(o, kv_cache_tokens=pages * o.kv_page_size, kv_cache_memory_fraction=None)
    return resolved, f"--kv-cache-memory-fraction {fraction} of {limit.source}, less the weights and working memory"


def _check_memory(cfg: ModelConfig, head_size: int, settings: memory_plan.Settings, limit_bytes: int | None, pool: str) -> None:
    """The memory check (engine.jax_backend.memory_plan): MemoryPlanError before any weight is read.
    The log line says the pool in pages and tokens, and `pool`, where its size came from."""
    if limit_bytes:
        limit = memory_plan.MemoryLimit(limit_bytes, "the limit stated by configuration")
    else:
        limit = memory_plan.device_limit(jax.local_devices()[0])
    if limit is None:
        log.info("memory check skipped: %s reports no memory limit; KV cache %s, from %s",
                 jax.local_devices()[0], memory_plan.pool_words(settings), pool)
        return
    need = memory_plan.check(cfg, head_size, settings, limit, profile().name)
    log.info(
        "memory plan per device: weights %s + KV cache %s (%s, from %s) + temporaries %s = %s of %s, %s",
        memory_plan.gib(need.weights), memory_plan.gib(need.kv_cache), memory_plan.pool_words(settings), pool,
        *map(memory_plan.gib, (need.temporaries, need.total, limit.bytes)), limit.source,
    )


def _weight_format(weights: str, kernels: bool, dtype: jnp.dtype) -> tuple[bool, str | None]:
    """How `weights` is held: (the CPU kernels' int8 blocks, engine.jax_backend.quantize; or the
    per-output-channel format, "int8" or "fp8", engine.jax_backend.channel_quant; or neither, the
    dtype's own). int8 takes the kernels' blocks where the kernels run, channels elsewhere."""
    blocks = weights == "int8" and kernels
    channels = weights if weights in ("int8", "fp8") and not blocks else None
    log.info("weights %s: %s", weights, "the CPU kernels' blocks" if blocks else "per output channel, XLA's products"
             if channels else f"the dtype's own ({dtype.name})")
    return blocks, channels


def load(cls, model_dir: str | Path, options: ModelOptions, *, max_batch_size: int, model_id: str | None,
         kernel_build: cpu_kernels.BuildOptions | None, split_sampler: bool | None, **overrides):
    """`cls` (JaxModel) read from the Hugging Face directory `model_dir`; the context defaults to
    min(max_position_embeddings, 2048). `options` (engine.core.model_options says what each field
    does), changed by `overrides`: ModelOptions fields (`kernels`, `max_chunk` and
    `fused_chunk_tokens` for cpu_kernels, max_prefill_chunk and max_step_tokens: LOAD_NAMES),
    and the compile-time knobs of engine.jax_backend.shapes.ShapeKnobs (`min_bucket`,
    `min_attend`, `min_rows`, `min_packed`; fewer shapes warm up faster). The compilation cache
    is the process's (services.cli turns it on before anything compiles), not the model's.

    `kv_cache_tokens` / `kv_page_size`: the KV page pool, `pool_pages` of `kv_page_size`
    positions (the scheduler hands them out, engine.core.kv_pages), or on an accelerator
    `kv_cache_memory_fraction` of its memory instead (`sized_pool`); `max_batch_size` and the
    context then bound what is decoded together and how long a sequence grows, and reserve no
    memory of their own.

    `kernel_build`: where the CPU kernels are looked for and built (default: options.cache_dir
    and options.compiler); the model's `kernels` says whether they are on and `kernel_state` why.
    With them, attention reads each row's live keys in place, and the weight products of up to
    cpu_kernels.PANEL_ROWS rows run on panel-packed copies of the projections (held besides the
    originals; none with cpu_kernels False). `weights`: "float32" (the dtype's own), "int8"
    (with the CPU kernels engine.jax_backend.quantize's blocks, float32 activations; without
    them engine.jax_backend.channel_quant's per-channel int8 in the dtype), "fp8"
    (channel_quant's e4m3, native fp8 products) or "auto" (`auto_weights`); int8 and fp8 on one
    device only (ValueError). `max_step_tokens`: also the longest chunk
    a decode step takes along (`dispatch`), padded to the smallest prompt bucket that holds it;
    None: with the CPU kernels on, the backend's budget, otherwise 0 (each chunk its own calls).
    `split_sampler`: every decode step as two executables, the layers and then the head and
    sampling in a greedy or a full variant the host picks per step (the greedy one when every
    row is greedy and wants no alternatives); False: a greedy step as one executable with the
    greedy sampler inside, the rest as the two; default: the backend's (on an accelerator; off on
    the CPU, where a batch-1 step's second dispatch costs a measurable part of it). A size the model's dimensions or the devices refuse raises
    ValueError (mesh.TensorParallelError; memory_plan.MemoryPlanError, one line, when the
    configuration cannot fit `memory_limit_bytes` or what the device offers) before any weight
    is read.
    """
    model_dir = Path(model_dir)
    o, knobs = settings(options, overrides)
    build = kernel_build or build_options(o)
    _check_weights(o)
    cfg = parse_config(json.loads((model_dir / "config.json").read_text()))
    check_moe_weights(cfg, o.weights)
    context = _context(cfg, max_batch_size, o.max_context_length)
    if o.tensor_parallel > 1 and not jax.distributed.is_initialized():
        mesh.request_cpu_devices(o.tensor_parallel)  # (as load_sharded does) before the backend starts below
    dtype = jnp.dtype(o.dtype or profile().dtype)
    state = kernel_state(o.cpu_kernels, dtype, build, o.tensor_parallel, profile())
    weights = auto_weights(model_dir, kernels_on(state)) if o.weights == quantize.AUTO else o.weights
    blocks, channels = _weight_format(weights, kernels_on(state), dtype)
    head_size = tokenizer_size(model_dir, cfg.vocab_size)
    sizes = memory_plan.Settings(
        max_batch_size, context, o.max_prefill_chunk, 0, o.kv_page_size, dtype.itemsize,  # kv_pages: below
        int8=blocks,
        int8_layout=int8_layout(model_dir, cfg) if blocks else None,
        panel_copies=kernels_on(state) and weights == "float32",
        channels=channels,
        devices=o.tensor_parallel,
    )
    o, pool = sized_pool(o, cfg, head_size, sizes)
    sizes = dataclasses.replace(sizes, kv_pages=pool_pages(o, max_batch_size, context))
    _check_memory(cfg, head_size, sizes, o.memory_limit_bytes, pool)
    plan = None
    if blocks:
        ckpt = load_int8(model_dir)
        cfg = ckpt.config
    elif channels:
        ckpt = load_channels(model_dir, channels, dtype.name)
        cfg = ckpt.config
    elif o.tensor_parallel == 1:
        ckpt = load_checkpoint(model_dir, o.dtype)
        cfg = ckpt.config
    else:
        ckpt, cfg, plan = load_sharded(model_dir, o.dtype, o.tensor_parallel)
    info = ModelInfo(model_id or model_dir.name, cfg.vocab_size, context, max_batch_size, ckpt.eos_token_ids)
    return cls(
        cfg, ckpt.weights, info, dtype, o, plan=plan, kernel_state=state,
        kernel_build=build, split_sampler=split_sampler, **dataclasses.asdict(knobs),
    )
