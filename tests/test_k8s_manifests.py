"""The Kubernetes manifests under deploy/k8s/, checked without a cluster.

  * Every document of every YAML file under deploy/k8s/ (any subfolder: a new set of manifests
    is covered by being there) validates against the Kubernetes JSON schemas, strictly (an
    unknown field is an error), with `kubernetes-validate`, which ships the schemas: no network.
  * Every tokenwire container's arguments and TOKENWIRE_* variables are flags of its command in
    the real CLI parser, and its gRPC probes name the health services the server registers, on
    the port it listens on.
  * The replica set-up (deploy/k8s/replicas/): decode pods behind a headless Service that the
    text service's dns:/// target names, a ClusterIP Service for the text service, resource
    requests with an accelerator per decode pod, a PodDisruptionBudget per Deployment, and a
    grace period longer than the drain.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli import build_parser
from services.config import env_name
from services.service_names import DECODER_SERVICE, TEXT_GENERATION_SERVICE

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# Validated against the oldest Kubernetes these files claim (preStop `sleep` is on by default
# from 1.30) and the newest schemas the validator ships.
VERSIONS = ("1.30", str(kubernetes_validate.utils.latest_version()))
FILES = sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in FILES for doc in documents(path)]


def named(kind: str, name: str, folder: Path = K8S / "replicas") -> dict:
    [doc] = [d for p, d in all_documents() if p.parent == folder and d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_there_are_manifests():
    assert FILES and {p.parent.name for p in FILES} >= {"replicas"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(K8S)))
@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(path, version):
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_a_misspelt_field():
    """The check above can fail: a probe under a wrong name is an unknown field."""
    deployment = copy.deepcopy(named("Deployment", "tokenwire-decode"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProb"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.utils.ValidationError, match="readinessProb"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


# -- tokenwire containers against the CLI ------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def command_flags(command: str) -> set[str]:
    parser = build_parser()
    flags = lambda p: {s for a in p._actions for s in a.option_strings if s.startswith("--")}  # noqa: E731
    return flags(parser) | flags(subcommands(parser)[command])


def tokenwire_containers() -> list[tuple[str, dict]]:
    """(file: deployment/container, container) for every container running a tokenwire image."""
    found = []
    for path, doc in all_documents():
        if doc["kind"] != "Deployment":
            continue
        spec = doc["spec"]["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            if container["image"].split(":")[0].endswith("tokenwire"):
                found.append((f"{path.relative_to(K8S)}: {doc['metadata']['name']}/{container['name']}", container))
    return found


SERVES = {"decode-server": DECODER_SERVICE, "text-server": TEXT_GENERATION_SERVICE}


@pytest.mark.parametrize("where, container", tokenwire_containers(), ids=lambda x: x if isinstance(x, str) else "")
def test_arguments_and_variables_are_flags_of_the_command(where, container, monkeypatch):
    argv = container["args"]
    unknown = {w.split("=")[0] for w in argv if w.startswith("--")} - command_flags(argv[0])
    assert not unknown, f"{where}: `tokenwire {argv[0]}` has no {sorted(unknown)}"
    flags = {env_name(f) for f in command_flags(argv[0])}
    for variable in container.get("env", []):
        assert variable["name"] in flags, f"{where}: `tokenwire {argv[0]}` has no flag for {variable['name']}"
        monkeypatch.setenv(variable["name"], variable["value"])
    build_parser().parse_args(argv)  # the values parse, with the environment applied


def listens_on(container: dict) -> int:
    argv = container["args"]
    return int(argv[argv.index("--port") + 1])


@pytest.mark.parametrize("where, container", tokenwire_containers(), ids=lambda x: x if isinstance(x, str) else "")
def test_probes_name_the_services_the_server_registers(where, container):
    command = container["args"][0]
    if command not in SERVES:
        assert not any(k.endswith("Probe") for k in container), f"{where}: a one-shot has no probes"
        return
    port = listens_on(container)
    assert {p["containerPort"] for p in container["ports"] if p["name"] == "grpc"} == {port}
    readiness = container["readinessProbe"]["grpc"]
    assert readiness == {"port": port, "service": SERVES[command]}, where
    for probe in ("livenessProbe", "startupProbe"):  # "" (liveness): SERVING while the process lives
        assert container[probe]["grpc"] == {"port": port}, f"{where}: {probe}"


# -- the replica set-up --------------------------------------------------------------------------


def env(container: dict) -> dict[str, str]:
    return {v["name"]: v["value"] for v in container.get("env", [])}


def pod_labels(deployment: dict) -> dict:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels


def test_decode_replicas_sit_behind_a_headless_service_that_the_text_service_resolves():
    decode = named("Deployment", "tokenwire-decode")
    service = named("Service", "decode")
    assert decode["spec"]["replicas"] > 1
    assert service["spec"]["clusterIP"] == "None"  # every pod's address in DNS, for round_robin
    assert service["spec"]["selector"].items() <= pod_labels(decode).items()
    [container] = decode["spec"]["template"]["spec"]["containers"]
    [grpc_port] = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc_port["port"] == listens_on(container)
    assert float(env(container)["TOKENWIRE_MAX_CONNECTION_AGE"]) > 0

    [text] = named("Deployment", "tokenwire-text")["spec"]["template"]["spec"]["containers"]
    assert env(text)["TOKENWIRE_DECODER"] == f"dns:///{service['metadata']['name']}:{grpc_port['port']}"


def test_the_text_service_sits_behind_a_cluster_ip_service():
    text = named("Deployment", "tokenwire-text")
    service = named("Service", "text")
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP" and "clusterIP" not in service["spec"]
    assert service["spec"]["selector"].items() <= pod_labels(text).items()
    [container] = text["spec"]["template"]["spec"]["containers"]
    assert {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"} == {listens_on(container)}


def test_every_container_requests_resources_and_each_decode_pod_an_accelerator():
    for where, container in tokenwire_containers():
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests), where
    [decode] = named("Deployment", "tokenwire-decode")["spec"]["template"]["spec"]["containers"]
    assert decode["resources"]["requests"]["nvidia.com/gpu"] == decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    [text] = named("Deployment", "tokenwire-text")["spec"]["template"]["spec"]["containers"]
    assert not any("gpu" in k for k in text["resources"]["requests"])


@pytest.mark.parametrize("name", ["tokenwire-decode", "tokenwire-text"])
def test_a_disruption_budget_per_deployment_and_a_grace_period_longer_than_the_drain(name):
    deployment = named("Deployment", name)
    budget = named("PodDisruptionBudget", name)
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()
    if "minAvailable" in budget["spec"]:
        assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    else:
        assert budget["spec"]["maxUnavailable"] >= 1
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    pause = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    drain = float(env(container).get("TOKENWIRE_GRACE_PERIOD", 30))
    assert pod["terminationGracePeriodSeconds"] > pause + drain, "the kubelet would SIGKILL before the drain ends"
