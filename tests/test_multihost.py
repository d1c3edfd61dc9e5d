"""One model over two processes (engine.jax_backend.multihost), started by the test as two real
`tokenwire decode-server` processes on loopback: one CPU device each, `--tensor-parallel 2`,
process 0 coordinating and serving, process 1 following and serving health only.

- Through process 0's gRPC, greedy decoding gives the ids one process gives (the golden ids
  of tests/assets/tiny-llama, which one process matches: tests/test_transformer_parity.py).
- Killing process 1 takes process 0 down: it logs that its engine died, its readiness goes
  NOT_SERVING, then it exits 1. How soon is the heartbeat timeout's business (multihost.wait_s
  states it); the test's waits are bounded well past it, so only a process that never goes down
  fails them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from engine.jax_backend import multihost
from protos.decode.v1 import decode_pb2
from services.client import DecodeClient
from services.service_names import DECODER_SERVICE
from tests.support.health import log_tail, wait_serving
from tests.support.net import free_port
from tests.support.waiting import LIMIT_S, until_sync

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "assets" / "tiny-llama"
TIMEOUT_S = 3  # --distributed-timeout
START_S = 300  # two processes compiling on a shared 2-core machine
SERVING = health_pb2.HealthCheckResponse.SERVING


def start(process_id: int, port: int, coordinator: str, log: Path) -> subprocess.Popen:
    """A decode-server of the group, its log to `log` (a file: a pipe nobody reads while it
    serves would fill and block it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENWIRE_", "JAX_NUM_CPU"))}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "decode-server", "--model", str(TINY), "--port", str(port),
         "--tensor-parallel", "2", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(process_id),
         "--distributed-timeout", str(TIMEOUT_S), "--max-batch-size", "2", "--max-context-length", "32",
         "--max-prefill-chunk", "16"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
    )


def test_every_call_of_the_model_contract_is_published_block_tables_included():
    """A follower that missed `set_pages` would write its KV into other pages than the leader's
    (or refuse the call), and the group's collectives would part: the table is published like
    every other call of the contract."""
    assert multihost.STEPS == {
        "warm_up", "set_pages", "prefill", "prefill_chunk", "prefill_packed", "decode", "dispatch", "collect", "ban",
        "dispatch_sampling", "release", "verify",
    }


def test_two_processes_decode_like_one_and_a_dead_one_takes_the_other_down(tmp_path):
    leader_port, follower_port, coordinator = free_port(), free_port(), f"127.0.0.1:{free_port()}"
    logs = [tmp_path / "process-0.log", tmp_path / "process-1.log"]
    leader = start(0, leader_port, coordinator, logs[0])
    follower = start(1, follower_port, coordinator, logs[1])
    try:
        wait_serving(leader_port, [leader, follower], logs, START_S)
        wait_serving(follower_port, [leader, follower], logs, START_S)  # a follower's readiness: warm and following

        case = json.loads((TINY / "golden.json").read_text())["cases"][0]
        with DecodeClient(f"127.0.0.1:{leader_port}", timeout=60) as client:
            events = list(client.decode(case["prompt_ids"], max_output_tokens=12, ignore_eos=True))
            again = list(client.decode(case["prompt_ids"], max_output_tokens=12, ignore_eos=True))
        ids = [e.token.id for e in events if e.HasField("token")]
        assert ids == case["greedy_ids"][:12]
        assert [e.token.id for e in again if e.HasField("token")] == ids
        # a constrained request: its banned rows (`ban`) are replayed by the follower too
        with DecodeClient(f"127.0.0.1:{leader_port}", timeout=60) as client:
            held = list(client.decode(case["prompt_ids"], max_output_tokens=8, constraint=decode_pb2.Constraint(regex="(yes|no)")))
        text = Tokenizer.from_file(str(TINY / "tokenizer.json")).decode([e.token.id for e in held if e.HasField("token")])
        assert text in ("yes", "no") and held[-1].finished.reason == decode_pb2.FINISH_REASON_STOP

        seen: list[int] = []
        with grpc.insecure_channel(f"127.0.0.1:{leader_port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=DECODER_SERVICE))

            def read() -> None:
                try:
                    for response in watch:
                        seen.append(response.status)
                except grpc.RpcError:  # the server stopped
                    pass

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            until_sync(lambda: seen, "the current status, which comes first", interval_s=0.05)
            assert seen == [SERVING]
            follower.send_signal(signal.SIGKILL)
            # bounded far past the stated bound: only a process that never goes down reaches it
            code = leader.wait(timeout=3 * multihost.wait_s(multihost.Group(coordinator, 2, 0, TIMEOUT_S)))
            reader.join(LIMIT_S)
        assert code == 1, log_tail(logs[0])  # its engine died: the exit a supervisor restarts
        # after the death, its readiness went NOT_SERVING before it exited. (From the log, not the
        # Watch: when the monitor has not caught the death first, readiness is set in stop(0),
        # which cancels the Watch at once, and the NOT_SERVING sent just before may not arrive.)
        lines = logs[0].read_text().splitlines()
        died = max(i for i, line in enumerate(lines) if "the decode engine died" in line)
        last_serving = max(i for i, line in enumerate(lines) if f"readiness {DECODER_SERVICE}: SERVING" in line)
        assert last_serving < died, log_tail(logs[0])
        assert any(f"readiness {DECODER_SERVICE}: NOT_SERVING" in line for line in lines[last_serving:]), log_tail(logs[0])
    finally:
        for p in (leader, follower):
            if p.poll() is None:
                p.kill()
            p.wait()


def config(*flags: str):
    from services.cli import build_parser
    from services.config import DecodeServerConfig

    return DecodeServerConfig.from_args(build_parser().parse_args(["decode-server", "--model", str(TINY), *flags]))


def test_the_group_flags_go_together_and_are_checked_in_one_line():
    group = config("--coordinator", "h0:8476", "--num-processes", "2", "--process-id", "1", "--tensor-parallel", "4").group
    assert (group.coordinator, group.num_processes, group.process_id, group.timeout_s) == ("h0:8476", 2, 1, 30.0)
    assert config().group is None
    problems = {
        ("--coordinator", "h0:8476"): "go together",
        ("--coordinator", "h0:8476", "--num-processes", "2", "--process-id", "2", "--tensor-parallel", "2"): "--process-id must be below",
        ("--coordinator", "h0:8476", "--num-processes", "2", "--process-id", "0", "--tensor-parallel", "3"): "a multiple of --num-processes",
    }
    for flags, says in problems.items():
        try:
            config(*flags)
        except ValueError as error:
            assert says in str(error) and "\n" not in str(error)
        else:
            raise AssertionError(f"{flags} accepted")
