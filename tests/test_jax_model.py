"""JaxModel through the engine.core.model.Model interface, on tiny-llama at 4 slots (row buckets 1, 2,
4): batch invariance across row buckets, seeds, masks, padding ids never sampled, no compilation
after warm-up, and a cache that is updated in place rather than copied per step; each with decode
attention in JAX and in the CPU kernel. The models run decode-server's configuration
(engine.core.model_options.SERVED: a page pool of a whole context per slot, the served smallest
chunk) but where a test says otherwise. The module fixture's two models:
- the CPU kernel's: support.tiny_served's configuration (a context of 64: prompt buckets 8 to 64,
  one attend shape, the kernel reading each row's live keys), which other files warm up too, so
  its warm-up is read back from the run's compilation cache wherever one of them ran first;
- attention in JAX: a context of 32 with the smallest prompt bucket and attend length 16, so that
  it has two prompt buckets and two attend buckets to cross.

Batch invariance (greedy ids equal to transformers' goldens whatever the row bucket and the
company) is a claim about XLA:CPU in float32: the models here are pinned to float32, and the module
skips, saying why, on another backend (tests/support/backend.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.core.model_options import SERVED
from engine.jax_backend import backend_profile, steps, transformer
from engine.jax_backend.weights import load_checkpoint
from engine.jax_backend.jax_model import JaxModel, length_buckets, prompt_pieces
from engine.core.model import DecodeInput, ModelUsageError, SlotSetup
from engine.core.request import SamplingParams
from support import prerequisites, tiny_served
from support.compile_watch import compile_events
from support.lowering import host_syncs
from support.pages import own_pages

ASSETS = Path(__file__).parent / "assets"
LLAMA = ASSETS / "tiny-llama"
GOLDEN = json.loads((LLAMA / "golden.json").read_text())["cases"]
GREEDY = SamplingParams(temperature=0.0, seed=0)
pytestmark = pytest.mark.usefixtures("cpu_backend")


@pytest.fixture(scope="module", params=[False, True], ids=["jax-attention", "kernel-attention"])
def model(request) -> JaxModel:
    """Every test below runs with decode attention in JAX and with the CPU kernel."""
    if request.param:
        prerequisites.cpu_kernels()  # skips, or fails under TOKENWIRE_TEST_NO_SKIP, without them
        m = tiny_served.load()
    else:  # min_bucket 16 and min_attend 16: two buckets of each below the context (module docstring)
        m = JaxModel.load(LLAMA, max_batch_size=4, max_context_length=32, min_bucket=16, min_attend=16, kernels=False,
                          dtype="float32")
    assert m.kernels == request.param
    m.warm_up()
    return m


@dataclass(frozen=True)
class Plan:
    """One request as a scheduler would run it: prefilled at step `start` into `slot`, idle for
    `idle` steps, then decoded each step until it has `n_tokens`."""

    slot: int
    prompt: tuple[int, ...]
    n_tokens: int
    sampling: SamplingParams = GREEDY
    start: int = 0
    idle: int = 0
    masked_ids: frozenset[int] = frozenset()


def drive(model: JaxModel, plans: list[Plan]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in plans]
    position: dict[int, int] = {}
    released: set[int] = set()
    step = 0
    last = max(p.start + p.idle + p.n_tokens for p in plans)  # every plan has ended by this step
    while len(released) < len(plans):
        assert step <= last, f"not every request ended by step {last}: {out}"
        for i, p in enumerate(plans):
            if p.start == step:
                setup = SlotSetup(p.sampling, p.masked_ids)
                own_pages(model, p.slot)
                out[i].append(model.prefill(p.slot, p.prompt, setup, masked=bool(p.masked_ids)).token_id)
                position[i] = len(p.prompt)
        ready = [
            i for i, p in enumerate(plans) if i in position and step >= p.start + p.idle and len(out[i]) < p.n_tokens
        ]
        inputs = [DecodeInput(plans[i].slot, out[i][-1], position[i], bool(plans[i].masked_ids)) for i in ready]
        for i, sample in zip(ready, model.decode(inputs) if inputs else [], strict=True):
            out[i].append(sample.token_id)
            position[i] += 1
        for i, p in enumerate(plans):
            if i in position and i not in released and len(out[i]) == p.n_tokens:
                model.release(p.slot)
                released.add(i)
        step += 1
    return out


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(3, 512, n))


def _company(k: int, busy_slots: list[int]) -> list[Plan]:
    """k other requests of different lengths and kinds (sampled, cut, masked), staggered."""
    kinds = [
        dict(prompt=_prompt(1, 17), n_tokens=9, sampling=SamplingParams(temperature=0.9, top_p=0.8, seed=5)),
        dict(prompt=_prompt(2, 3), n_tokens=20, sampling=SamplingParams(temperature=1.3, top_k=7, seed=6), start=2),
        dict(prompt=_prompt(3, 9), n_tokens=5, masked_ids=frozenset({1, 2, 3}), start=1, idle=2),
    ]
    return [Plan(slot=s, **kind) for s, kind in zip(busy_slots, kinds[:k])]


def test_a_compiler_option_xla_rejects_is_logged_and_dropped(monkeypatch, caplog):
    """The backend profile probes its XLA:CPU option once; a jaxlib that rejects it compiles with
    its defaults and says so at WARNING, with XLA's own message."""
    served = backend_profile.profile().compiler_options  # (probed before the option is swapped)
    monkeypatch.setattr(backend_profile, "CPU_COMPILER_OPTIONS", {"xla_tokenwire_no_such_flag": "1"})
    fresh = dataclasses.replace(backend_profile.CPU)  # (the process's profile keeps its probe)
    with caplog.at_level("WARNING", logger="engine.jax_backend.backend_profile"):
        assert fresh.compiler_options is None
    [record] = [r for r in caplog.records if "rejected the compiler options" in r.getMessage()]
    assert record.levelname == "WARNING" and "xla_tokenwire_no_such_flag" in record.getMessage()
    assert backend_profile.profile().compiler_options is served == {"xla_cpu_experimental_ynn_fusion_type": ""}


