"""Running the app: uvicorn, with TLS (and client certificates) when configured, and a graceful
stop on SIGTERM: uvicorn stops accepting, waits up to the grace period for in-flight requests
(streams included), then closes the rest, which cancels their generations.
"""

from __future__ import annotations

import signal
import ssl

import uvicorn

from services.config import ApiServerConfig
from services.openai_api.app import ApiOptions, create_app


def uvicorn_config(config: ApiServerConfig, app) -> uvicorn.Config:
    tls = config.tls
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,  # the process's own logging (services.cli.configure_logging)
        timeout_graceful_shutdown=config.grace_period_s,
        ssl_certfile=str(tls.cert) if tls else None,
        ssl_keyfile=str(tls.key) if tls else None,
        ssl_ca_certs=str(tls.client_ca) if tls and tls.client_ca else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca else ssl.CERT_NONE,
    )


def api_options(config: ApiServerConfig) -> ApiOptions:
    return ApiOptions(
        text_target=config.text,
        model_name=config.served_model_name,
        text_tls=config.text_tls,
        text_token=config.text_token,
        auth_token=config.auth_token,
        request_timeout_s=config.request_timeout_s,
    )


def serve(config: ApiServerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain; 0 after a clean stop."""
    server = uvicorn.Server(uvicorn_config(config, create_app(api_options(config))))
    # uvicorn re-raises the signal that stopped it once it has restored the handlers it found;
    # ignored here, so a drained server exits 0 as the gRPC servers do
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    server.run()
    return 0 if server.started else 2
