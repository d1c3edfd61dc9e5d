"""The tensor-parallel Kubernetes manifests (deploy/k8s/tensor-parallel/), checked without a
cluster: they validate against the Kubernetes schemas with `kubernetes-validate` (strict; also
covered for every file under deploy/k8s/ by tests/test_k8s_manifests.py), their arguments and
variables are flags of the real CLI and parse, the GPUs requested match --tensor-parallel, and
the multi-host group has what jax.distributed needs: a headless Service publishing pods before
they are ready, indexed pods started together, the process id from the pod's index, the
coordinator address naming pod 0 through that Service, and gRPC readiness probes.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli import build_parser
from services.config import env_name
from services.service_names import DECODER_SERVICE

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "deploy" / "k8s" / "tensor-parallel"
VERSIONS = ("1.30", str(kubernetes_validate.utils.latest_version()))


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((FOLDER / name).read_text()) if d is not None]


def one(name: str, kind: str, metadata_name: str | None = None) -> dict:
    [doc] = [d for d in documents(name) if d["kind"] == kind and metadata_name in (None, d["metadata"]["name"])]
    return doc


def container(workload: dict) -> dict:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict[str, dict]:
    return {v["name"]: v for v in c["env"]}


def parsed(c: dict, monkeypatch, process_id: str = "0"):
    """The container's command line through the real parser, its plain variables applied (a
    variable from the downward API takes `process_id`)."""
    flags = {s for p in [build_parser()] for a in p._actions for s in a.option_strings}
    for name, variable in env(c).items():
        monkeypatch.setenv(name, variable.get("value", process_id))
    args = build_parser().parse_args(c["args"])
    known = {env_name(a) for a in vars(args)} | {env_name(f) for f in flags}
    assert set(env(c)) <= known, set(env(c)) - known
    return args


@pytest.mark.parametrize("name", ["one-host.yaml", "multi-host.yaml"])
@pytest.mark.parametrize("version", VERSIONS)
def test_the_manifests_validate_against_the_kubernetes_schemas(name, version):
    for doc in documents(name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_one_host_requests_as_many_gpus_as_it_splits_the_model_over(monkeypatch):
    deployment = one("one-host.yaml", "Deployment")
    c = container(deployment)
    args = parsed(c, monkeypatch)
    assert args.command == "decode-server" and args.tensor_parallel > 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel
    assert c["readinessProbe"]["grpc"] == {"port": args.port, "service": DECODER_SERVICE}
    service = one("one-host.yaml", "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_multi_host_group_forms_from_indexed_pods_and_a_headless_service(monkeypatch):
    group = one("multi-host.yaml", "StatefulSet")
    spec, c = group["spec"], container(group)
    headless = one("multi-host.yaml", "Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    assert spec["podManagementPolicy"] == "Parallel"  # pod 0 is not ready until every pod joins

    variables = env(c)
    index = variables["TOKENWIRE_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
    for process_id in map(str, range(spec["replicas"])):
        args = parsed(c, monkeypatch, process_id)
        assert args.num_processes == spec["replicas"] and args.process_id == int(process_id)
    host, port = args.coordinator.rsplit(":", 1)
    assert host == f"{group['metadata']['name']}-0.{headless['metadata']['name']}"  # pod 0, through the Service
    assert {p["containerPort"] for p in c["ports"] if p["name"] == "coordinator"} == {int(port)}
    assert int(port) in {p["port"] for p in headless["spec"]["ports"]}
    gpus = c["resources"]["requests"]["nvidia.com/gpu"]
    assert args.tensor_parallel == gpus * spec["replicas"]  # every pod's devices together
    assert c["readinessProbe"]["grpc"] == {"port": args.port, "service": DECODER_SERVICE}
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": args.port}

    clients = one("multi-host.yaml", "Service", "decode-tp-group")
    assert clients["spec"]["selector"] == {**headless["spec"]["selector"], "apps.kubernetes.io/pod-index": "0"}
