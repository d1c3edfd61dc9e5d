"""The GPU check's phases that run JAX, one per process:

    python -m benchmarks.gpu_check.phases PHASE PLAN.json RESULT.json [ARG]

PHASE is env, golden, real-model (ARG: the model directory), speed-<i> (the plan's i-th speed
shape), weights (the first speed shape in the plan's quantized formats), speculative (the last
speed shape's verify step) or stack-model (ARG: where to write it). Each writes one JSON object to RESULT.json; an
exception is written there as {"error": ...} and exits 1. The orchestrator (__main__) runs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode import Bandwidth, Slots, kv_bytes_per_token, weight_bytes
from benchmarks.gpu_check.plan import Plan
from benchmarks.gpu_check.random_model import model_config, random_model, random_weights, write_random_checkpoint
from engine.core.model import SlotSetup
from engine.core.request import MAX_TOP_LOGPROBS, SamplingParams
from engine.jax_backend import channel_quant, sampling, transformer
from engine.jax_backend.jax_model import MAX_CHUNK, JaxModel
from engine.jax_backend.weights import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
STACK_TOKENIZER = ASSETS / "tokenizers" / "gpt2"  # 50,257 ids; the text service needs a real tokenizer
# |logit - golden| <= atol + rtol * (the largest |golden logit| of the row). float32: the parity
# test's bound. bfloat16 keeps 8 significant bits, and its error grows with the activations' scale
# rather than with each logit's own size, so the bound is relative to the row; the differences it
# allows against those seen on the CPU's bfloat16: docs/benchmarks.md, "GPU check".
TOLERANCE = {"float32": (1e-4, 0.0), "bfloat16": (0.02, 0.02)}
REAL_QUESTION = "What is the capital of France?"
REAL_ANSWER = "The capital of France is Paris."  # transformers float32, greedy (tests/test_real_model.py)


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# -- env ------------------------------------------------------------------------------------


def env(plan: Plan) -> dict:
    devices = []
    for d in jax.devices():
        stats = {}
        try:
            stats = {k: v for k, v in (d.memory_stats() or {}).items() if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
        except Exception as error:  # CPU devices have none
            stats = {"unavailable": str(error)}
        devices.append({"platform": d.platform, "kind": d.device_kind, "id": d.id, "memory": stats})
    versions = {}
    for package in ("jax", "jaxlib", "numpy", "grpcio", "protobuf", "tokenizers", "safetensors", "pytest"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    plugins = sorted(d.metadata["Name"] for d in metadata.distributions() if "cuda" in (d.metadata["Name"] or "").lower())
    return {
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "backend": jax.default_backend(), "devices": devices, "versions": versions, "cuda_packages": plugins,
        "int8": importlib.util.find_spec("engine.jax_backend.quantize") is not None,  # --weights int8 (CPU kernels)
        "channel_weights": importlib.util.find_spec("engine.jax_backend.channel_quant") is not None,  # int8 / fp8 elsewhere
    }


# -- golden: the tiny checkpoints in the plan's dtype against transformers' float32 -----------


def golden(plan: Plan) -> dict:
    """Each golden case teacher-forced (the golden greedy ids are fed back, so a near-tie that
    the lower precision resolves otherwise does not change what follows): first logits, the
    top-8 logits at every step, and the greedy id wherever the golden top-2 gap exceeds twice the
    tolerance (a decisive step)."""
    atol, rtol = TOLERANCE.get(plan.dtype, TOLERANCE["bfloat16"])
    prefill = jax.jit(transformer.prefill, static_argnames="cfg", donate_argnums=1)
    decode = jax.jit(transformer.decode, static_argnames=("cfg", "attend", "kernels"), donate_argnums=1)
    results = {}
    for name in plan.goldens:
        ckpt = load_checkpoint(ASSETS / name, dtype=plan.dtype)
        cfg, weights = ckpt.config, ckpt.weights
        cases = json.loads((ASSETS / name / "golden.json").read_text())["cases"]
        context, bucket = 64, 32
        cache = transformer.init_cache(cfg, len(cases), context, jnp.dtype(plan.dtype))
        worst, compared, decisive, agree, outside = 0.0, 0, 0, 0, 0
        for slot, case in enumerate(cases):
            prompt, greedy = case["prompt_ids"], case["greedy_ids"]
            tokens = np.zeros(bucket, np.int32)
            tokens[: len(prompt)] = prompt
            logits, cache = prefill(weights, cache, tokens, np.int32(len(prompt)), np.int32(slot), cfg=cfg)
            rows = [(np.asarray(logits, np.float32), np.arange(len(case["first_logits"])), np.asarray(case["first_logits"]))]
            for step in range(1, len(case["steps"])):
                ids, positions, active = (np.zeros(len(cases), np.int32) for _ in range(3))
                ids[slot], positions[slot], active[slot] = greedy[step - 1], len(prompt) + step - 1, 1
                logits, cache = decode(weights, cache, ids, positions, active.astype(bool), cfg=cfg, attend=context, kernels=False)
                top = case["steps"][step]
                rows.append((np.asarray(logits, np.float32)[slot], np.asarray(top["ids"]), np.asarray(top["logits"])))
            for step, (row, ids, expected) in enumerate(rows):
                got, bound = row[ids], atol + rtol * float(np.max(np.abs(expected)))
                worst = max(worst, float(np.max(np.abs(got - expected))))
                outside += int(np.sum(np.abs(got - expected) > bound))
                compared += len(ids)
                ordered = np.sort(expected)[::-1]
                if ordered[0] - ordered[1] > 2 * bound:
                    decisive += 1
                    agree += int(np.argmax(row) == greedy[step])
        results[name] = {
            "max_abs_diff": worst, "logits_compared": compared, "outside_tolerance": outside,
            "decisive_steps": decisive, "greedy_agree": agree,
        }
    ok = all(r["outside_tolerance"] == 0 and r["greedy_agree"] == r["decisive_steps"] for r in results.values())
    return {"dtype": plan.dtype, "tolerance": {"atol": atol, "rtol": rtol}, "checkpoints": results, "ok": ok}


# -- the real default model through both services --------------------------------------------


def real_model(plan: Plan, model_dir: str) -> dict:
    from protos.decode.v1 import decode_pb2 as dpb
    from protos.text.v1 import text_pb2 as pb
    from services.decode_server import start_decode_server
    from services.text_server import start_text_server
    from tokenizer_svc.tokenizer import TextTokenizer
    import grpc
    from protos.text.v1 import text_pb2_grpc

    model = JaxModel.load(model_dir, max_batch_size=2, max_context_length=256, min_bucket=64, dtype=plan.dtype)
    warm_s, _ = _timed(model.warm_up)
    compiled = model.compilations()

    async def ask() -> dict:
        decode = await start_decode_server(model)
        text = await start_text_server(TextTokenizer.from_dir(model_dir), f"127.0.0.1:{decode.port}")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{text.port}") as channel:
                stub = text_pb2_grpc.TextGenerationStub(channel)
                chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=REAL_QUESTION)])
                request = pb.GenerateRequest(chat=chat)
                request.stopping.max_output_tokens = 40
                started = time.perf_counter()
                completion = await stub.Complete(request)
                return {
                    "answer": completion.text, "token_ids": list(completion.token_ids),
                    "finish": dpb.FinishReason.Name(completion.reason), "seconds": time.perf_counter() - started,
                }
        finally:
            await text.stop(None)
            await decode.stop(None)

    answer = asyncio.run(ask())
    return {
        "model_dir": str(model_dir), "dtype": plan.dtype, "question": REAL_QUESTION, "expected": REAL_ANSWER, **answer,
        "ok": answer["answer"] == REAL_ANSWER, "warm_up_s": warm_s, "compilations_after_warm_up": model.compilations() - compiled,
    }


# -- speed with random weights of a model's shape ---------------------------------------------


def speed(plan: Plan, index: int) -> dict:
    shape = plan.speed_shapes[index]
    cfg = model_config(shape)
    build_s, weights = _timed(lambda: random_weights(cfg, plan.dtype))
    bandwidth = Bandwidth(plan.bandwidth_gib)
    result = {"shape": shape.name, "parameters": shape.parameters(), "dtype": plan.dtype, "weights_build_s": build_s}
    result["decode"] = _decode_speed(plan, shape, weights, bandwidth)
    if index == 0:  # the sampler's cost depends on the vocabulary and the rows, not on the layers
        result["sampling"] = sampling_profile(shape.vocab, sorted({1, max(plan.batches)}))
    gc.collect()  # the decode model's KV cache goes before the prefill model's is made
    result["prefill"] = _prefill_speed(plan, shape, weights)
    result["bandwidth_gbs"] = result["decode"]["bandwidth_gbs"]
    return result


PROFILE_REPEATS, PROFILE_LAGGED = 5, 8  # step_profile: best of 5 single steps, of 5 runs of 8 lagged steps, of 5 host
# timings, and of 5 steps with the full sampler


def decode_context(plan: Plan) -> int:
    """The decode model's context: slot 0 takes part in every step _decode_speed runs (an untimed
    one and the timed ones per batch size, then step_profile's), rounded up to a multiple of 64."""
    steps = len(plan.batches) * (1 + plan.rounds * plan.steps) + PROFILE_REPEATS * (3 + PROFILE_LAGGED)
    return -(-(plan.prompt_len + steps + 1) // 64) * 64


def _decode_speed(plan: Plan, shape, weights, bandwidth: Bandwidth, warm_up: bool = True) -> dict:
    """Decode steps at each of the plan's batch sizes, rounds interleaved with the bandwidth's.
    `warm_up` False (the weights phase): no warm-up and no step profile; only the row buckets the
    batches use are compiled, by their untimed steps, and compilations are counted after those."""
    batches = plan.batches
    context = decode_context(plan)
    # One attend bucket (the context) and one prompt bucket: few compiles. No chunk along a decode
    # step (an accelerator's default, so the same model there): no step measured here takes one,
    # and on a CPU each would be a step of every layer to warm up for nothing.
    model, _ = random_model(
        shape, plan.dtype, weights, max_batch_size=max(batches), max_context_length=context, min_attend=context,
        min_bucket=plan.prompt_len, max_chunk=plan.prompt_len, fused_chunk_tokens=0,
    )
    warm_s, _ = _timed(model.warm_up if warm_up else lambda: None)
    compiled = model.compilations()
    fill_s, slots = _timed(lambda: Slots(model, max(batches), plan.prompt_len))
    for batch in batches:  # one untimed step each
        slots.step(batch)
    if not warm_up:
        compiled = model.compilations()
    w_bytes, kv_token = weight_bytes(model), kv_bytes_per_token(model)
    seconds = {b: [] for b in batches}
    step_bytes = {b: [] for b in batches}
    gbs = []
    for _ in range(plan.rounds):
        gbs.append(bandwidth.measure_gbs(repeats=5))
        for batch in batches:
            seconds[batch].append(statistics.median(slots.step(batch) for _ in range(plan.steps)))
            step_bytes[batch].append(w_bytes + slots.mean_length(batch) * batch * kv_token)
    rows = []
    for batch in batches:
        mbu = [b / s / (g * 1e9) for b, s, g in zip(step_bytes[batch], seconds[batch], gbs)]
        floor = [b / (g * 1e9) for b, g in zip(step_bytes[batch], gbs)]
        step = statistics.median(seconds[batch])
        rows.append({
            "batch": batch, "step_s": step, "step_s_range": [min(seconds[batch]), max(seconds[batch])],
            "tok_s": batch / step, "tpot_s": step, "mbu": statistics.median(mbu),
            "floor_s": statistics.median(floor), "bytes_per_step": statistics.median(step_bytes[batch]),
        })
    profile = step_profile(model, slots) if warm_up else {"skipped": "no warm-up in this phase"}
    after = model.compilations() - compiled
    slots.release()
    return {
        "context": context, "prompt_len": plan.prompt_len, "max_batch_size": max(batches), "warm_up_s": warm_s,
        "compilations_at_warm_up": compiled, "compilations_after_warm_up": after, "fill_s": fill_s,
        "weight_bytes": w_bytes, "kv_bytes_per_token": kv_token, "bandwidth_gbs": statistics.median(gbs),
        "bandwidth_gbs_range": [min(gbs), max(gbs)], "batches": rows, "batch1_profile": profile,
        "row_buckets": list(model.row_buckets), "executables_per_step": 2 if model.split_sampler else 1,
        # which decode attention ran: the Pallas kernel (ragged), the CPU kernels, or XLA's
        "attention": "pallas" if model.ragged else "cpu kernels" if model.kernels else "xla",
    }


def step_profile(model: JaxModel, slots: Slots, repeats: int = PROFILE_REPEATS) -> dict:
    """Where batch 1's step time goes, best of `repeats`: the step (one executable: embed, every
    layer, head and sampling) read before the next is dispatched, and 8 steps with the host one
    behind, as the engine runs them; the gap between the two is host time the lag hides. Both
    read the weights once a step (`bytes`). Then the host's own part of a step: `dispatch` until
    it returns (the inputs built and the executable enqueued; on this project's 2-vCPU CPU host
    ~1.2 ms for 30 layers, most of it JAX's per-argument and per-output work), and `collect` of
    a step already finished (the samples fetched and unpacked). Where the sampler is split off
    (JaxModel `split_sampler`, an accelerator's default), the steps above take its greedy variant
    (the rows are greedy), and one more line reads the step with the full one (`greedy_variant`
    off): what the greedy variant saves a step."""
    try:
        read = min(slots.step(1) for _ in range(repeats))
        behind = min(slots.pipelined(1, PROFILE_LAGGED) for _ in range(repeats))
        weights = weight_bytes(model)
        dispatch, collect = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            model.dispatch(slots._inputs(1))
            dispatch.append(time.perf_counter() - start)
            time.sleep(2 * read + 1e-3)  # the step done on the device: collect measures the host alone
            start = time.perf_counter()
            model.collect()
            collect.append(time.perf_counter() - start)
        profile = {"step, read at once": {"s": read, "bytes": weights}, "step, host one behind": {"s": behind, "bytes": weights},
                   "host: dispatch": {"s": min(dispatch)}, "host: collect a finished step": {"s": min(collect)}}
        if model.split_sampler:
            model.greedy_variant = False
            try:
                profile["step, read at once, full sampler"] = {"s": min(slots.step(1) for _ in range(repeats)), "bytes": weights}
            finally:
                model.greedy_variant = True
        return profile
    except Exception as error:  # a diagnostic must not cost the measurements
        return {"error": f"{type(error).__name__}: {error}"}


def sampling_profile(vocab: int, batches: list[int], repeats: int = PROFILE_REPEATS) -> dict:
    """What choosing the next token costs on this device, apart from the layers: each piece
    jitted alone on random logits [B, vocab], every row greedy and asking for no alternatives
    (the batch-1 benchmark's case), best of `repeats` calls each read back (so a piece's time
    includes one dispatch and one wait). The pieces: the full sampler, `sample` + `top_logprobs`
    (what the one-executable step and the split step's full variant run for every row; on an
    accelerator every piece computed, then selected: no conditional; engine/jax_backend/sampling.py);
    `sampling.greedy`, what a step with the sampler split off runs for greedy rows (the first
    allowed max and its logprob); and the costly parts of the rest, each alone: lax.top_k at
    MAX_TOP_LOGPROBS (XLA:GPU's own top-k kernel takes k <= 16 only, so this may be a sort of the
    vocabulary), the same top-k in two stages (`sampling.two_stage_top_k`, what the accelerator's
    top_logprobs runs instead), one threshold search (`sampling._searched_floor`, 8 reduction
    passes: a top_k cut on the accelerator; a top_p cut is another) and, to set it against the
    search, one exact select (the CPU's, beyond its candidate cap: three scatter-add passes)."""
    try:
        rows = []
        for b in batches:
            logits = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (b, vocab), jnp.float32)  # [B, V]
            params = sampling.SlotSampling(
                temperature=jnp.zeros(b, jnp.float32), top_k=jnp.zeros(b, jnp.int32), top_p=jnp.ones(b, jnp.float32),
                min_p=jnp.zeros(b, jnp.float32), seed=jnp.zeros((b, 2), jnp.uint32),
            )
            positions, mask, masked = jnp.zeros(b, jnp.int32), jnp.zeros((b, vocab), bool), jnp.zeros(b, bool)
            wanted = jnp.zeros(b, jnp.int32)
            pieces = {
                "the full sampler (sample + top_logprobs)": lambda x: (
                    sampling.sample(x, params, positions, mask, masked), sampling.top_logprobs(x, wanted)),
                "sampling.greedy (the split step's greedy variant)": lambda x: sampling.greedy(x, mask, masked),
                f"lax.top_k, k = {MAX_TOP_LOGPROBS}": lambda x: jax.lax.top_k(x, min(MAX_TOP_LOGPROBS, vocab)),
                f"sampling.two_stage_top_k (chunks of {sampling.TOP_K_CHUNK:,}), k = {MAX_TOP_LOGPROBS}": lambda x: (
                    sampling.two_stage_top_k(x, min(MAX_TOP_LOGPROBS, vocab))),
                "one threshold search (top_k 50)": lambda x: sampling._searched_floor(
                    sampling._sortable(x), None, jnp.full((b,), 50, jnp.int32)),
                "one exact select (the CPU's, beyond the cap)": lambda x: sampling._exact_floor(
                    sampling._sortable(x), None, jnp.full((b,), 50.0, jnp.float32), skip=False),
            }
            times = {}
            for name, piece in pieces.items():
                fn = jax.jit(piece)
                jax.block_until_ready(fn(logits))  # compiled and run once, untimed
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(logits))
                    best = min(best, time.perf_counter() - start)
                times[name] = best
            rows.append({"batch": b, "vocab": vocab, "s": times})
        return {"platform": jax.default_backend(), "rows": rows}
    except Exception as error:  # a diagnostic must not cost the measurements
        return {"error": f"{type(error).__name__}: {error}"}


