"""benchmarks/transport.py at a tiny size: it runs, counts every token, and fails loudly on a
short stream. No speed is asserted (the machine is shared and noisy)."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest

from benchmarks import cpu_use, transport
from support.waiting import until_sync


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"


def test_token_counts_are_fixed_or_spread_deterministically():
    assert transport.token_counts("5", 3) == [5, 5, 5]
    assert transport.token_counts("300-400", 3) == [300, 350, 400]
    assert transport.token_counts("300-400", 1) == [350]
    with pytest.raises(ValueError):
        transport.token_counts("400-300", 2)


def test_itl_counts_a_message_once_and_its_other_tokens_as_zero():
    clock = transport.StreamClock()
    clock.arrived(2)  # the first message: its first token's gap is the time to first token, left out
    clock.arrived(1)
    clock.arrived(3, ("LENGTH", 6, 4))
    assert clock.tokens == 6 and len(clock.gaps) == 5 and clock.gaps.count(0.0) >= 3
    assert clock.check(0, 6, prompt_tokens=4) is clock
    with pytest.raises(transport.StreamFailed):
        clock.check(0, 7, prompt_tokens=4)
    with pytest.raises(transport.StreamFailed, match="prompt_tokens"):  # another prompt than the stream's
        clock.check(0, 6, prompt_tokens=3)
    with pytest.raises(transport.StreamFailed):
        clock.arrived(1)  # nothing may follow Finished


def test_every_path_sends_the_ids_the_text_service_makes_of_the_text_path_prompt(tmp_path):
    """The prompts are the text service's own encoding of each stream's text, distinct per stream;
    a text server in front of a decode server counts the same prompt tokens for the text as the
    id paths send (the clock checks each Finished's prompt_tokens against len(ids))."""
    from tokenizer_svc.tokenizer import TextTokenizer

    prompts = transport.prompts(TINY, 3)
    tokenizer = TextTokenizer.from_dir(TINY)
    assert [p.ids for p in prompts] == [tuple(tokenizer.encode(p.text)) for p in prompts]
    assert len({p.text for p in prompts}) == 3 and all(p.ids for p in prompts)
    decoder = transport.decode_server(TINY, 0.0, max_batch_size=4, max_queue_size=3, context=64, log_dir=tmp_path)
    text = None
    pool = transport.ClientPool(1)
    try:
        text = transport.text_server(TINY, decoder.target, tmp_path)
        counts = [2, 3, 4]
        for path, target in (("decode", decoder.target), ("text", text.target)):
            m = pool.measure(path, target, counts, prompts, procs=1, timeout_s=20)  # checks prompt_tokens
            assert m.tokens == 9
        with pytest.raises(transport.StreamFailed, match="prompt_tokens"):  # the wrong ids are caught
            wrong = [transport.Prompt(p.text, p.ids + (p.ids[0],)) for p in prompts]
            pool.measure("text", text.target, counts, wrong, procs=1, timeout_s=20)
    finally:
        pool.close()
        if text is not None:
            text.stop()
        decoder.stop()


def test_engine_and_decode_paths_count_every_token(tmp_path):
    counts = [5, 5]  # 2 streams x 5 tokens, step 0
    context = 64
    prompts = transport.prompts(TINY, 2)
    engine = transport.measure_engine(transport.scripted_model(TINY, 0.0, 4, context), counts, prompts, timeout_s=20)
    assert engine.tokens == 10 and engine.wall_s > 0 and not math.isnan(engine.itl_p99_s)
    assert 0 < engine.ttft_p50_s <= engine.ttft_p99_s < engine.wall_s  # each stream's first token, after it was sent

    server = transport.decode_server(TINY, 0.0, max_batch_size=4, max_queue_size=2, context=context, log_dir=tmp_path)
    pool = transport.ClientPool(1)
    try:
        groups = transport.cpu_groups("decode", server, [], pool)
        assert set(groups) == {"decode service", "engine process", "clients"}
        assert groups["engine process"]()  # the decode server's child, the engine process, is counted
        meter = cpu_use.CpuMeter(groups)
        meter.start()
        decode = pool.measure("decode", server.target, counts, prompts, procs=1, timeout_s=20)
        use = meter.stop()
        assert decode.tokens == 10 and decode.wall_s > 0 and not math.isnan(decode.itl_p50_s)
        assert set(use.seconds) == set(groups) and all(s >= 0 for s in use.seconds.values())
        assert 0.0 <= use.steal_share <= 1.0
        with pytest.raises(transport.StreamFailed, match="INVALID_ARGUMENT"):  # a failed stream fails the run
            pool.measure("decode", server.target, [70], prompts, procs=1, timeout_s=20)  # past the context of 64
    finally:
        pool.close()
        server.stop()
    assert server.process.returncode is not None


def test_decode_py_steps_run_on_the_in_process_model_and_leave_its_slots_free():
    """--real-model's engine-only figure (benchmarks/decode.py's decode steps, timed on the model the
    engine path uses) is a rate, and it leaves the model's slots free: the engine path then runs
    on the same model (a slot still held would refuse its prompt: "slot 0 is in use")."""
    from support import tiny_served

    # support.tiny_served's float32 model, which test_int8 warms up: what these steps and the
    # engine path run is read back from the run's compilation cache, not compiled
    model = tiny_served.load(weights="float32")
    assert transport.measure_steps(model, batch=2, steps=2, prompt_len=8) > 0
    engine = transport.measure_engine(model, [3, 3], transport.prompts(TINY, 2), timeout_s=60)
    assert engine.tokens == 6


def test_cpu_use_counts_a_process_and_its_children():
    """CPU seconds from /proc: a child that spins ~0.3 s of CPU is in its parent's tree and
    shows at least most of that; a meter over it counts CPU for it."""
    import subprocess
    import sys

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"],
                              stdin=subprocess.PIPE)
    try:
        until_sync(lambda: len(cpu_use.process_tree(parent.pid)) >= 2, "the child started", limit_s=20, interval_s=0.01)
        tree = cpu_use.process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        child = tree[1]
        meter = cpu_use.CpuMeter({"child": lambda: [child]})
        meter.start()
        until_sync(lambda: cpu_use.process_cpu_s(child) >= 0.25, "the child spun", limit_s=20, interval_s=0.01)
        use = meter.stop()
        assert cpu_use.process_cpu_s(child) >= 0.25
        assert use.seconds["child"] > 0.0 and 0.0 <= use.steal_share <= 1.0
    finally:
        parent.communicate(b"\n", timeout=20)
    assert cpu_use.process_cpu_s(child) == 0.0  # gone: nothing to count


def test_grpc_floor_streams_every_id_and_prices_both_ends():
    """benchmarks/grpc_floor.py's bare server and clients, tiny: every stream gets all its ids,
    in messages of the asked size, and both ends' CPU is read (a tick of /proc's clock is 10 ms,
    more than this run costs, so no figure is asserted)."""
    from benchmarks import grpc_floor

    ctx = grpc_floor.multiprocessing.get_context("spawn")
    port = grpc_floor._free_port()
    server = ctx.Process(target=grpc_floor._serve, args=(port, 10, 5), daemon=True)
    server.start()
    try:
        until_sync(lambda: listening(port), "the bare server listens", interval_s=0.02)
        m = grpc_floor.measure(server.pid, port, 4)
        one = grpc_floor.measure(server.pid, port, 1)  # fewer streams than client processes
    finally:
        server.kill()
    assert m["tokens"] == 4 * 10 and m["per_message"] == 5.0 and m["tok_s"] > 0
    assert m["server_us"] >= 0 and m["clients_us"] >= 0
    assert one["tokens"] == 10 and one["per_message"] == 5.0
