"""TLS, mutual TLS and bearer-token auth over real grpc.aio servers on 127.0.0.1.

Certificates are made once per session with the `openssl` CLI (a CA, a server certificate for
IP:127.0.0.1 and DNS:localhost, a client certificate, and an unrelated CA), valid for two days.
The servers run grpcio-health-checking's servicer twice: as the real health service (open
without a token) and under another name, `tokenwire.test.Protected`, standing in for any
authenticated service.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from services.channels import open_channel
from services.health_probe import health_check
from services.security import (
    BearerTokenInterceptor,
    ClientTlsConfig,
    ServerTlsConfig,
    TlsError,
    bearer_metadata,
)

TOKEN = "s3cret-token"
PROTECTED = "tokenwire.test.Protected"
SERVING = health_pb2.HealthCheckResponse.SERVING

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI makes the test certificates")


@contextlib.asynccontextmanager
async def serving(credentials: grpc.ServerCredentials | None = None, interceptors=()):
    """A server with health, reflection and the protected copy; yields its 127.0.0.1 target."""
    server = grpc.aio.server(interceptors=list(interceptors))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(PROTECTED, {
            "Check": grpc.unary_unary_rpc_method_handler(
                servicer.Check, health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
            ),
            "Watch": grpc.unary_stream_rpc_method_handler(
                servicer.Watch, health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
            ),
        })
    ])
    reflection.enable_server_reflection([PROTECTED, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    await servicer.set("", SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _protected_check(channel: grpc.aio.Channel):
    return channel.unary_unary(
        f"/{PROTECTED}/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )


async def _health(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


# -- TLS and mutual TLS ---------------------------------------------------------------------


async def test_tls_works_with_the_right_ca_only(pki):
    async with serving(ServerTlsConfig(pki / "server.crt", pki / "server.key").credentials()) as target:
        async with open_channel(target, ClientTlsConfig(ca=pki / "ca.crt")) as channel:
            assert await _health(channel) == SERVING
        async with open_channel(target, ClientTlsConfig(ca=pki / "other-ca.crt")) as channel:
            assert (await _refused(_health(channel))).code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(target) as channel:  # plaintext to a TLS port
            assert (await _refused(_health(channel))).code() == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    tls = ServerTlsConfig.from_paths(pki / "server.crt", pki / "server.key", pki / "ca.crt")
    async with serving(tls.credentials()) as target:
        async with open_channel(target, ClientTlsConfig(ca=pki / "ca.crt")) as channel:
            assert (await _refused(_health(channel))).code() == grpc.StatusCode.UNAVAILABLE
        with_cert = ClientTlsConfig(ca=pki / "ca.crt", cert=pki / "client.crt", key=pki / "client.key")
        async with open_channel(target, with_cert) as channel:
            assert await _health(channel) == SERVING


async def test_mutual_tls_refuses_a_certificate_from_another_ca(pki):
    tls = ServerTlsConfig(pki / "server.crt", pki / "server.key", pki / "ca.crt")
    async with serving(tls.credentials()) as target:
        rogue = ClientTlsConfig(ca=pki / "ca.crt", cert=pki / "rogue.crt", key=pki / "rogue.key")
        async with open_channel(target, rogue) as channel:
            assert (await _refused(_health(channel))).code() == grpc.StatusCode.UNAVAILABLE


# -- bearer tokens --------------------------------------------------------------------------


async def test_bearer_auth_refuses_missing_and_wrong_tokens():
    async with serving(interceptors=[BearerTokenInterceptor(TOKEN)]) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            check = _protected_check(channel)
            request = health_pb2.HealthCheckRequest()
            missing = await _refused(check(request))
            assert missing.code() == grpc.StatusCode.UNAUTHENTICATED and "missing" in missing.details()
            for metadata in (bearer_metadata("wrong-token"), (("authorization", TOKEN),), (("authorization", f"Basic {TOKEN}"),)):
                wrong = await _refused(check(request, metadata=metadata))
                assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "wrong-token" not in wrong.details()  # never echoed back
            assert (await check(request, metadata=bearer_metadata(TOKEN))).status == SERVING
            assert (await check(request, metadata=(("authorization", f"bearer {TOKEN}"),))).status == SERVING

            stream = channel.unary_stream(
                f"/{PROTECTED}/Watch",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stream(request):
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = stream(request, metadata=bearer_metadata(TOKEN))
            assert (await call.read()).status == SERVING
            call.cancel()


async def test_health_and_reflection_pass_without_a_token():
    async with serving(interceptors=[BearerTokenInterceptor(TOKEN)]) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            assert await _health(channel) == SERVING
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            async for response in call:
                names = {s.name for s in response.list_services_response.service}
                assert PROTECTED in names
        status = await asyncio.to_thread(health_check, target, "", 5.0)
        assert status == 0


async def test_token_as_call_credentials_over_tls_with_probe(pki):
    tls = ServerTlsConfig(pki / "server.crt", pki / "server.key")
    async with serving(tls.credentials(), interceptors=[BearerTokenInterceptor(TOKEN)]) as target:
        client = ClientTlsConfig(ca=pki / "ca.crt")
        request = health_pb2.HealthCheckRequest()
        async with open_channel(target, client, token=TOKEN) as channel:
            assert (await _protected_check(channel)(request)).status == SERVING
        async with open_channel(target, client, token="not-it") as channel:
            assert (await _refused(_protected_check(channel)(request))).code() == grpc.StatusCode.UNAUTHENTICATED
        # the probe needs TLS to reach the server, and no token
        assert await asyncio.to_thread(health_check, target, "", 5.0, 0.0, client) == 0
        assert await asyncio.to_thread(health_check, target, "", 2.0) == 1  # plaintext to a TLS port


# -- configuration errors -------------------------------------------------------------------


def test_missing_and_unreadable_files_are_named(pki, tmp_path):
    missing = tmp_path / "nope.key"
    with pytest.raises(TlsError, match=r"TLS private key .*nope\.key"):
        ServerTlsConfig(pki / "server.crt", missing).credentials()
    empty = tmp_path / "empty.crt"
    empty.write_text("")
    with pytest.raises(TlsError, match=r"TLS client CA file .*empty\.crt.* empty"):
        ServerTlsConfig(pki / "server.crt", pki / "server.key", empty).credentials()
    with pytest.raises(TlsError, match=r"TLS CA file .*nope\.key"):
        ClientTlsConfig(ca=missing).credentials()
    with pytest.raises(TlsError, match="is a directory|cannot read"):
        ClientTlsConfig(ca=tmp_path).credentials()


def test_incomplete_settings_are_refused():
    assert ServerTlsConfig.from_paths(None, None) is None
    assert ClientTlsConfig.from_paths(None) is None
    with pytest.raises(TlsError, match="both"):
        ServerTlsConfig.from_paths("server.crt", None)
    with pytest.raises(TlsError, match="client CA"):
        ServerTlsConfig.from_paths(None, None, "ca.crt")
    with pytest.raises(TlsError, match="private key"):
        ClientTlsConfig(cert=Path("client.crt"))
    with pytest.raises(TlsError, match="only over TLS or to a loopback address"):
        open_channel("10.0.0.1:1", None, token=TOKEN)
    for bad in ("", " padded ", "line\nbreak"):
        with pytest.raises(ValueError):
            BearerTokenInterceptor(bad)
