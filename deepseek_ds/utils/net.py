"""Ports on this host."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it), for a launch's rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
