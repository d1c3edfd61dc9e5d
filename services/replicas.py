"""Decode replicas as the text service sees them: the channel configuration that balances over
them, the model check, and the census that names each one.

gRPC does the balancing. The text service's channels to `--decoder` (one address, several as
`ipv4:A:P,B:P`, or a name such as `dns:///decode:50051` that resolves to every replica) use the
`round_robin` policy over every address, with client-side health checking (a grpc.health.v1
Watch per connection) on the *model's* service name, `tokenwire.decode.v1.Decoder/model:<digest>`,
which a decode server registers beside its plain readiness name once its model is loaded and
keeps in step with it. So a replica that is loading, draining, stalled, or serving another
model (its Watch answers SERVICE_UNKNOWN) is not READY for the balancer, and no call is picked
for it. A retry policy repeats an UNAVAILABLE GetModelInfo, or a DecodeStream that failed before
the replica's first headers, on another replica. Decode servers set a maximum connection age, so
clients re-resolve a name and find new replicas.

What gRPC does not offer in Python is a view of the addresses a channel resolved, or of the
replica a call went to. The census (`ReplicaCensus`) fills that gap and nothing else: every
interval it resolves the target as gRPC's resolver does (getaddrinfo) and asks each address for
its model (GetModelInfo, whose initial metadata carries the replica's id, as every DecodeStream's
does) and for its readiness under the model's name. It logs what changes, names a replica with
another model in an ERROR line whenever it is seen anew, and tells the DecodeStream pool how many
replicas are ready (and by which id), and the metrics each replica's address. It never decides
where a call goes.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import logging
import socket
from collections import Counter
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.core.model import ModelInfo
from protos.decode.v1 import decode_pb2, decode_pb2_grpc
from services.channels import open_channel
from services.security import ClientTlsConfig
from services.service_names import DECODER_SERVICE

log = logging.getLogger("tokenwire.text")

# Initial metadata a decode server sends on GetModelInfo and DecodeStream: an id of this server
# process, so that the text service can tell which replica a stream landed on.
REPLICA_ID_KEY = "tokenwire-replica-id"
# Initial metadata a decode server sends on DecodeStream when it reads DecodeStreamBatch
# (invariant 17): a server from before it would take a batch for an unknown action and drop it.
BATCH_KEY = "tokenwire-decode-stream-batch"

# Reconnect quickly after a replica restarts (gRPC's default backoff grows to 120 s).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def model_identity(info: ModelInfo) -> tuple:
    """What must be equal across replicas for them to serve one model: every GetModelInfo field
    but max_batch_size, which is a replica's capacity (replicas on different hardware may differ)."""
    return (info.model_id, info.vocab_size, info.max_context_length, tuple(sorted(info.eos_token_ids)))


def model_service_name(info: ModelInfo) -> str:
    """The health service name a decode server serving `info` registers, and the one the text
    service's balancer checks: replicas with another model do not know it (SERVICE_UNKNOWN)."""
    digest = hashlib.sha256(repr(model_identity(info)).encode()).hexdigest()[:16]
    return f"{DECODER_SERVICE}/model:{digest}"


def describe(info: ModelInfo) -> str:
    return (
        f"{info.model_id!r} (vocab {info.vocab_size}, context {info.max_context_length}, "
        f"EOS {sorted(info.eos_token_ids)})"
    )


def service_config(health_service: str) -> str:
    """The text service's channel configuration (gRPC's service config, as JSON): round_robin
    over every address of the target, a replica in rotation only while its health under
    `health_service` is SERVING, and UNAVAILABLE retried on another replica for GetModelInfo and
    for a DecodeStream that the replica has not yet answered (once its headers arrive the call is
    committed; what happens to the requests on it then is services.decode_stream_client's)."""
    retry = {
        "maxAttempts": 3,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": health_service},
        "methodConfig": [{
            "name": [
                {"service": DECODER_SERVICE, "method": "GetModelInfo"},
                {"service": DECODER_SERVICE, "method": "DecodeStream"},
            ],
            "retryPolicy": retry,
        }],
    })