def test_buckets_are_powers_of_two_then_the_context():
    assert length_buckets(64) == (16, 32, 64)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(64, 64) == (64,)
    assert length_buckets(32, 128) == (32,)
    assert length_buckets(8, 1) == (1, 2, 4, 8) and length_buckets(6, 1) == (1, 2, 4, 6)


@pytest.mark.parametrize("context", [2048, 40])
def test_prompt_pieces_cover_the_prompt_in_compiled_sizes_with_no_more_rows_than_a_greedy_split(context):
    buckets = length_buckets(min(512, context), 8)
    for start, end in [(0, n) for n in range(1, context)] + [(5, 33), (16, 39), (8, 9)]:
        if end > context - 1:
            continue
        pieces = prompt_pieces(start, end, buckets, context)
        assert pieces[0][1] - pieces[0][0] >= 1
        assert all(size in buckets and 0 <= lo and lo + size <= context and lo < hi <= lo + size
                   for lo, hi, size in pieces), pieces
        assert [hi for _, hi, _ in pieces][-1] == end
        # each piece's real tokens start where the previous ended (or earlier, near the context's end)
        ends = [start] + [hi for _, hi, _ in pieces[:-1]]
        assert all(lo <= prev and hi > prev for (lo, hi, _), prev in zip(pieces, ends)), pieces
        greedy, rest = 0, end - start  # largest bucket filled, then the smallest that holds the rest
        while rest > 0:
            size = max([b for b in buckets if b <= rest], default=buckets[0])
            greedy, rest = greedy + size, rest - size
        assert sum(size for _, _, size in pieces) <= greedy, (start, end, pieces)
    if context == 2048:  # one call where it costs no more rows; the greedy split where it would
        assert [p[2] for p in prompt_pieces(0, 10, buckets, context)] == [16]
        assert [p[2] for p in prompt_pieces(0, 20, buckets, context)] == [16, 8]
        assert [p[2] for p in prompt_pieces(0, 511, buckets, context)] == [512]
        assert [p[2] for p in prompt_pieces(0, 600, buckets, context)] == [512, 64, 16, 8]


def test_bucket_ladders(model):
    smallest = backend_profile.profile().step_tokens  # the served smallest chunk (8 on the CPU)
    if model.kernels:  # the served ladder up to the context; one attend shape: the kernel reads the live length itself
        assert (model.buckets, model.attend_buckets, model.row_buckets) == (length_buckets(64, smallest), (64,), (1, 2, 4))
    else:
        assert (model.buckets, model.attend_buckets, model.row_buckets) == ((16, 32), (16, 32), (1, 2, 4))
    default = JaxModel(model.config, model._weights, model.info, jnp.float32, kernels=False)
    context = model.info.max_context_length  # attend buckets from 128: the context alone, below it
    assert (default.buckets, default.attend_buckets) == (length_buckets(context, smallest), (context,))


