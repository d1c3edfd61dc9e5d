"""Transport security for the gRPC servers and their clients: TLS, mutual TLS, bearer tokens.

  * `ServerTlsConfig` -> `grpc.ssl_server_credentials`: the server's certificate and key, and
    with `client_ca` mutual TLS, where a client without a certificate signed by that CA is
    refused during the handshake (the client sees UNAVAILABLE; no handler runs).
  * `ClientTlsConfig` -> `grpc.ssl_channel_credentials`: the CA to trust (default: the system
    roots) and, for mutual TLS, the client's certificate and key. `credentials(token)` also
    attaches a bearer token to every call as call credentials.
  * `BearerTokenInterceptor`: every RPC must carry `authorization: Bearer <token>` metadata,
    compared in constant time, or ends UNAUTHENTICATED before its handler runs. Health checks
    and reflection pass without it, so probes and tooling work.

Tokens travel over TLS through `ClientTlsConfig.credentials`, or to a loopback address through
`local_credentials` (gRPC itself refuses to send call credentials in plaintext); a server with a
token refuses to start without TLS unless it binds only loopback (`check_server_auth`). Tokens
come from flags, variables or files (`read_token_file`, for compose and Kubernetes secrets);
`bearer_metadata` gives the raw metadata for a caller that knows its channel is private. Files are read when credentials are built, at server or channel
start, and a missing or unreadable file is a `TlsError` naming its role and path.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.handlers import rewrap

# Methods reachable without a token: liveness/readiness probes and schema discovery.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)


class TlsError(ValueError):
    """TLS settings are incomplete, or a certificate/key file cannot be read."""


def _read(path: Path, role: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TlsError(f"cannot read the {role} {path}: {error.strerror or error}") from None
    if not data.strip():
        raise TlsError(f"the {role} {path} is empty")
    return data


@dataclass(frozen=True)
class ServerTlsConfig:
    cert: Path  # PEM certificate chain the server presents (leaf first)
    key: Path  # PEM private key of that certificate
    client_ca: Path | None = None  # set: mutual TLS; clients must present a certificate signed by it

    @staticmethod
    def from_paths(cert: str | Path | None, key: str | Path | None, client_ca: str | Path | None = None) -> "ServerTlsConfig | None":
        """From optional flag values: None when TLS is off (nothing set); TlsError when half set."""
        if cert is None and key is None:
            if client_ca is not None:
                raise TlsError("a client CA (mutual TLS) needs the server's TLS certificate and key too")
            return None
        if cert is None or key is None:
            raise TlsError("TLS needs both the server certificate and its private key")
        return ServerTlsConfig(Path(cert), Path(key), Path(client_ca) if client_ca is not None else None)

    def credentials(self) -> grpc.ServerCredentials:
        """Read the files and build server credentials (client auth required when `client_ca`)."""
        pair = (_read(self.key, "TLS private key"), _read(self.cert, "TLS certificate"))
        client_ca = _read(self.client_ca, "TLS client CA file") if self.client_ca is not None else None
        return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


@dataclass(frozen=True)
class ClientTlsConfig:
    ca: Path | None = None  # CA that signed the server's certificate; None = the system roots
    cert: Path | None = None  # client certificate, for servers that require mutual TLS
    key: Path | None = None  # its private key

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TlsError("a TLS client certificate needs its private key, and the other way round")

    @staticmethod
    def from_paths(ca: str | Path | None, cert: str | Path | None = None, key: str | Path | None = None) -> "ClientTlsConfig | None":
        """From optional flag values: None when TLS is off (nothing set)."""
        if ca is None and cert is None and key is None:
            return None
        return ClientTlsConfig(*(Path(p) if p is not None else None for p in (ca, cert, key)))

    def credentials(self, token: str | None = None) -> grpc.ChannelCredentials:
        """Channel credentials; with `token`, every call also carries `authorization: Bearer <token>`."""
        ca = _read(self.ca, "TLS CA file") if self.ca is not None else None
        key = _read(self.key, "TLS client private key") if self.key is not None else None
        cert = _read(self.cert, "TLS client certificate") if self.cert is not None else None
        channel = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        if token is None:
            return channel
        return grpc.composite_channel_credentials(channel, grpc.access_token_call_credentials(_check_token(token)))


def local_credentials(token: str) -> grpc.ChannelCredentials:
    """For a loopback target without TLS: gRPC's local credentials (the peer must be on this
    host) carrying `token` on every call."""
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    return grpc.composite_channel_credentials(local, grpc.access_token_call_credentials(_check_token(token)))


def is_loopback_host(host: str) -> bool:
    """A bind address or host name that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token_file(path: str | Path, role: str) -> str:
    """A token from a file (a compose or Kubernetes secret): its text without the final newline.
    TlsError naming `role` and the path when it cannot be read or holds no token."""
    token = _read(Path(path), role).decode("utf-8", errors="replace").rstrip("\r\n")
    try:
        return _check_token(token)
    except ValueError as error:
        raise TlsError(f"the {role} {path}: {error}") from None


def check_server_auth(token: str | None, tls: "ServerTlsConfig | None", host: str) -> None:
    """A server refuses to start with a token it would receive in plain text over a network:
    a token needs TLS unless the server binds only a loopback address."""
    if token is not None and tls is None and not is_loopback_host(host):
        raise TlsError(
            f"--auth-token without TLS on {host} would take tokens in plain text from the network: "
            "set --tls-cert and --tls-key, or bind a loopback address (--host 127.0.0.1)"
        )


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying `token`, for `stub.Method(request, metadata=...)`."""
    return (("authorization", f"Bearer {_check_token(token)}"),)


def _check_token(token: str) -> str:
    if not token or token != token.strip() or not token.isprintable():
        raise ValueError("a bearer token must be non-empty printable text without surrounding spaces")
    return token


# -- server side --------------------------------------------------------------------------


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse, with UNAUTHENTICATED, RPCs without `authorization: Bearer <token>`.

    Methods under `open_prefixes` (health, reflection) pass without a token. A refused call
    never reaches its handler and its request is not even deserialized.
    """

    def __init__(self, token: str, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._expected = _check_token(token).encode()
        self._open = open_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self._open):
            return await continuation(handler_call_details)
        problem = self._problem(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:  # an unknown method stays UNIMPLEMENTED
            return handler
        return _refusing(handler, problem)

    def _problem(self, metadata) -> str | None:
        """None when a valid token is present, else what is wrong (never echoing the token)."""
        values = [value for key, value in metadata if key == "authorization"]
        if not values:
            return "missing authorization metadata: send 'authorization: Bearer <token>'"
        for value in values:
            scheme, _, token = str(value).partition(" ")
            # compare_digest takes time independent of where the tokens differ
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected):
                return None
        return "invalid bearer token"


def _refusing(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    # no deserializer: the unauthenticated request stays bytes and is never parsed
    return rewrap(handler, lambda _behaviour: refuse, request_deserializer=None)
