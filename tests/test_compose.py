"""Deployment files checked without a Docker engine (there is none here or in CI).

  * compose.yaml / compose.gpu.yaml / Dockerfile: structure, and every subcommand, `--flag` and
    TOKENWIRE_* variable they use checked against the real CLI parser, so a renamed flag fails
    here instead of in a container. `docker-compose config` runs too when it is installed.
  * The health probe the healthchecks use, against real servers.
  * The compose services run as local processes exactly as compose starts them (same command,
    same environment), with addresses on 127.0.0.1, free ports, and the tiny test checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.cli import build_parser
from services.config import env_name
from services.health_probe import health_check

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "assets" / "tiny-llama"
SERVERS = ("decode", "text")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


COMPOSE = load("compose.yaml")
GPU = load("compose.gpu.yaml")
SERVICES = COMPOSE["services"]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def command_flags(command: str) -> set[str]:
    """Flags valid for `tokenwire <command>`: the global ones and the command's own."""
    parser = build_parser()
    known = subcommands(parser)
    assert command in known, f"{command!r} is not a tokenwire command ({', '.join(known)})"
    return options(parser) | options(known[command])


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def healthcheck_argv(service: str) -> list[str]:
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "tokenwire"], "exec form, through the image's own CLI"
    return test[2:]


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    unit = next(u for u in ("ms", "s", "m", "h") if duration.endswith(u))
    return float(duration.removesuffix(unit)) * units[unit]


# -- (a) the files, against the CLI --------------------------------------------------------


def test_services_volume_and_restart_policies():
    assert set(SERVICES) == {"model", *SERVERS}
    assert "models" in COMPOSE["volumes"]
    assert SERVICES["model"]["command"][0] == "pull"
    assert SERVICES["model"]["restart"] == "no"  # one-shot: restarting it would loop
    assert SERVICES["model"]["volumes"] == ["models:/cache"]
    for name in SERVERS:
        assert SERVICES[name]["restart"] == "unless-stopped"
        assert SERVICES[name]["volumes"] == ["models:/cache:ro"]
        assert SERVICES[name]["environment"]["TOKENWIRE_CACHE"] == "/cache"
    assert SERVICES["decode"]["depends_on"] == {"model": {"condition": "service_completed_successfully"}}
    assert SERVICES["text"]["depends_on"]["decode"] == {"condition": "service_healthy"}
    assert flag_value(SERVICES["text"]["command"], "--decoder") == f"decode:{flag_value(SERVICES['decode']['command'], '--port')}"


def test_every_command_word_exists_in_the_cli(monkeypatch):
    commands = [SERVICES[name]["command"] for name in SERVICES] + [healthcheck_argv(name) for name in SERVERS]
    for argv in commands:
        unknown = {w.split("=")[0] for w in argv if w.startswith("--")} - command_flags(argv[0])
        assert not unknown, f"`tokenwire {argv[0]}` has no {sorted(unknown)}"
    for name in SERVICES:  # the values parse too, with the service's environment applied
        with monkeypatch.context() as env:
            for key, value in SERVICES[name].get("environment", {}).items():
                env.setenv(key, str(value))
            build_parser().parse_args(SERVICES[name]["command"])


@pytest.mark.parametrize("file, name", [("compose.yaml", n) for n in SERVICES] + [("compose.gpu.yaml", n) for n in GPU["services"]])
def test_env_vars_are_flags_of_their_command(file, name):
    command = SERVICES[name]["command"][0]
    env = load(file)["services"][name].get("environment", {})
    flags = {env_name(flag): flag for flag in command_flags(command)}
    for key in env:
        assert key.startswith("TOKENWIRE_"), key
        assert key in flags, f"{file}: {name} sets {key}, but `tokenwire {command}` has no such flag"


@pytest.mark.parametrize("name", SERVERS)
def test_service_env_does_not_change_its_healthcheck(name):
    """The environment reaches the healthcheck too: it must not set a `tokenwire health` flag."""
    argv = healthcheck_argv(name)
    shared = {env_name(f) for f in command_flags(argv[0]) - options(build_parser())}
    assert not shared & set(SERVICES[name]["environment"])


@pytest.mark.parametrize("name", SERVERS)
def test_healthcheck_probes_the_service_that_the_server_registers(name):
    from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE

    service = SERVICES[name]
    argv = healthcheck_argv(name)
    assert argv[0] == "health"
    assert flag_value(argv, "--server") == f"127.0.0.1:{flag_value(service['command'], '--port')}"
    assert flag_value(argv, "--service") == {"decode": DECODER_SERVICE, "text": TEXT_GENERATION_SERVICE}[name]
    check = service["healthcheck"]
    assert float(flag_value(argv, "--timeout")) < seconds(check["timeout"]), "the probe must answer before docker gives up"
    assert {"interval", "retries", "start_period"} <= set(check)


@pytest.mark.parametrize("name", SERVERS)
def test_ports_are_published_and_grace_fits(name):
    service = SERVICES[name]
    published = {p.split(":")[-1] for p in service["ports"]}
    assert flag_value(service["command"], "--host") == "0.0.0.0"
    assert flag_value(service["command"], "--port") in published
    assert service["environment"]["TOKENWIRE_METRICS_PORT"] in published
    grace = float(service["environment"].get("TOKENWIRE_GRACE_PERIOD", "30"))
    assert seconds(service["stop_grace_period"]) > grace, "docker would SIGKILL before the drain ends"