def test_info_defaults(model):
    assert model.info.model_id == "tiny-llama"
    assert (model.info.vocab_size, model.info.max_batch_size, model.info.max_context_length) == (512, 4, 64 if model.kernels else 32)
    assert model.info.eos_token_ids == frozenset({0, 2})
    served = JaxModel.load(LLAMA, max_batch_size=1, model_id="x")
    assert served.info.max_context_length == 256  # config's 256
    # what decode-server serves: a pool of a whole context of 16-position pages per slot (and the
    # null page), the smallest chunk of the backend's step budget, weights auto
    assert (served.kv.page_size, served.kv.num_pages) == (16, 256 // 16 + 1) and SERVED.kv_cache_tokens == 0
    assert served.buckets[0] == (8 if backend_profile.profile().step_tokens == 8 else 16)
    assert served.int8 is False  # weights auto: tiny-llama brings no model.gguf


def test_decode_server_and_jax_model_load_default_to_the_same_options(monkeypatch):
    """One source of defaults: decode-server with no flags builds SERVED's options, and
    JaxModel.load's default options are that very object."""
    from services.cli import build_parser
    from services.config import DecodeServerConfig

    for name in [n for n in __import__("os").environ if n.startswith("TOKENWIRE_")] + ["CXX"]:
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["decode-server", "--model", "m"])
    assert DecodeServerConfig.from_args(args).model_options == SERVED
    assert inspect.signature(JaxModel.load).parameters["options"].default is SERVED
    assert inspect.signature(JaxModel).parameters["options"].default is SERVED


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
        ({"max_context_length": 0}, r"max_context_length must be in 1\.\.256 .*got 0"),
        ({"max_context_length": 257}, r"max_context_length must be in 1\.\.256 .*got 257"),
    ],
)
def test_a_size_the_model_cannot_hold_is_a_clear_error(kw, message):
    with pytest.raises(ValueError, match=message):
        JaxModel.load(LLAMA, **kw)


@pytest.mark.parametrize(
    "slot, busy",
    [(0, []), (3, []), (1, [0]), (0, [1, 2, 3]), (2, [3, 0, 1])],
    ids=["rows1", "rows4-alone", "rows2", "rows4-shrinking-to-1", "rows4-idle"],
)
def test_greedy_tokens_do_not_depend_on_the_rest_of_the_batch(model, slot, busy):
    """Golden ids whatever slot the request is in (so whatever row bucket its steps run in: alone
    in slot 3 it runs at 4 rows; in slot 0 with company in 1-3 its steps shrink from 4 rows to 1
    as the company finishes) and whatever else is in flight, including a request that sits
    prefilled (idle) while others decode, and prefills crossing bucket 16."""
    case = GOLDEN[0]
    others = len(busy)
    mine = Plan(slot, tuple(case["prompt_ids"]), 16, start=others % 2, idle=1 if others else 0)
    out = drive(model, [mine, *_company(others, busy)])
    assert out[0] == case["greedy_ids"]


def test_a_seeded_sampled_request_is_reproducible_in_any_company(model):
    mine = Plan(0, _prompt(7, 6), 14, SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02, seed=1234))
    alone = drive(model, [mine])[0]
    crowded = drive(model, [Plan(2, mine.prompt, 14, mine.sampling, start=1), *_company(3, [0, 1, 3])])[0]
    assert alone == crowded
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.02, seed=99)
    assert drive(model, [Plan(0, mine.prompt, 14, other_seed)])[0] != alone


def test_masked_ids_are_not_sampled_while_masked(model):
    case = GOLDEN[2]
    banned = frozenset(case["greedy_ids"][:4])
    out = drive(model, [Plan(1, tuple(case["prompt_ids"]), 12, masked_ids=banned)])[0]
    assert not banned & set(out)
    assert out[0] != case["greedy_ids"][0]


