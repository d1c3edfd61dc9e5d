"""Deployment files checked without a Docker engine (there is none here or in CI).

  * compose.yaml / compose.gpu.yaml / Dockerfile: structure, and every subcommand, `--flag` and
    TOKENWIRE_* variable they use checked against the real CLI parser, so a renamed flag fails
    here instead of in a container. `docker-compose config` runs too when it is installed.
  * The health probe the healthchecks use, against real servers.
  * The compose services run as local processes exactly as compose starts them (same command,
    same environment), with addresses on 127.0.0.1, free ports, and the tiny test checkpoint;
    with compose.secure.yaml, whose claims are the TLS and token wiring, decode runs the scripted
    model over that checkpoint's tokenizer (no compiling).
  * `--scale decode=N`: nothing pins decode to one container, and three decode-servers as compose
    runs them (on 127.0.0.1-3, one port, as the name `decode` resolves) share a text service's
    requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from packaging.requirements import Requirement
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.cli import build_parser
from services.config import env_name
from services.health_probe import health_check
from support import kernel_cache, tiny_served
from support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "assets" / "tiny-llama"
SERVERS = ("decode", "text")  # the gRPC servers
HTTP = "api"  # the OpenAI-compatible HTTP front, the one published service


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


COMPOSE = load("compose.yaml")
GPU = load("compose.gpu.yaml")
SECURE = load("compose.secure.yaml")
SERVICES = COMPOSE["services"]
PUBLIC = "${TOKENWIRE_PUBLISH_ADDRESS:-127.0.0.1}:8000:8000"  # the one published port


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
    assert set(SERVICES) == {"model", *SERVERS, HTTP}
    assert "models" in COMPOSE["volumes"]
    assert SERVICES["model"]["command"][0] == "pull"
    assert SERVICES["model"]["restart"] == "no"  # one-shot: restarting it would loop
    assert SERVICES["model"]["volumes"] == ["models:/cache"]
    for name in (*SERVERS, HTTP):
        assert SERVICES[name]["restart"] == "unless-stopped"
    for name in SERVERS:  # the model read-only; decode writes its compiled executables (--compilation-cache)
        assert SERVICES[name]["volumes"] == ["models:/cache:ro"] + (["xla:/cache/xla"] if name == "decode" else [])
        assert SERVICES[name]["environment"]["TOKENWIRE_CACHE"] == "/cache"
    assert "xla" in COMPOSE["volumes"]
    assert SERVICES["decode"]["depends_on"] == {"model": {"condition": "service_completed_successfully"}}
    assert SERVICES["text"]["depends_on"]["decode"] == {"condition": "service_healthy"}
    assert flag_value(SERVICES["text"]["command"], "--decoder") == f"dns:///decode:{flag_value(SERVICES['decode']['command'], '--port')}"
    assert SERVICES[HTTP]["depends_on"] == {"text": {"condition": "service_healthy"}}
    assert flag_value(SERVICES[HTTP]["command"], "--text") == f"text:{flag_value(SERVICES['text']['command'], '--port')}"
    assert "volumes" not in SERVICES[HTTP], "the HTTP front holds no model"


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


# The one variable a service sets for its healthcheck rather than for itself (the probe trusts the CA).
FOR_THE_HEALTHCHECK = {"TOKENWIRE_TLS_CA"}
# JAX's own variables, read by JAX in the engine process, not tokenwire flags.
FOR_JAX = {"XLA_PYTHON_CLIENT_MEM_FRACTION"}


@pytest.mark.parametrize(
    "file, name",
    [("compose.yaml", n) for n in SERVICES] + [("compose.gpu.yaml", n) for n in GPU["services"]]
    + [("compose.secure.yaml", n) for n in SECURE["services"]],
)
def test_env_vars_are_flags_of_their_command(file, name):
    command = SERVICES[name]["command"][0]
    env = load(file)["services"][name].get("environment", {})
    flags = {env_name(flag): flag for flag in command_flags(command)}
    health_flags = {env_name(flag) for flag in command_flags("health")}
    for key in env:
        if key in FOR_JAX:
            continue
        assert key.startswith("TOKENWIRE_"), key
        if key in FOR_THE_HEALTHCHECK:
            assert key in health_flags and key not in flags, key
            continue
        assert key in flags, f"{file}: {name} sets {key}, but `tokenwire {command}` has no such flag"


@pytest.mark.parametrize("name", SERVERS)
def test_service_env_does_not_change_its_healthcheck(name):
    """The environment reaches the healthcheck too: it must not set a `tokenwire health` flag
    (with compose.secure.yaml, only the CA the probe needs to trust the server)."""
    argv = healthcheck_argv(name)
    probe_flags = {env_name(f) for f in command_flags(argv[0]) - options(build_parser())}
    assert not probe_flags & set(SERVICES[name]["environment"])
    secure_env = set(SECURE["services"][name]["environment"])
    assert probe_flags & secure_env <= FOR_THE_HEALTHCHECK | {"TOKENWIRE_TLS_CERT", "TOKENWIRE_TLS_KEY"}
    assert FOR_THE_HEALTHCHECK <= secure_env, "with TLS on, the probe must trust the CA"


def test_only_the_api_port_is_published_on_loopback_by_default():
    """Nothing but the public port (the HTTP API) leaves the compose network, and it stays on
    the host's loopback unless TOKENWIRE_PUBLISH_ADDRESS says otherwise; the gRPC services and
    the metrics are reachable only from other services."""
    published = {name: service.get("ports", []) for name, service in SERVICES.items()}
    assert published == {"model": [], "decode": [], "text": [], HTTP: [PUBLIC]}
    assert flag_value(SERVICES[HTTP]["command"], "--port") == "8000"
    assert flag_value(SERVICES["text"]["command"], "--port") in set(SERVICES["text"]["expose"])
    for name in SERVERS:
        exposed = set(SERVICES[name]["expose"])
        assert SERVICES[name]["environment"]["TOKENWIRE_METRICS_PORT"] in exposed
    assert flag_value(SERVICES["decode"]["command"], "--port") in set(SERVICES["decode"]["expose"])
    for overlay in (GPU, SECURE):  # no override publishes more
        assert not any("ports" in service for service in overlay["services"].values())


def test_the_secure_overlay_takes_every_secret_from_a_file_that_make_secrets_writes(tmp_path):
    declared = SECURE["secrets"]
    for name, service in SECURE["services"].items():
        mounted = set(service["secrets"])
        assert mounted <= set(declared), name
        paths = {v for v in service["environment"].values() if v.startswith("/run/secrets/")}
        assert paths == {f"/run/secrets/{s}" for s in mounted}, f"{name}: every mounted secret is used, and only those"
        for key, value in service["environment"].items():
            assert value.startswith("/run/secrets/"), f"{name}: {key} holds a value, not a secret file"
    assert {Path(d["file"]).parent for d in declared.values()} == {Path("secrets")}
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the secrets")
    subprocess.run(["bash", str(ROOT / "scripts" / "make_secrets"), str(tmp_path / "s")], check=True, capture_output=True)
    assert {p.name for p in (tmp_path / "s").iterdir()} == {Path(d["file"]).name for d in declared.values()}


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
def test_servers_listen_on_the_compose_network_and_grace_fits(name):
    service = SERVICES[name]
    assert flag_value(service["command"], "--host") == "0.0.0.0"  # the container's interfaces: compose decides what is published
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
    api = pyproject["project"]["optional-dependencies"][SERVICES[HTTP]["build"]["args"]["JAX_EXTRA"]]
    assert api and not [d for d in api if d.lower().startswith(("jax", "jaxlib"))]
    assert SERVICES[HTTP]["image"] not in {SERVICES[name]["image"] for name in ("decode", "text")}


def test_dockerfile_and_gpu_override_match_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["tokenwire"] == "services.cli:main"
    extras = pyproject["project"]["optional-dependencies"]
    for cuda in ("cuda12", "cuda13"):  # JAX's own extra of the same name, a range admitting 0.10 and 0.11
        [requirement] = map(Requirement, extras[cuda])
        assert requirement.name == "jax" and requirement.extras == {cuda}
        assert {"0.10.2", "0.11.0", "0.11.9"} <= set(requirement.specifier.filter(["0.10.1", "0.10.2", "0.11.0", "0.11.9", "0.12.0"]))
        assert "0.10.1" not in requirement.specifier and "0.12.0" not in requirement.specifier
    assert "gpu" not in extras, "jax[cuda12] beside a host's CUDA 13 JAX installs a second set of CUDA plugins"
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert 'ENTRYPOINT ["tokenwire"]' in lines
    assert "ARG JAX_EXTRA=cpu" in lines
    assert COMPOSE["x-tokenwire"]["build"]["args"]["JAX_EXTRA"] in extras
    decode = GPU["services"]["decode"]
    assert decode["build"]["args"]["JAX_EXTRA"] in {"cuda12", "cuda13"}
    assert SERVICES["decode"]["build"]["args"]["JAX_EXTRA"] == "cpu"
    assert decode["image"] != COMPOSE["x-tokenwire"]["image"]
    devices = decode["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_the_gpu_override_sets_the_memory_fraction_and_a_longer_start_period():
    """JAX's allocator share is explicit (the memory check at load compares with it), and the GPU
    start period covers a first start's compiles (compose.gpu.yaml's comment has the estimate);
    the CPU one covers the 73 s measured for compose's settings 4 times (docs/deployment.md)."""
    decode = GPU["services"]["decode"]
    assert 0.5 <= float(decode["environment"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 0.95
    cpu, gpu = (seconds(s["healthcheck"]["start_period"]) for s in (SERVICES["decode"], decode))
    assert cpu >= 4 * 73 and gpu >= cpu
    assert set(decode["healthcheck"]) == {"start_period"}, "the rest of the healthcheck is compose.yaml's"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (apt-get install docker-compose) not installed")
@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"], ["compose.yaml", "compose.secure.yaml"]])
def test_docker_compose_config_accepts_the_files(files):
    args = [a for f in files for a in ("-f", f)]
    done = subprocess.run(["docker-compose", *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- the probe ------------------------------------------------------------------------------


async def test_health_probe_exit_codes():
    class Recorded(health.aio.HealthServicer):
        """Records the status each Check answered, per service, in order."""

        def __init__(self) -> None:
            super().__init__()
            self.answered: dict[str, list[int]] = {}

        async def Check(self, request, context):
            response = await super().Check(request, context)
            self.answered.setdefault(request.service, []).append(response.status)
            return response

    server = grpc.aio.server()
    servicer = Recorded()
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
        # with `wait`, it keeps asking until the service turns SERVING: SERVING comes only once
        # the probe has been told NOT_SERVING, so it answers 0 only if it asks again
        NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
        asked_before = len(servicer.answered["svc"])
        waiting = asyncio.create_task(asyncio.to_thread(health_check, target, "svc", 2.0, 10.0))
        deadline = asyncio.get_running_loop().time() + 5.0  # its first ask comes at once
        while len(servicer.answered["svc"]) == asked_before:
            assert asyncio.get_running_loop().time() < deadline and not waiting.done(), "the waiting probe never asked"
            await asyncio.sleep(0.01)
        assert set(servicer.answered["svc"][asked_before:]) == {NOT_SERVING}
        await servicer.set("svc", SERVING)
        assert await waiting == 0  # (bounded by the probe's own wait, 10 s, and its 2 s per check)
        assert servicer.answered["svc"][asked_before:][-1] == SERVING  # it asked again and was told SERVING
    finally:
        await server.stop(None)
    # nothing listens any more: the probe gives up after its wait (the outer bound only keeps a
    # probe that ignored its wait from hanging the suite)
    assert await asyncio.wait_for(asyncio.to_thread(health_check, target, "", 2.0, 1.0), 30) == 1


# -- (b) the services as compose starts them ------------------------------------------------


def localize(
    name: str, ports: dict[str, int], metrics_ports: dict[str, int], cache: Path, secrets: Path | None = None,
    model: str = str(TINY),
) -> tuple[list[str], dict[str, str]]:
    """The service's command and environment, with container addresses made local and `--model`
    set to `model`; with `secrets` (a directory scripts/make_secrets wrote), compose.secure.yaml's
    environment too, /run/secrets/ pointing there."""
    argv = list(SERVICES[name]["command"])
    local = {
        "--host": "127.0.0.1", "--port": str(ports[name]), "--model": model, "--decoder": f"127.0.0.1:{ports['decode']}",
        "--text": f"127.0.0.1:{ports['text']}",
    }
    for flag, value in local.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    env.update({k: str(v) for k, v in SERVICES[name]["environment"].items()})
    if secrets is not None:
        env.update({k: v.replace("/run/secrets", str(secrets)) for k, v in SECURE["services"][name]["environment"].items()})
    env.update(TOKENWIRE_CACHE=str(cache), TOKENWIRE_METRICS_PORT=str(metrics_ports[name]))
    if name == "decode":  # a fast warm-up: support.tiny_served's slots and context, not a real deployment's
        env.update(
            TOKENWIRE_MAX_BATCH_SIZE=str(tiny_served.CONFIG["max_batch_size"]),
            TOKENWIRE_MAX_CONTEXT_LENGTH=str(tiny_served.CONFIG["max_context_length"]),
        )
    return argv, env


def run_cache() -> Path:
    """The decode server's --cache for the tiny checkpoint: this run's directory, whose xla/ is
    the run's compilation cache (tests/conftest.py). JAX keys a cached executable on the cache's
    path too, so only a server whose <cache>/xla is that very directory reads back what the
    in-process loads of support.tiny_served's configuration (the server's, at the same slots and
    context) compiled; its warm-up then reads its shapes back instead of compiling them."""
    return Path(os.environ["TOKENWIRE_TEST_RUN_DIR"])


def metric_families(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return {f.name: f for f in text_string_to_metric_families(response.read().decode())}


def wait_healthy(process: subprocess.Popen, name: str, log: Path, port: int, budget_s: float, tls=None) -> None:
    service = flag_value(healthcheck_argv(name), "--service")
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        if health_check(f"127.0.0.1:{port}", service, timeout=2.0, tls=tls) == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"{name} not SERVING after {budget_s} s:\n{log.read_text()[-3000:]}")


def wait_http_ready(process: subprocess.Popen, log: Path, url: str, budget_s: float, ca: Path | None) -> None:
    """What the api service's healthcheck asks: GET /ready answers 200."""
    import ssl

    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{HTTP} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{HTTP} not ready after {budget_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("overlay", [None, "compose.secure.yaml"])
def test_services_start_as_compose_starts_them_and_answer(tmp_path, overlay):
    """compose.yaml runs the tiny checkpoint on the served defaults (its CPU kernels from this
    run's one build, support.kernel_cache, and its executables from the run's compilation cache
    when another file compiled support.tiny_served's configuration first: run_cache);
    compose.secure.yaml proves the TLS and token wiring, for which decode runs the scripted model
    (what the model computes is compose.yaml's run)."""
    from protos.decode.v1 import decode_pb2
    from services.client import TextClient, decode_request
    from services.security import ClientTlsConfig

    assert "--metrics-port" in command_flags("decode-server") and "--metrics-port" in command_flags("text-server")
    decode_model = str(TINY) if overlay is None else f"scripted:{TINY}"
    decode_cache = run_cache() if overlay is None else tmp_path / "cache"
    if overlay is None:  # the library this run built once, where the server looks first (its --cache)
        kernel_cache.seed(decode_cache)
    secrets = tls = token = None
    if overlay is not None:
        if shutil.which("openssl") is None:
            pytest.skip("the openssl CLI makes the secrets")
        secrets = tmp_path / "secrets"
        subprocess.run(["bash", str(ROOT / "scripts" / "make_secrets"), str(secrets)], check=True, capture_output=True)
        tls, token = ClientTlsConfig(ca=secrets / "ca.crt"), (secrets / "text_token").read_text().strip()
    ports = {name: free_port() for name in (*SERVERS, HTTP)}
    metrics_ports = {name: free_port() for name in (*SERVERS, HTTP)}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for name in ("decode", "text"):  # depends_on order: text waits for decode to be healthy
            cache, model = (decode_cache, decode_model) if name == "decode" else (tmp_path / "cache", str(TINY))
            argv, env = localize(name, ports, metrics_ports, cache, secrets, model)
            log = tmp_path / f"{name}.log"
            with log.open("w") as out:  # the same entry point as the image's ENTRYPOINT ["tokenwire"]
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
                )
            wait_healthy(processes[name], name, log, ports[name], budget_s=240, tls=tls)

        with TextClient(f"127.0.0.1:{ports['text']}", timeout=60, tls=tls, token=token) as client:
            completion = client.complete("Hello", max_output_tokens=4)
        if overlay is not None:  # the decoder refuses a caller without the text service's credential
            with grpc.secure_channel(f"127.0.0.1:{ports['decode']}", tls.credentials()) as channel:
                from protos.decode.v1 import decode_pb2_grpc

                with pytest.raises(grpc.RpcError) as refused:
                    list(decode_pb2_grpc.DecoderStub(channel).Decode(decode_request([1, 2], max_output_tokens=1), timeout=10))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as refused:  # nor does the text service take a call without its token
                with TextClient(f"127.0.0.1:{ports['text']}", timeout=10, tls=tls) as client:
                    client.complete("Hello", max_output_tokens=1)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert completion.reason in (decode_pb2.FINISH_REASON_STOP, decode_pb2.FINISH_REASON_LENGTH)
        assert completion.usage.completion_tokens == len(completion.token_ids) <= 4
        assert completion.usage.prompt_tokens > 0

        for name in SERVERS:  # each process counted the one request once
            families = metric_families(metrics_ports[name])
            counted = [s for s in families["tokenwire_requests"].samples if s.name == "tokenwire_requests_total"]
            assert sum(s.value for s in counted) == 1, f"{name}: {counted}"
        # the engine process reports its CPU kernels' state: the one the served defaults give on
        # this machine (on, here: x86-64 with AVX2 and a compiler); the scripted model has none
        states = {s.labels["state"]: s.value for s in metric_families(metrics_ports["decode"])["tokenwire_cpu_kernels"].samples}
        assert states == ({kernel_cache.expected_state(): 1.0} if overlay is None else {}), states

        # the HTTP front, as compose starts it, in front of the text service (its only published port)
        argv, env = localize(HTTP, ports, metrics_ports, tmp_path / "cache", secrets)
        log = tmp_path / f"{HTTP}.log"
        with log.open("w") as out:
            processes[HTTP] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        base = f"{'https' if secrets else 'http'}://{'localhost' if secrets else '127.0.0.1'}:{ports[HTTP]}"
        wait_http_ready(processes[HTTP], log, base, budget_s=60, ca=secrets / "ca.crt" if secrets else None)
        import httpx2

        api_token = (secrets / "api_token").read_text().strip() if secrets else "unused"
        import ssl

        verify = ssl.create_default_context(cafile=str(secrets / "ca.crt")) if secrets else True
        with httpx2.Client(base_url=base, verify=verify, timeout=60) as http:
            body = {"model": flag_value(SERVICES[HTTP]["command"], "--served-model-name"), "prompt": "Hello", "max_tokens": 3}
            answer = http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {api_token}"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] <= 3
            if secrets:  # without the api's token: refused
                assert http.post("/v1/completions", json=body).status_code == 401
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
    assert codes == {name: 0 for name in (*SERVERS, HTTP)}, "a clean SIGTERM drain exits 0"


# -- (c) `docker compose up --scale decode=3` ------------------------------------------------


def test_the_decode_service_scales_and_the_text_service_balances_over_every_replica():
    """Nothing pins decode to one container (a name, a host port), every overlay included; the
    text service's target is the service name as a dns:/// target, which resolves to every
    replica, and replicas recycle connections so that ones added later are found."""
    for overlay in (COMPOSE, GPU, SECURE):
        decode = overlay["services"].get("decode", {})
        assert not {"container_name", "hostname", "ports"} & set(decode), "a scaled service cannot fix these"
    decode_port = flag_value(SERVICES["decode"]["command"], "--port")
    assert flag_value(SERVICES["text"]["command"], "--decoder") == f"dns:///decode:{decode_port}"
    assert 0 < float(SERVICES["decode"]["environment"]["TOKENWIRE_MAX_CONNECTION_AGE"]) <= 3600
    assert SERVICES["text"]["depends_on"]["decode"] == {"condition": "service_healthy"}


def test_scaled_decode_replicas_as_compose_runs_them_share_the_requests(tmp_path):
    """Three decode-servers with compose's command and environment (the scripted model over the
    test tokenizer, so no compiling), on one port of three addresses as `decode` would resolve
    in the compose network, and a text-server pointed at all of them: requests sent one at a
    time go to each replica in turn."""
    from services.client import TextClient

    hosts = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    port = free_port()
    ports = {"decode": port, "text": free_port()}
    processes: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> None:
        logs.append(tmp_path / f"{name}-{len(logs)}.log")
        with logs[-1].open("w") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            ))

    def healthy(address: str, service: str) -> None:
        deadline = time.monotonic() + 60
        while health_check(address, service, timeout=2.0) != 0:
            assert all(p.poll() is None for p in processes), "\n".join(log.read_text()[-2000:] for log in logs)
            assert time.monotonic() < deadline, f"{address} not SERVING"
            time.sleep(0.2)

    try:
        for host in hosts:
            argv, env = localize("decode", ports, {"decode": 0}, tmp_path / "cache")
            argv[argv.index("--host") + 1] = host
            argv[argv.index("--model") + 1] = f"scripted:{TINY}"
            start("decode", argv, env)
        for host in hosts:
            healthy(f"{host}:{port}", flag_value(healthcheck_argv("decode"), "--service"))
        argv, env = localize("text", ports, {"text": free_port()}, tmp_path / "cache")
        argv[argv.index("--decoder") + 1] = "ipv4:" + ",".join(f"{h}:{port}" for h in hosts)  # what dns:///decode: finds
        start("text", argv, env)
        healthy(f"127.0.0.1:{ports['text']}", flag_value(healthcheck_argv("text"), "--service"))
        text_metrics = env["TOKENWIRE_METRICS_PORT"]
        with TextClient(f"127.0.0.1:{ports['text']}", timeout=30) as client:
            for _ in range(9):
                assert client.complete("Hello", max_output_tokens=2).usage.completion_tokens == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{text_metrics}/metrics", timeout=5) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        started = {
            s.labels["replica"]: s.value for s in families["tokenwire_decoder_requests"].samples
            if s.name == "tokenwire_decoder_requests_total"
        }
        assert started == {f"{h}:{port}": 3.0 for h in hosts}
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=40))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
    assert codes == [0] * len(codes), "a clean SIGTERM drain exits 0"
