"""benchmarks/transport.py at a tiny size: it runs, counts every token, and fails loudly on a
short stream. No speed is asserted (the machine is shared and noisy)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from benchmarks import cpu_use, transport

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
    clock.arrived(3, ("LENGTH", 6))
    assert clock.tokens == 6 and len(clock.gaps) == 5 and clock.gaps.count(0.0) >= 3
    assert clock.check(0, 6) is clock
    with pytest.raises(transport.StreamFailed):
        clock.check(0, 7)
    with pytest.raises(transport.StreamFailed):
        clock.arrived(1)  # nothing may follow Finished


def test_engine_and_decode_paths_count_every_token(tmp_path):
    counts = [5, 5]  # 2 streams x 5 tokens, step 0
    context = 64
    engine = transport.measure_engine(transport.scripted_model(TINY, 0.0, 4, context), counts, timeout_s=20)
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
        decode = pool.measure("decode", server.target, counts, procs=1, timeout_s=20)
        use = meter.stop()
        assert decode.tokens == 10 and decode.wall_s > 0 and not math.isnan(decode.itl_p50_s)
        assert set(use.seconds) == set(groups) and all(s >= 0 for s in use.seconds.values())
        assert 0.0 <= use.steal_share <= 1.0
        with pytest.raises(transport.StreamFailed, match="INVALID_ARGUMENT"):  # a failed stream fails the run
            pool.measure("decode", server.target, [70], procs=1, timeout_s=20)  # past the context of 64
    finally:
        pool.close()
        server.stop()
    assert server.process.returncode is not None


def test_decode_py_steps_run_on_the_in_process_model_and_leave_its_slots_free():
    """--real-model's engine-only figure (benchmarks/decode.py's decode steps, timed on the model the
    engine path uses) is a rate, and it leaves the model's slots free: the engine path then runs
    on the same model (a slot still held would refuse its prompt: "slot 0 is in use")."""
    from engine.jax_backend.jax_model import JaxModel

    model = JaxModel.load(TINY, max_batch_size=2, max_context_length=128, weights="float32")
    assert transport.measure_steps(model, batch=2, steps=2, prompt_len=8) > 0
    engine = transport.measure_engine(model, [3, 3], timeout_s=60)
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
        deadline = time.monotonic() + 20
        while len(cpu_use.process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        tree = cpu_use.process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        child = tree[1]
        meter = cpu_use.CpuMeter({"child": lambda: [child]})
        meter.start()
        while cpu_use.process_cpu_s(child) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.01)
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
        time.sleep(1.0)
        m = grpc_floor.measure(server.pid, port, 4)
        one = grpc_floor.measure(server.pid, port, 1)  # fewer streams than client processes
    finally:
        server.kill()
    assert m["tokens"] == 4 * 10 and m["per_message"] == 5.0 and m["tok_s"] > 0
    assert m["server_us"] >= 0 and m["clients_us"] >= 0
    assert one["tokens"] == 10 and one["per_message"] == 5.0