def test_nothing_compiles_after_warm_up(model):
    before = model.compilations()
    rows, attend, prompts = len(model.row_buckets), len(model.attend_buckets), len(model.buckets)
    along = len(model.fused_chunk_sizes)  # decode steps with a chunk along, one per compiled chunk size
    assert along == (1 if model.kernels else 0)  # (on by default with the CPU kernels only)
    # per (rows, attend): the layers alone (a step that samples, or waits for its rows), the greedy
    # step as one executable (unless the sampler is split off) and the layers with each chunk along
    steps = rows * attend * (1 + (0 if model.split_sampler else 1) + along)
    samplers = 2 * rows  # per row bucket the sampler, greedy and full: every sampling call goes through one
    prompt = 3 * prompts  # per prompt bucket: embed, a prefill layer, its last position as the sampler's rows
    small = 1 + rows  # write_mask; write_masks: a step's constrained rows' mask rows, one call per row bucket
    packed = model.packed_prefill_sizes  # a packed prefill: one layer, and the last positions per row bucket
    every = tuple(t for t in model.buckets if t <= 256)  # the CPU packs every prompt bucket, an accelerator the largest
    assert packed == (every if jax.default_backend() == "cpu" else every[-1:])
    assert model.packed_prefill_rows == tuple(r for r in model.row_buckets if r >= 2)
    assert before == steps + samplers + prompt + small + len(packed) * (1 + len(model.packed_prefill_rows))
    with compile_events() as compiles:
        drive(model, [Plan(0, _prompt(8, 20), 11), *_company(3, [1, 2, 3])])  # prefill bucket 32; attend 16 -> 32 in JAX
        drive(model, [Plan(3, _prompt(9, 1), 30, SamplingParams(temperature=0.7, top_k=3, seed=3))])  # rows 4
        drive(model, [Plan(1, _prompt(9, 2), 20), Plan(0, _prompt(9, 3), 4)])  # rows 2; attend 16 -> 32 in JAX
    assert model.compilations() == before
    assert compiles == []


def test_decode_donates_the_cache_and_never_copies_it(model):
    """Structural: the old buffers are consumed, the compiled step (alone, and with a prompt chunk
    along) aliases the cache input to its output, and no instruction copies a whole-cache-shaped
    array."""
    old = model.cache
    drive(model, [Plan(0, _prompt(10, 4), 3)])
    assert all(buffer.is_deleted() for buffer in old.k + old.v)
    n_buffers = 2 * model.config.n_layers  # k and v of every layer: the step is one call
    cache_shape = "f32[%s]" % ",".join(map(str, model.cache.k[0].shape))  # the fixture pins float32
    along = [False, True] if model.fused_chunk_sizes else [False]  # and the step with a chunk along
    for rows, attend, chunk in [(r, a, c) for r in model.row_buckets for a in model.attend_buckets for c in along]:
        hlo = model.decode_hlo(rows, attend, chunk)
        header = hlo.splitlines()[0]
        inputs = re.findall(r"\w+\[[\d,]*\]", header.split("entry_computation_layout={(")[1].split(")->")[0])
        cache_inputs = {i for i, shape in enumerate(inputs) if shape == cache_shape}
        aliased = {int(i) for i in re.findall(r"\((\d+), \{\}, (?:may|must)-alias\)", header)}
        assert len(cache_inputs) == n_buffers and cache_inputs <= aliased, (cache_inputs, aliased)
        assert not re.search(rf"= {re.escape(cache_shape)}\S* copy\(", hlo), "whole-cache copy in the step"


def test_a_step_writes_only_its_active_rows_at_their_positions():
    """Inactive rows (free, idle or past the live ones) must leave their slot's pages untouched,
    whatever their position says (their writes go to the null page); active rows write exactly one
    position each, in the page their table names for it."""
    ckpt = load_checkpoint(LLAMA, "float32")
    step = jax.jit(transformer.decode, static_argnames=("cfg", "attend"), donate_argnums=1)
    rng = np.random.default_rng(0)
    empty = transformer.init_cache(ckpt.config, 4, 32, jnp.float32)  # pools [K, 9, 16, D], tables [4, 2]
    tables = np.asarray(empty.tables)  # (the step donates the cache, tables included)
    before = [rng.random(empty.k[0].shape, np.float32) for _ in range(2 * ckpt.config.n_layers)]
    cache = transformer.KVCache(*(tuple(map(jnp.asarray, half)) for half in (before[::2], before[1::2])), empty.tables)
    positions, active = np.array([0, 17, 3, 31], np.int32), np.array([False, True, False, True])
    _, cache = step(ckpt.weights, cache, np.arange(4, dtype=np.int32), positions, active, cfg=ckpt.config, attend=32)
    for old, new in zip(before[::2] + before[1::2], cache.k + cache.v):
        changed = {(n, o) for _, n, o, _ in np.argwhere(old != np.asarray(new)) if n != 0}  # (page, offset)
        assert changed == {(tables[1, 1], 1), (tables[3, 1], 15)}, changed


