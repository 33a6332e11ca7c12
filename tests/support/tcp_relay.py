"""A TCP relay on loopback that a test can cut: one host's way to a real server (its
PostgreSQL) goes through it, so that this host alone is partitioned from the database while
every other host still reaches it -- a fault one real server cannot make for one client.

Two faults, each until :meth:`TcpRelay.heal`:

* :meth:`TcpRelay.cut` -- a *refused* link: every open connection is closed and a new one is
  closed as soon as it is accepted (the client learns at once);
* :attr:`TcpRelay.cut_after` -- a link that breaks *mid-answer*: each connection is closed
  once this many bytes came from the server (a peer failing mid-transfer);
* :meth:`TcpRelay.blackhole` -- a *silent* link, as a dropped route or a dead switch makes
  it: connections stay open and new ones are accepted, but every byte either way is read
  and dropped, so a client waits on an answer that never comes (its kernel sees its bytes
  acknowledged, so only a deadline of its own ends the wait).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType
from typing import Self

__all__ = ["TcpRelay"]


class TcpRelay:
    """Relay ``127.0.0.1:<port>`` to ``target_port`` (a background thread per connection)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._cut = threading.Event()
        self._hole = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.cut_after: int | None = None
        """Close each connection once this many bytes came from the server (``None``: no
        limit); read when a connection opens."""
        self.cut_times: int | None = None
        """With :attr:`cut_after`: cut only this many connections (``None``: every one)."""
        self.refused = 0
        """Connections closed at once because the link was cut."""
        self.dropped = 0
        """Bytes read and dropped while blackholed, either way (a test waits for a client's
        statement to be lost in the hole before it heals the link)."""
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def cut(self) -> None:
        """Close every relayed connection and refuse new ones until :meth:`heal`."""
        self._cut.set()
        self._close_open()

    def blackhole(self) -> None:
        """Drop every byte either way (open connections included), without closing anything,
        until :meth:`heal`."""
        self._hole.set()

    @property
    def faulty(self) -> bool:
        """Whether the link is cut or blackholed now."""
        return self._cut.is_set() or self._hole.is_set()

    def heal(self) -> None:
        """Relay connections again (a blackholed connection's dropped bytes stay lost)."""
        self._cut.clear()
        self._hole.clear()

    def close(self) -> None:
        self._closed.set()
        self._cut.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._close_open()

    def _close_open(self) -> None:
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                with self._lock:
                    self.refused += 1
                continue
            if self._hole.is_set():
                # Accepted and held open, never answered: the client's connect succeeds and
                # its first message (the startup packet) is read and dropped.
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _swallow(self, client: socket.socket) -> None:
        """Read and drop what ``client`` sends while the link is blackholed; relay nothing.
        After a heal the connection is closed (its handshake was lost)."""
        with self._lock:
            self._open.add(client)
        try:
            client.settimeout(0.2)
            while self._hole.is_set() and not self._closed.is_set():
                try:
                    data = client.recv(65536)
                    if not data:
                        return
                    self._drop(data)
                except TimeoutError:
                    continue
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                client.close()

    def _drop(self, data: bytes) -> None:
        with self._lock:
            self.dropped += len(data)

    def _passing(self, client: socket.socket, *, from_client: bool) -> None:
        """Called before bytes of ``client``'s connection are relayed (from the client when
        ``from_client``, else from the server): a subclass observes the traffic here."""

    def _cut_limit(self) -> int | None:
        """The server bytes a new connection may carry (:attr:`cut_after`, counting
        :attr:`cut_times` down); ``None``: no limit."""
        with self._lock:
            if self.cut_after is None or self.cut_times is None:
                return self.cut_after
            if self.cut_times <= 0:
                return None
            self.cut_times -= 1
            return self.cut_after

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        peers = {client: upstream, upstream: client}
        left = self._cut_limit()
        try:
            for sock in peers:
                sock.setblocking(True)
                selector.register(sock, selectors.EVENT_READ)
            while not self._cut.is_set():
                for key, _ in selector.select(timeout=0.2):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = source.recv(65536)
                    if not data:
                        return
                    if self._hole.is_set():
                        self._drop(data)
                    else:
                        self._passing(client, from_client=source is client)
                        if left is not None and source is upstream:
                            if len(data) >= left:
                                client.sendall(data[:left])
                                return
                            left -= len(data)
                        peers[source].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            for sock in peers:
                with contextlib.suppress(OSError):
                    sock.close()