def channel_options(health_service: str) -> list[tuple[str, int | str]]:
    return [*RECONNECT_OPTIONS, ("grpc.service_config", service_config(health_service)), ("grpc.enable_retries", 1)]


def model_info_from_pb(pb: decode_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(pb.model_id, pb.vocab_size, pb.max_context_length, pb.max_batch_size, frozenset(pb.eos_token_ids))


# -- the target's addresses -------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """One replica address: `target` dials it alone, `name` is how logs and metrics show it."""

    target: str
    name: str


def _split_host_port(hostport: str, default_port: int) -> tuple[str, int]:
    if hostport.startswith("["):  # [v6]:port
        host, _, rest = hostport[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if hostport.count(":") == 1:
        host, port = hostport.rsplit(":", 1)
        return host, int(port)
    return hostport, default_port  # a bare host, or a bare IPv6 address


def _literal(host: str, port: int) -> Address:
    ip = ipaddress.ip_address(host)
    if ip.version == 6:
        return Address(f"ipv6:[{host}]:{port}", f"[{host}]:{port}")
    return Address(f"ipv4:{host}:{port}", f"{host}:{port}")


async def resolve(target: str) -> tuple[list[Address], str | None]:
    """Every address of a gRPC target, as gRPC's own resolvers would find them, and the host name
    the target names (None for addresses): `ipv4:`/`ipv6:` lists as written, `unix:` as itself,
    `dns:` URIs and plain HOST:PORT through getaddrinfo (gRPC's default resolver is DNS; a name
    that does not resolve now gives no address)."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return [_literal(*_split_host_port(part, 443)) for part in target[len(scheme):].split(",") if part], None
    if target.startswith(("unix:", "unix-abstract:")):
        return [Address(target, target)], None
    hostport = target
    if target.startswith("dns:"):
        hostport = target[len("dns:"):]
        if hostport.startswith("//"):
            hostport = hostport[2:].split("/", 1)[1]  # dns://authority/host:port
    host, port = _split_host_port(hostport, 443)
    try:
        return [_literal(host, port)], None
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [], host
    addresses = []
    for family, _, _, _, sockaddr in found:
        address = _literal(sockaddr[0], port)
        if address not in addresses:
            addresses.append(address)
    return addresses, host


# -- the census -------------------------------------------------------------------------------


@dataclass
class Replica:
    """What the census knows of one address."""

    address: Address
    replica_id: str | None = None  # the last id it answered with
    info: ModelInfo | None = None  # the last model it answered with
    state: str = "unknown"  # ready | not_ready | refused (another model); unknown until asked
    why: str = ""


class ReplicaCensus:
    """The replicas behind `target`: each address asked on a channel of its own (pick_first to
    that address alone), so that a replica the balancer leaves out can still be asked and named."""

    def __init__(
        self, target: str, tls: ClientTlsConfig | None, token: str | None, timeout_s: float = 2.0
    ) -> None:
        self.target = target
        self.tls = tls
        self.token = token
        self.timeout_s = timeout_s
        self.reference: ModelInfo | None = None  # the one model; set by the text server at start
        self.replicas: dict[Address, Replica] = {}
        self._channels: dict[Address, grpc.aio.Channel] = {}

    def _channel(self, address: Address, host: str | None) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options = list(RECONNECT_OPTIONS)
            if self.tls is not None and host is not None:  # the certificate names the host, not its address
                options.append(("grpc.ssl_target_name_override", host))
            channel = self._channels[address] = open_channel(address.target, self.tls, self.token, options=options)
        return channel

    async def ask_models(self) -> list[tuple[Address, str | None, ModelInfo]]:
        """Every address that answers GetModelInfo now: (address, replica id, model)."""
        addresses, host = await resolve(self.target)
        answers = await asyncio.gather(*(self._model_of(a, host) for a in addresses))
        return [(a, rid, info) for a, (rid, info, _) in zip(addresses, answers) if info is not None]

    async def _model_of(self, address: Address, host: str | None) -> tuple[str | None, ModelInfo | None, str]:
        stub = decode_pb2_grpc.DecoderStub(self._channel(address, host))
        try:
            call = stub.GetModelInfo(decode_pb2.GetModelInfoRequest(), timeout=self.timeout_s)
            pb = await call
            metadata = dict(await call.initial_metadata() or ())
        except grpc.aio.AioRpcError as error:
            return None, None, f"{error.code().name}: {error.details()}"
        return metadata.get(REPLICA_ID_KEY), model_info_from_pb(pb), ""

    async def _serving(self, address: Address, host: str | None, service: str) -> bool:
        try:
            response = await health_pb2_grpc.HealthStub(self._channel(address, host)).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def update(self) -> dict[Address, Replica]:
        """One round: resolve, ask every address, log what changed. Addresses no longer resolved
        are forgotten (their channels closed)."""
        addresses, host = await resolve(self.target)
        await asyncio.gather(*(self._update_one(a, host) for a in addresses))
        for gone in [a for a in self.replicas if a not in addresses]:
            log.info("decode replica %s is gone from %s", gone.name, self.target)
            del self.replicas[gone]
            await self._channels.pop(gone).close()
        return self.replicas

    async def _update_one(self, address: Address, host: str | None) -> None:
        replica = self.replicas.get(address)
        if replica is None:
            replica = self.replicas[address] = Replica(address)
        replica_id, info, why = await self._model_of(address, host)
        was = (replica.state, replica.replica_id)
        if info is None:
            state = "not_ready"
        else:
            replica.replica_id, replica.info = replica_id, info
            if self.reference is not None and model_identity(info) != model_identity(self.reference):
                state, why = "refused", f"serves {describe(info)}, not {describe(self.reference)}"
            elif await self._serving(address, host, model_service_name(info)):
                state, why = "ready", ""
            else:
                state, why = "not_ready", "not SERVING"
        replica.state, replica.why = state, why
        if (state, replica.replica_id) == was:
            return
        if state == "refused":  # a replica seen anew (or restarted) with another model
            log.error("decode replica %s %s: it gets no traffic", address.name, why)
        elif state == "ready":
            log.info("decode replica %s is ready (id %s)", address.name, replica.replica_id)
        elif was[0] == "ready":
            log.warning("decode replica %s is not ready: %s", address.name, why)
        else:  # not ready since it was first resolved (starting, or nothing listens there)
            log.info("decode replica %s is not ready yet: %s", address.name, why)

    def ready_ids(self) -> set[str]:
        return {r.replica_id for r in self.replicas.values() if r.state == "ready" and r.replica_id}

    def unready_ids(self) -> set[str]:
        """Ids last seen at an address that is not ready now (draining, stalled, gone, refused)."""
        return {r.replica_id for r in self.replicas.values() if r.state != "ready" and r.replica_id} - self.ready_ids()

    def names(self) -> dict[str, str]:
        """Replica id -> the address it answered at (how metrics and logs name a replica)."""
        return {r.replica_id: r.address.name for r in self.replicas.values() if r.replica_id}

    def counts(self) -> Counter:
        return Counter(r.state for r in self.replicas.values())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def choose_reference(answers: list[tuple[Address, str | None, ModelInfo]], fits) -> tuple[ModelInfo | None, list[str]]:
    """The one model among the replicas that answered at start: the one most of the replicas that
    `fits` (the tokenizer's check, raising on a misfit) serve, the first in address order on a
    tie. Returns it (None when none fits) and why each other replica was left out."""
    fitting: list[tuple[Address, ModelInfo]] = []
    left_out = []
    for address, _, info in answers:
        try:
            fits(info)
        except Exception as error:  # the tokenizer's ModelMismatch
            left_out.append(f"decode replica {address.name}: {error}")
            continue
        fitting.append((address, info))
    if not fitting:
        return None, left_out
    counts = Counter(model_identity(info) for _, info in fitting)
    best = max(counts.values())
    reference = next(info for _, info in fitting if counts[model_identity(info)] == best)
    for address, info in fitting:
        if model_identity(info) != model_identity(reference):
            left_out.append(f"decode replica {address.name} serves {describe(info)}, not {describe(reference)}")
    return reference, left_out