PADDED = 576


def _padded_qwen3(tmp_path: Path) -> Path:
    """tiny-qwen3 with its embedding and head padded from 512 to 576 rows (as Qwen pads 151669
    ids to 151936); each padding head row is 50x the row of a golden greedy id."""
    d = Path(shutil.copytree(ASSETS / "tiny-qwen3", tmp_path / "padded-qwen3"))
    tensors = load_file(d / "model.safetensors")
    head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]  # [512, E]
    winners = [t for case in json.loads((d / "golden.json").read_text())["cases"] for t in case["greedy_ids"]]
    pad = np.stack([50 * head[winners[i % len(winners)]] for i in range(PADDED - 512)])
    tensors["lm_head.weight"] = np.concatenate([head, pad])
    tensors["model.embed_tokens.weight"] = np.concatenate([embed, embed[: PADDED - 512]])
    save_file(tensors, d / "model.safetensors")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, vocab_size=PADDED)))
    return d


def test_padding_ids_past_the_tokenizer_are_never_sampled(tmp_path):
    case = json.loads((ASSETS / "tiny-qwen3" / "golden.json").read_text())["cases"][0]
    prompt, first = tuple(case["prompt_ids"]), case["greedy_ids"][0]
    assert case["first_logits"][first] > 0  # so the padding row 50x its head row would win argmax
    # min_bucket 32 and min_rows 2: one prompt and one decode shape to compile; the claim is about
    # the head, whatever the chunks and rows. No warm-up: the claim is about what each step samples,
    # and the steps run compile what they use (a warm-up samples for no row; nothing compiling after
    # it is test_nothing_compiles_after_warm_up's).
    model = JaxModel.load(_padded_qwen3(tmp_path), max_batch_size=2, max_context_length=32, min_bucket=32, min_rows=2)
    assert model.info.vocab_size == PADDED and model._weights.lm_head.shape[1] == 512  # the tokenizer's ids
    greedy, sampled, cut = drive(model, [
        Plan(0, prompt, len(case["greedy_ids"])),
        Plan(1, (*prompt[:3], 530, 575), 20, SamplingParams(temperature=1.5, seed=1), masked_ids=frozenset({3, 570})),
        Plan(0, prompt, 20, SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2), start=30),
    ])
    assert greedy == case["greedy_ids"]  # the real ids' logits are untouched
    assert max(greedy + sampled + cut) < 512 and 3 not in sampled


def test_a_broken_model_contract_raises_even_under_python_O(model):
    """The checks that JAX would otherwise clamp away raise ModelUsageError (not `assert`, which
    `python -O` strips); the model's state is untouched by a refused call."""
    setup = SlotSetup(GREEDY, frozenset())
    own_pages(model, 0), own_pages(model, 1)
    first = model.prefill(0, (1, 2, 3), setup, masked=False)
    try:
        with pytest.raises(ModelUsageError, match="in use"):
            model.prefill(0, (1, 2, 3), setup, masked=False)
        with pytest.raises(ModelUsageError, match="next one"):
            model.decode([DecodeInput(0, first.token_id, 5, False)])  # the slot's next position is 3
        with pytest.raises(ModelUsageError, match="vocabulary"):
            model.decode([DecodeInput(0, model.config.vocab_size, 3, False)])
        with pytest.raises(ModelUsageError, match="vocabulary"):
            model.prefill(1, (1, model.config.vocab_size), setup, masked=False)
        assert model.decode([DecodeInput(0, first.token_id, 3, False)])[0].token_id >= 0  # still serves
    finally:
        model.release(0)
        model.release(1)