def test_the_text_side_installs_and_ships_without_jax():
    """The base install (and the `text` extra) has no JAX, and compose builds the text and model
    services from it: only the decode image carries jaxlib."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    base = [d.lower() for d in pyproject["project"]["dependencies"]]
    assert not [d for d in base if d.startswith(("jax", "jaxlib"))]
    assert pyproject["project"]["optional-dependencies"]["text"] == []
    for name in ("model", "text"):
        assert SERVICES[name]["build"]["args"]["JAX_EXTRA"] == "text", name
        assert SERVICES[name]["image"] != SERVICES["decode"]["image"], name


def test_dockerfile_and_gpu_override_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["tokenwire"] == "services.cli:main"
    extras = pyproject["project"]["optional-dependencies"]
    assert any(d.startswith("jax[cuda12]") for d in extras["gpu"])
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert 'ENTRYPOINT ["tokenwire"]' in lines
    assert "ARG JAX_EXTRA=cpu" in lines
    assert COMPOSE["x-tokenwire"]["build"]["args"]["JAX_EXTRA"] in extras
    decode = GPU["services"]["decode"]
    assert decode["build"]["args"]["JAX_EXTRA"] == "gpu"
    assert SERVICES["decode"]["build"]["args"]["JAX_EXTRA"] == "cpu"
    assert decode["image"] != COMPOSE["x-tokenwire"]["image"]
    devices = decode["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (apt-get install docker-compose) not installed")
@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]])
def test_docker_compose_config_accepts_the_files(files):
    args = [a for f in files for a in ("-f", f)]
    done = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- the probe ------------------------------------------------------------------------------


async def test_health_probe_exit_codes():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    target = f"127.0.0.1:{port}"
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await servicer.set("svc", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await asyncio.to_thread(health_check, target) == 0
        assert await asyncio.to_thread(health_check, target, "svc", 2.0) == 1
        assert await asyncio.to_thread(health_check, target, "no.such.Service", 2.0) == 1
        # with `wait`, it keeps asking until the service turns SERVING
        waiting = asyncio.create_task(asyncio.to_thread(health_check, target, "svc", 2.0, 10.0))
        await asyncio.sleep(0.3)
        await servicer.set("svc", health_pb2.HealthCheckResponse.SERVING)
        assert await waiting == 0
    finally:
        await server.stop(None)
    started = time.monotonic()
    assert await asyncio.to_thread(health_check, target, "", 2.0, 1.0) == 1  # nothing listens any more
    assert time.monotonic() - started < 5


# -- (b) the services as compose starts them ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(name: str, ports: dict[str, int], metrics_ports: dict[str, int], cache: Path) -> tuple[list[str], dict[str, str]]:
    """The service's command and environment, with container addresses made local."""
    argv = list(SERVICES[name]["command"])
    local = {"--host": "127.0.0.1", "--port": str(ports[name]), "--model": str(TINY), "--decoder": f"127.0.0.1:{ports['decode']}"}
    for flag, value in local.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    env.update({k: str(v) for k, v in SERVICES[name]["environment"].items()})
    env.update(TOKENWIRE_CACHE=str(cache), TOKENWIRE_METRICS_PORT=str(metrics_ports[name]))
    if name == "decode":  # a fast warm-up: fewer slots and compiled lengths than a real deployment
        env.update(TOKENWIRE_MAX_BATCH_SIZE="2", TOKENWIRE_MAX_CONTEXT_LENGTH="64")
    return argv, env


def wait_healthy(process: subprocess.Popen, name: str, log: Path, port: int, budget_s: float) -> None:
    service = flag_value(healthcheck_argv(name), "--service")
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if health_check(f"127.0.0.1:{port}", service, timeout=2.0) == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"{name} not SERVING after {budget_s} s:\n{log.read_text()[-3000:]}")


def test_services_start_as_compose_starts_them_and_answer(tmp_path):
    from protos.decode.v1 import decode_pb2
    from services.client import TextClient

    ports = {name: free_port() for name in SERVERS}
    metrics_ports = {name: free_port() for name in SERVERS}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name in ("decode", "text"):  # depends_on order: text waits for decode to be healthy
            argv, env = localize(name, ports, metrics_ports, tmp_path / "cache")
            log = tmp_path / f"{name}.log"
            with log.open("w") as out:  # the same entry point as the image's ENTRYPOINT ["tokenwire"]
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
                )
            wait_healthy(processes[name], name, log, ports[name], budget_s=240)

        with TextClient(f"127.0.0.1:{ports['text']}", timeout=60) as client:
            completion = client.complete("Hello", max_output_tokens=4)
        assert completion.reason in (decode_pb2.FINISH_REASON_STOP, decode_pb2.FINISH_REASON_LENGTH)
        assert completion.usage.completion_tokens == len(completion.token_ids) <= 4
        assert completion.usage.prompt_tokens > 0

        if "--metrics-port" in command_flags("decode-server"):  # once the servers serve metrics
            for name in SERVERS:  # each process counted the one request once
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_ports[name]}/metrics", timeout=5) as response:
                    families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
                counted = [s for s in families["tokenwire_requests"].samples if s.name == "tokenwire_requests_total"]
                assert sum(s.value for s in counted) == 1, f"{name}: {counted}"
    finally:
        for name in reversed(list(processes)):  # as `docker compose stop`: SIGTERM, then wait
            processes[name].send_signal(signal.SIGTERM)
        codes = {}
        for name, process in processes.items():
            try:
                codes[name] = process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
    assert codes == {name: 0 for name in SERVERS}, "a clean SIGTERM drain exits 0"
