"""The gateway's HTTP/1.1 client to the engines of this host: kept-alive loopback connections
on asyncio protocols, each response parsed by httptools.

Why not aiohttp for this hop (it stays the client of peer hops, :mod:`sbproxy.api.peers`):
measured here (issue 31), one aiohttp ``POST`` with its response read cost ~95 us of CPU
against ~12 us for a protocol writing the request in one ``write`` and parsing the answer
with ``httptools.HttpResponseParser`` -- the parser uvicorn itself uses (``uvicorn[standard]``
installs it); the difference was most of what the gateway added over a bare pass-through.
An engine's hop needs little of what aiohttp offers: one method (``POST`` of a JSON body the
gateway holds whole), loopback plain HTTP, no cookies, redirects, proxies, TLS or
decompression (answers go to the client as the engine encoded them).

What it does keep, as :mod:`sbproxy.api.engine_client` describes for aiohttp:

* kept-alive connections per engine, reused most recently released first, and dropped after
  :data:`~sbproxy.api.engine_client.KEEPALIVE_S` idle, below the engines' own idle close;
* a request that fails on an established connection before any byte of its answer arrived
  (a kept-alive connection the engine had just closed) is sent once more on a new one; a
  connection that cannot be opened (:class:`EngineNotReached`, one of
  :data:`~sbproxy.api.engine_client.NOT_SENT`) is not retried;
* failures raise aiohttp's exception types, so the gateway and the relay tell them apart as
  before: :class:`EngineNotReached` (a :class:`aiohttp.ClientConnectionError`) when nothing
  was sent, :class:`aiohttp.ServerDisconnectedError` when the connection ended before the
  answer, :class:`aiohttp.ClientPayloadError` when it ended inside the body,
  :class:`aiohttp.ClientConnectionError` for a read after :meth:`EngineResponse.close`;
* a response closed before its end closes its connection, which is how the engine learns to
  stop generating; a cancelled request does the same;
* reading pauses while more than :data:`READ_BUFFER_BYTES` of a stream wait for the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Final, cast

import aiohttp
import httptools

from sbproxy.api.engine_client import KEEPALIVE_S, EngineNotReached

__all__ = ["READ_BUFFER_BYTES", "EngineNotReached", "EnginePool", "EngineResponse"]

# Bytes of a streamed body held for a slow client before the engine's socket stops being
# read (and the engine's writes back up in the kernel).
READ_BUFFER_BYTES: Final = 256 * 1024
# How long opening a connection to an engine may take, seconds.
CONNECT_TIMEOUT_S: Final = 10.0
# A request body shorter than this is written with its head in one buffer.
_JOIN_BELOW: Final = 64 * 1024


class _Body:
    """The ``content`` of an :class:`EngineResponse`: ``readany()`` as aiohttp's
    ``StreamReader`` has it."""

    __slots__ = ("_response",)

    def __init__(self, response: EngineResponse) -> None:
        self._response = response

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some when none
        did); ``b""`` at the end of the body.

        Raises:
            aiohttp.ClientPayloadError: the connection ended inside the body.
            aiohttp.ClientConnectionError: the response was closed.
        """
        return await self._response._next_chunk()


class EngineResponse:
    """One engine's answer, its status and headers read: the parts of
    :class:`aiohttp.ClientResponse` the gateway and :class:`~sbproxy.api.relay.StreamRelay`
    use (``status``, ``content_type``, ``headers``, ``read()``, ``content.readany()``,
    ``release()``, ``close()``).

    Attributes:
        status: The HTTP status.
        headers: Header values by lowercased name (the last of repeated ones).
        content_type: The media type, lowercased, without parameters
            (``application/octet-stream`` when absent, as aiohttp reports it).
    """

    __slots__ = (
        "_chunks",
        "_connection",
        "_done",
        "_error",
        "_held",
        "_waiter",
        "content",
        "content_type",
        "headers",
        "status",
    )

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self._connection: _Connection | None = connection
        self.status = status
        self.headers = headers
        media = headers.get("content-type")
        self.content_type = (
            media.partition(";")[0].strip().lower() if media else "application/octet-stream"
        )
        self.content = _Body(self)
        self._chunks: list[bytes] = []
        self._held = 0
        self._done = False
        self._error: aiohttp.ClientError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection ---------------------------------------------------------------

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._held += len(chunk)
        if self._held > READ_BUFFER_BYTES and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, error: aiohttp.ClientError) -> None:
        if not self._done and self._error is None:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _next_chunk(self) -> bytes:
        while True:
            if self._chunks:
                chunks, self._chunks = self._chunks, []
                if self._held > READ_BUFFER_BYTES and self._connection is not None:
                    self._connection.resume()
                self._held = 0
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter

    # -- the caller's side ---------------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body (what is left of it).

        Raises:
            aiohttp.ClientPayloadError: the connection ended inside the body.
            aiohttp.ClientConnectionError: the response was closed.
        """
        parts: list[bytes] = []
        while chunk := await self._next_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool when the body was
        read to its end and the engine keeps it alive, else it is closed (idempotent)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(self, reuse=self._done and self._error is None)

    def close(self) -> None:
        """Close the connection now (the engine stops generating); a pending or later read
        raises :class:`aiohttp.ClientConnectionError` (idempotent)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.finished(self, reuse=False)
        if not self._done:
            self._fail(aiohttp.ClientConnectionError("Connection closed"))


