"""`free_port`: a loopback port nothing listens on, for a server a test starts at a known address."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that was free a moment ago (the OS picks it; another process could take it
    before the caller binds it, which on loopback in a test run it does not)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
