"""Loopback ports for servers a test starts later (another process, a second or two away)."""

from __future__ import annotations

import os
import secrets
import socket
from collections import deque
from pathlib import Path

__all__ = ["free_port"]

# The ports this process handed out last: not handed out again while their servers may not
# have bound them yet (a fleet test picks a dozen before it starts any host).
_handed_out: deque[int] = deque(maxlen=1024)


def _ports_below_ephemeral() -> range:
    """Loopback ports no outgoing connection of this machine is given: below the kernel's
    ephemeral range (``ip_local_port_range``, 32768 by default on Linux)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10_000, max(10_001, low))


def _this_workers_ports() -> range:
    """This pytest-xdist worker's share of :func:`_ports_below_ephemeral` (the whole range
    outside xdist): workers never pick each other's ports."""
    ports = _ports_below_ephemeral()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count <= 1:
        return ports
    share = len(ports) // count
    index = int(worker[2:]) % count
    return range(ports.start + index * share, ports.start + (index + 1) * share)


def free_port() -> int:
    """An unused loopback port, picked below the ephemeral range: a bind to port 0 hands out
    ephemeral ports, the ones client connections get too, so one could be taken by a test's
    own client socket before the server it is for binds it (``port_in_use``). Each xdist
    worker picks from its own share of the range, and one process does not hand out any of
    its last 1,024 ports again, so two servers of one test (or of two workers) do not get
    the same port."""
    ports = _this_workers_ports()
    for _ in range(200):
        port = secrets.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    with socket.socket() as probe:  # the low range is crowded: any free port
        probe.bind(("127.0.0.1", 0))
        found: int = probe.getsockname()[1]
        return found
