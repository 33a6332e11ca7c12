"""Loopback ports for servers a test starts later (another process, a second or two away)."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

__all__ = ["free_port"]


def _ports_below_ephemeral() -> range:
    """Loopback ports no outgoing connection of this machine is given: below the kernel's
    ephemeral range (``ip_local_port_range``, 32768 by default on Linux)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10_000, max(10_001, low))


def free_port() -> int:
    """An unused loopback port, picked below the ephemeral range: a bind to port 0 hands out
    ephemeral ports, the ones client connections get too, so one could be taken by a test's
    own client socket before the server it is for binds it (``port_in_use``)."""
    ports = _ports_below_ephemeral()
    for _ in range(100):
        port = secrets.choice(ports)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:  # the low range is crowded: any free port
        probe.bind(("127.0.0.1", 0))
        found: int = probe.getsockname()[1]
        return found