def _nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def _prefill_speed(plan: Plan, shape, weights) -> dict:
    lengths = plan.prefill_lengths
    context = max(lengths) + 16
    model, _ = random_model(  # chunk shapes from the shortest length up to the serving default (512)
        shape, plan.dtype, weights, max_batch_size=1, max_context_length=context, min_attend=context,
        min_bucket=min(MAX_CHUNK, *lengths), max_chunk=min(MAX_CHUNK, max(lengths)),
    )
    warm_s, _ = _timed(model.warm_up)
    compiled = model.compilations()
    setup = SlotSetup(SamplingParams(temperature=0.0, seed=0), frozenset())
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        best = float("inf")
        for repeat in range(plan.prefill_repeats + 1):  # the first is untimed
            prompt = rng.integers(3, model.info.vocab_size, n).tolist()
            model.set_pages(0, range(1, 1 + -(-n // model.kv.page_size)))  # the pool's first pages, in order
            seconds, _ = _timed(lambda: model.prefill(0, prompt, setup, False))
            model.release(0)
            if repeat:
                best = min(best, seconds)
        rows.append({"tokens": n, "s": best, "tok_s": n / best})
    return {
        "context": context, "chunk_buckets": list(model.buckets), "warm_up_s": warm_s, "compilations_at_warm_up": compiled,
        "compilations_after_warm_up": model.compilations() - compiled, "lengths": rows,
    }


# -- quantized weights (--weights fp8 / int8: engine.jax_backend.channel_quant) --------------------


def weights_speed(plan: Plan) -> dict:
    """The first speed shape's decode at batch 1 and the largest batch (or the plan's
    weights_batches) with each of the plan's quantized formats, made from random weights in the plan's dtype on the device: each row against
    its own HBM floor (the quantized bytes a step reads); the dtype's own figures are speed-0's."""
    shape = plan.speed_shapes[0]
    cfg = model_config(shape)
    base = random_weights(cfg, plan.dtype)
    bandwidth = Bandwidth(plan.bandwidth_gib)
    timed = dataclasses.replace(plan, batches=plan.weights_batches or tuple(sorted({1, max(plan.batches)})))
    formats = {}
    for fmt in plan.weights:
        quantize_s, weights = _timed(lambda: channel_quant.quantize_weights(base, fmt, plan.dtype))  # noqa: B023
        formats[fmt] = {"quantize_s": quantize_s, "decode": _decode_speed(timed, shape, weights, bandwidth, warm_up=False)}
        del weights
        gc.collect()
    return {"shape": shape.name, "dtype": plan.dtype, "batches": list(timed.batches), "formats": formats}


# -- speculative decoding's verify step (issue 45) ---------------------------------------------------

SPECULATIVE_LOOP = 8  # plain steps in each round's pipelined loop


def speculative(plan: Plan) -> dict:
    """benchmarks/verify_step.py on random weights of the last speed shape (the issue's 1B shape
    on the GPU) in the plan's dtype, at each of `speculative_batches`: a plain step, a pipelined
    loop's time a token and a verify step of each guess bucket, interleaved; at batch 1 the
    default model's recorded answers replayed at these costs."""
    from benchmarks.verify_step import context_for, measure, random_shape_model

    shape, batches = plan.speed_shapes[-1], plan.speculative_batches
    context = context_for(plan.speculative_rounds, SPECULATIVE_LOOP, plan.speculative_guesses)
    model = random_shape_model(shape, plan.dtype, max(batches), context, plan.speculative_guesses)
    rows = []
    for batch in batches:
        row = measure(model, batch, plan.speculative_rounds, SPECULATIVE_LOOP, project=batch == 1)
        del row["times"]
        rows.append(row)
    return {"shape": shape.name, "dtype": plan.dtype, "context": context, "guesses": plan.speculative_guesses, "batches": rows}


# -- the served model of the stack measurement --------------------------------------------------


def stack_model(plan: Plan, directory: str) -> dict:
    from dataclasses import replace
    from tokenizer_svc.tokenizer import TextTokenizer

    vocab = TextTokenizer.from_dir(STACK_TOKENIZER).vocab_size
    shape = replace(plan.stack_shape, vocab=vocab, name=f"{plan.stack_shape.name}, vocab {vocab}")
    seconds, path = _timed(lambda: write_random_checkpoint(Path(directory), shape, STACK_TOKENIZER))
    return {"dir": str(path), "shape": shape.name, "parameters": shape.parameters(), "write_s": seconds,
            "bytes": (Path(path) / "model.safetensors").stat().st_size}


PHASES = {"env": env, "golden": golden, "real-model": real_model, "weights": weights_speed, "speculative": speculative,
          "stack-model": stack_model}


def main(argv: list[str]) -> int:
    phase, plan_path, out_path, *rest = argv
    plan = Plan.from_json(Path(plan_path).read_text())
    started = time.perf_counter()
    try:
        if phase.startswith("speed-"):
            result = speed(plan, int(phase.removeprefix("speed-")))
        else:
            result = PHASES[phase](plan, *rest)
        code = 0
    except BaseException as error:  # the report shows it; the next phase still runs
        result, code = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}, 1
    result["phase_s"] = time.perf_counter() - started
    Path(out_path).write_text(json.dumps(result, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