class _Connection(asyncio.Protocol):
    """One kept-alive connection to an engine and the exchange on it (one at a time)."""

    def __init__(self, pool: EnginePool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        # The exchange in flight: the answer's head, then its body.
        self._head: asyncio.Future[EngineResponse] | None = None
        self._response: EngineResponse | None = None
        self._headers: dict[str, str] = {}
        self._name = b""
        self._received = False
        self._paused = False
        self._keep_alive = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # Not a connection the engine closed: the answer itself is wrong (never resent).
            self._lost(aiohttp.ClientPayloadError(f"malformed answer from the engine: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self._response
        if response is not None and not response._done and self._until_close():
            response._finish()  # a body delimited by the end of the connection
            return
        if self._head is not None or response is not None:
            if self._received or response is not None:
                error: aiohttp.ClientError = aiohttp.ClientPayloadError(
                    "the engine closed the connection inside its answer"
                )
            else:
                error = aiohttp.ServerDisconnectedError()
            self._lost(error)

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an informational answer: the real one follows
            self._headers = {}
            return
        # Asked now: once the message is complete the parser has reset for the next one.
        self._keep_alive = self.parser.should_keep_alive()
        response = EngineResponse(self, status, self._headers)
        self._headers = {}
        self._response = response
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._finish()

    # -- the pool's side ----------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[EngineResponse]:
        """Write one request; the future of its answer's head."""
        assert self.transport is not None  # noqa: S101 - connected before it is handed out
        future = self._head = asyncio.get_running_loop().create_future()
        self._received = False
        if len(body) < _JOIN_BELOW:
            self.transport.write(head + body)  # one write, one segment
        else:
            self.transport.writelines((head, body))  # no copy of a large body
        return future

    def finished(self, response: EngineResponse, *, reuse: bool) -> None:
        """The caller is done with ``response``: keep the connection or close it."""
        if self._response is response:
            self._response = None
        if reuse and not self.closed and self._keep_alive:
            self.resume()
            self.pool.keep(self)
        else:
            self.abort()
            self.pool.forget(self)

    def abort(self) -> None:
        """Close the connection at once (its exchange, if any, fails)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def _until_close(self) -> bool:
        headers = self._response.headers if self._response is not None else {}
        return "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", ""
        )

    def _lost(self, error: aiohttp.ClientError) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        response = self._response
        if response is not None:
            response._fail(error)


class EnginePool:
    """Kept-alive connections to the engines of this host, by ``(host, port)``.

    Create it on the serving loop; :meth:`close` closes every connection.

    Args:
        keepalive_s: How long an idle connection is kept, seconds.
        connect_timeout_s: How long opening a connection may take, seconds.
        clock: A monotonic clock (seconds; :func:`time.monotonic` by default); tests pass
            their own.
    """

    def __init__(
        self,
        *,
        keepalive_s: float = KEEPALIVE_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._clock = clock
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._heads: dict[tuple[str, int, str], bytes] = {}
        self.opened = 0  # connections opened (for tests and metrics)

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def _request_head(self, host: str, port: int, path: str) -> bytes:
        key = (host, port, path)
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= 256:
                self._heads.clear()
            head = self._heads[key] = (
                f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
        return head

    async def post(
        self, host: str, port: int, path: str, body: bytes, *, resend: bool = True
    ) -> EngineResponse:
        """POST the JSON ``body`` to ``path`` of the engine at ``host:port``; the response
        with its status and headers read (its body to read, then :meth:`EngineResponse.release`
        or :meth:`EngineResponse.close` it).

        Sent a second time, on a new connection, when the first try failed on an
        established connection before any byte of the answer (with ``resend``).

        Raises:
            EngineNotReached: no connection could be opened.
            aiohttp.ServerDisconnectedError: the connection ended before the answer (twice,
                with ``resend``); also when a resend could not open a connection (the first
                try may have reached the engine).
            aiohttp.ClientPayloadError: the engine's answer was malformed.
        """
        head = self._request_head(host, port, path) + b"%d\r\n\r\n" % len(body)
        try:
            return await self._exchange((host, port), head, body)
        except EngineNotReached:
            raise
        except aiohttp.ServerDisconnectedError:
            if not resend:
                raise
        try:
            return await self._exchange((host, port), head, body)
        except EngineNotReached as exc:
            raise aiohttp.ServerDisconnectedError(f"resend failed: {exc}") from exc

    async def _exchange(self, key: tuple[str, int], head: bytes, body: bytes) -> EngineResponse:
        connection = self._take(key) or await self._open(key)
        # In use from here until its response is released or closed (or it fails).
        self._busy.add(connection)
        try:
            return await connection.send(head, body)
        except BaseException:
            # Failed, or cancelled (the client left, a limit ran out): the engine must not
            # go on with a request nobody waits for.
            connection.abort()
            self._busy.discard(connection)
            raise

    def _take(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self._now()
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            if now - connection.idle_since > self.keepalive_s:
                connection.abort()
                continue
            return connection
        return None

    async def _open(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(
                    lambda: _Connection(self, key), key[0], key[1]
                )
        except (OSError, TimeoutError) as exc:
            raise EngineNotReached(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        self.opened += 1
        return protocol

    def keep(self, connection: _Connection) -> None:
        """Put ``connection`` back among the idle ones."""
        self._busy.discard(connection)
        connection.idle_since = self._now()
        idle = self._idle.setdefault(connection.key, [])
        # Drop the idle ones past their keep-alive (the oldest are first).
        while idle and connection.idle_since - idle[0].idle_since > self.keepalive_s:
            idle.pop(0).abort()
        idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        """``connection`` closed (or is closing): it is no longer handed out."""
        self._busy.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def idle_connections(self) -> int:
        """How many idle connections are kept."""
        return sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        """Close every connection, idle or in use."""
        for idle in self._idle.values():
            for connection in idle:
                connection.abort()
        self._idle.clear()
        for connection in list(self._busy):
            connection.abort()
        self._busy.clear()
