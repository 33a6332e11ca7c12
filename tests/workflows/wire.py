"""A loopback TCP relay that counts round trips on each connection through it.

A journal opened through :class:`RoundTripCounter` talks to its real PostgreSQL server as
before; the relay (:class:`~tests.support.tcp_relay.TcpRelay`) only passes bytes on, and
counts. A *round trip* here is what a client waits for: bytes from the client that follow an
answer from the server (or open the connection) begin one; more client bytes before the
server answers are part of the same one (a message split over two writes, a pipeline sent in
one go). PostgreSQL sends nothing before a ``Sync`` or a simple ``Query`` is complete, so a
statement sent alone is one round trip, and a client that waits for each of two statements
makes two, whatever its driver.
"""

from __future__ import annotations

import socket

from tests.support.tcp_relay import TcpRelay

__all__ = ["RoundTripCounter"]


class RoundTripCounter(TcpRelay):
    """Relay ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``, counting round trips.

    Attributes:
        port: The port to connect to instead of the server's.
    """

    def __init__(self, target_port: int) -> None:
        # Per relayed connection: round trips begun, and whether the server answered last.
        self._counts: dict[socket.socket, list[int]] = {}
        self._answered: dict[socket.socket, bool] = {}
        super().__init__(target_port)

    def url(self, server_url: str, server_port: int) -> str:
        """``server_url`` (a ``postgresql://`` URL to ``server_port``) through this relay."""
        return server_url.replace(f":{server_port}/", f":{self.port}/", 1)

    def total(self) -> int:
        """Round trips begun so far, every connection together."""
        with self._lock:
            return sum(count[0] for count in self._counts.values())

    def _passing(self, client: socket.socket, *, from_client: bool) -> None:
        # Counted before the bytes go on: once the client has its answer, the round trip
        # that brought it is already counted. The first client bytes begin one.
        with self._lock:
            count = self._counts.setdefault(client, [0])
            if from_client and self._answered.get(client, True):
                count[0] += 1
            self._answered[client] = not from_client
