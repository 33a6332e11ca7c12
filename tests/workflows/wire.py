"""A loopback TCP relay that counts round trips on each connection through it.

A journal opened through :class:`RoundTripCounter` talks to its real PostgreSQL server as
before; the relay only passes bytes on, and counts. A *round trip* here is what a client
waits for: bytes from the client that follow an answer from the server (or open the
connection) begin one; more client bytes before the server answers are part of the same
one (a message split over two writes, a pipeline sent in one go). PostgreSQL sends nothing
before a ``Sync`` or a simple ``Query`` is complete, so a statement sent alone is one round
trip, and a client that waits for each of two statements makes two, whatever its driver.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType

__all__ = ["RoundTripCounter"]


class RoundTripCounter:
    """Relay ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>``, counting round trips.

    Attributes:
        port: The port to connect to instead of the server's.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        # Round trips begun so far on each relayed connection, in the order they opened.
        self._counts: list[int] = []
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> RoundTripCounter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def url(self, server_url: str, server_port: int) -> str:
        """``server_url`` (a ``postgresql://`` URL to ``server_port``) through this relay."""
        return server_url.replace(f":{server_port}/", f":{self.port}/", 1)

    def total(self) -> int:
        """Round trips begun so far, every connection together."""
        with self._lock:
            return sum(self._counts)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                return
            with self._lock:
                index = len(self._counts)
                self._counts.append(0)
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, index), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket, index: int) -> None:
        selector = selectors.DefaultSelector()
        peers = {client: upstream, upstream: client}
        answered = True  # the first client bytes begin a round trip
        try:
            for sock in peers:
                sock.setblocking(True)
                selector.register(sock, selectors.EVENT_READ)
            while not self._closed.is_set():
                for key, _ in selector.select(timeout=0.2):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        return
                    # Counted before the bytes go on: once the client has its answer, the
                    # round trip that brought it is already counted.
                    if source is client and answered:
                        with self._lock:
                            self._counts[index] += 1
                    answered = source is upstream
                    peers[source].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            for sock in peers:
                with contextlib.suppress(OSError):
                    sock.close()