def test_a_decode_step_is_one_call_of_one_executable(model):
    """Embed, every layer, head and sampling run as one jitted call a step; nothing else is called
    (on an accelerator, `split_sampler`: the layers, then the sampler, two calls a step)."""
    jitted = {name: fn for name, fn in vars(model._steps).items() if any(fn is f for f in model._steps.jitted())}
    calls: list[str] = []

    def counting(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    prompt = _prompt(21, 5)
    own_pages(model, 0)
    first = model.prefill(0, prompt, SlotSetup(GREEDY, frozenset()), False).token_id
    try:
        for name, fn in jitted.items():
            setattr(model._steps, name, counting(name, fn))
        model.decode([DecodeInput(0, first, len(prompt), False)])
        model.decode([DecodeInput(0, None, len(prompt) + 1, False)])
    finally:
        for name, fn in jitted.items():
            setattr(model._steps, name, fn)
        model.release(0)
    assert calls == (["layers_step", "step_sampler"] * 2 if model.split_sampler else ["step", "step"])


def test_the_host_one_step_behind_gets_the_ids_of_a_step_at_a_time(model):
    """Steps dispatched before the previous one is read, feeding each slot's last sample from the
    device, give the ids of steps read one at a time with the host feeding them; a slot released
    with a step in flight and prefilled again serves its new request as if alone."""
    setup = SlotSetup(GREEDY, frozenset())
    a, b, c = _prompt(31, 6), _prompt(32, 11), _prompt(33, 4)
    alone = {p: drive(model, [Plan(1, p, 8)])[0] for p in (a, c)}
    b_alone = drive(model, [Plan(0, b, 8)])[0]
    own_pages(model, 0), own_pages(model, 1)
    ids = {0: [model.prefill(0, b, setup, False).token_id], 1: [model.prefill(1, a, setup, False).token_id]}
    length = {0: len(b), 1: len(a)}

    def dispatch(slots):
        model.dispatch([DecodeInput(s, None, length[s], False) for s in slots])
        for s in slots:
            length[s] += 1

    dispatch([0, 1])
    for _ in range(6):
        dispatch([0, 1])
        for s, sample in zip([0, 1], model.collect()):
            ids[s].append(sample.token_id)
    assert ids[1] == alone[a][:7]
    model.release(1)  # its 8th step is in flight: that sample is the engine's to discard
    own_pages(model, 1)
    ids[1] = [model.prefill(1, c, setup, False).token_id]
    length[1] = len(c)
    ids[0].append(model.collect()[0].token_id)
    assert ids[0] == b_alone
    model.release(0)
    dispatch([1])
    for _ in range(6):
        dispatch([1])
        ids[1].append(model.collect()[0].token_id)
    ids[1].append(model.collect()[0].token_id)
    model.release(1)
    assert ids[1] == alone[c]


def test_the_decode_step_lowered_for_the_gpu_waits_on_the_host_for_nothing():
    """A decode step as a GPU runs it (plain-JAX layers with the ragged Pallas attention, then the
    full sampler), lowered for CUDA from here: no conditional and no while loop for XLA:GPU to
    read a predicate of on the host. (On the CPU, sampling keeps its lax.conds: the predicate is
    in host memory there, so they cost no sync and skip work; engine.jax_backend.sampling.)"""
    # kernels off: a GPU's layers are plain JAX (the CPU kernels' custom calls do not lower for CUDA)
    model = JaxModel.load(LLAMA, max_batch_size=4, max_context_length=32, kernels=False, dtype="float32")
    layers = jax.jit(
        functools.partial(steps.decode_layers, kernels=False, ragged=True), static_argnames=("cfg", "attend")
    )
    sampler = jax.jit(steps.step_sample, static_argnames=("cfg", "greedy_only"))
    w = model._weights
    for rows in model.row_buckets:
        ints, floats = model._sampling.pack([], rows, model._slots.tables)
        x = jax.ShapeDtypeStruct((rows, 1, model.config.hidden_size), jnp.float32)  # [R, 1, E]
        lowered = [
            layers.trace(w.embed, model._decode_weights, model.cache.k, model.cache.v, model._last, ints,
                         cfg=model.config, attend=model.info.max_context_length),
            sampler.trace(x, w.final_norm, w.lm_head, model._mask, model._last, ints, floats, np.arange(rows, dtype=np.int32),
                          cfg=model.config),
        ]
        modules = [t.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo") for t in lowered]
        assert [host_syncs(m) for m in modules] == [[], []], rows
        assert "triton" in str(modules[0]).lower() or "pallas" in str(modules[0]).lower()  # the ragged kernel is in it
