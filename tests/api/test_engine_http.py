"""The gateway's client to this host's engines (``sbproxy/api/engine_http.py``) against real
loopback HTTP/1.1 servers: kept-alive reuse, the resend on a connection the engine closed,
streams read as they come, and every way an exchange can end early closing its connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from sbproxy.api.engine_client import KEEPALIVE_S, NOT_SENT, EngineNotReached
from sbproxy.api.engine_http import READ_BUFFER_BYTES, EnginePool
from tests.api.idle_engine import idle_closing_engine

pytestmark = pytest.mark.anyio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHAT = "/v1/chat/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def plain(body: bytes, *, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def engine(handler: Handler) -> AsyncIterator[int]:
    """A loopback server running ``handler`` per connection; its port."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]
        for task in list(tasks):
            task.cancel()


async def test_kept_alive_connections_are_reused() -> None:
    seen: list[bytes] = []
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            head, body = await read_request(reader)
            assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"\r\nContent-Type: application/json\r\n" in head
            seen.append(body)
            writer.write(plain(b'{"n":%d}' % len(seen)))

    async with engine(handler) as port:
        pool = EnginePool()
        for n in (1, 2, 3):
            response = await pool.post("127.0.0.1", port, CHAT, b'{"q":%d}' % n)
            assert response.status == 200
            assert response.content_type == "application/json"
            assert await response.read() == b'{"n":%d}' % n
            response.release()
        await pool.close()
    assert seen == [b'{"q":1}', b'{"q":2}', b'{"q":3}']
    assert connections == 1
    assert pool.opened == 1


async def test_a_request_on_a_connection_the_engine_closed_is_sent_again() -> None:
    async with idle_closing_engine() as (idle, url):
        pool = EnginePool()
        assert url.port is not None
        first = await pool.post("127.0.0.1", url.port, CHAT, b'{"n": 1}')
        assert await first.read() == b'{"object": "chat.completion", "n": 1}'
        first.release()  # back to the pool: the next request reuses this connection
        second = await pool.post("127.0.0.1", url.port, CHAT, b'{"n": 2}')
        assert await second.read() == b'{"object": "chat.completion", "n": 2}'
        second.release()
        await pool.close()
    assert idle.answered == [b'{"n": 1}', b'{"n": 2}']
    assert idle.reset == 1  # the second request met the closed connection, then a new one
    assert idle.connections == 2


async def test_a_peer_style_post_without_resend_fails_on_a_closed_connection() -> None:
    async with idle_closing_engine() as (idle, url):
        pool = EnginePool()
        assert url.port is not None
        first = await pool.post("127.0.0.1", url.port, CHAT, b"{}")
        await first.read()
        first.release()
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await pool.post("127.0.0.1", url.port, CHAT, b"{}", resend=False)
        await pool.close()
    assert idle.answered == [b"{}"]


async def test_an_engine_that_is_gone_is_not_tried_twice() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    pool = EnginePool()
    with pytest.raises(EngineNotReached) as caught:
        await pool.post("127.0.0.1", port, CHAT, b"{}")
    assert isinstance(caught.value, NOT_SENT)  # the gateway says "not reached"
    assert pool.opened == 0


async def test_a_stream_is_read_chunk_by_chunk_as_the_engine_writes_it() -> None:
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n")
        )
        await go_on.wait()  # the second event only once the first was read
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await reader.read()  # kept alive until the client closes

    async with engine(handler) as port:
        pool = EnginePool()
        response = await pool.post("127.0.0.1", port, CHAT, b'{"stream":true}')
        assert response.content_type == "text/event-stream"
        assert await response.content.readany() == b"data: 1\n\n"
        go_on.set()
        assert await response.content.readany() == b"data: [DONE]\n\n"
        assert await response.content.readany() == b""
        response.release()
        assert pool.idle_connections() == 1  # read to its end: kept
        await pool.close()


async def test_closing_a_response_wakes_its_read_and_closes_the_connection() -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n")
        )
        await reader.read()  # EOF: the gateway closed the connection (the engine stops)
        closed.set()

    async with engine(handler) as port:
        pool = EnginePool()
        response = await pool.post("127.0.0.1", port, CHAT, b"{}")
        assert await response.content.readany() == b"data: 1\n\n"
        pending = asyncio.ensure_future(response.content.readany())
        await asyncio.sleep(0)  # the read is waiting for the engine
        response.close()
        with pytest.raises(aiohttp.ClientConnectionError):
            await pending
        async with asyncio.timeout(5):
            await closed.wait()
        assert pool.idle_connections() == 0
        await pool.close()


async def test_a_cancelled_request_closes_its_connection() -> None:
    arrived = asyncio.Event()
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()  # never answered
        await reader.read()
        closed.set()

    async with engine(handler) as port:
        pool = EnginePool()
        request = asyncio.ensure_future(pool.post("127.0.0.1", port, CHAT, b"{}"))
        async with asyncio.timeout(5):
            await arrived.wait()
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        async with asyncio.timeout(5):
            await closed.wait()
        assert pool.idle_connections() == 0
        await pool.close()


async def test_an_idle_connection_past_its_keepalive_is_not_reused() -> None:
    now = [100.0]
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            await read_request(reader)
            writer.write(plain(b"{}"))

    async with engine(handler) as port:
        pool = EnginePool(clock=lambda: now[0])
        first = await pool.post("127.0.0.1", port, CHAT, b"{}")
        await first.read()
        first.release()
        now[0] += KEEPALIVE_S - 0.5  # still fresh: reused
        second = await pool.post("127.0.0.1", port, CHAT, b"{}")
        await second.read()
        second.release()
        assert pool.opened == 1
        now[0] += KEEPALIVE_S + 0.5  # idle longer than the keep-alive: a new connection
        third = await pool.post("127.0.0.1", port, CHAT, b"{}")
        await third.read()
        third.release()
        assert pool.opened == 2
        assert pool.idle_connections() == 1
        await pool.close()
    assert connections == 2


async def test_an_answer_cut_inside_its_body_fails_the_read() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"partial":')
        await writer.drain()

    async with engine(handler) as port:
        pool = EnginePool()
        response = await pool.post("127.0.0.1", port, CHAT, b"{}")
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
        response.release()
        assert pool.idle_connections() == 0
        await pool.close()


async def test_a_body_that_ends_with_the_connection_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"whole":true}')
        await writer.drain()

    async with engine(handler) as port:
        pool = EnginePool()
        response = await pool.post("127.0.0.1", port, CHAT, b"{}")
        assert await response.read() == b'{"whole":true}'
        response.release()
        await pool.close()


async def test_a_malformed_answer_fails_without_a_resend() -> None:
    requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await reader.read()

    async with engine(handler) as port:
        pool = EnginePool()
        with pytest.raises(aiohttp.ClientPayloadError):
            await pool.post("127.0.0.1", port, CHAT, b"{}")
        await pool.close()
    assert requests == 1


async def test_a_stream_nobody_reads_stops_being_read_from_the_engine() -> None:
    data = b"x" * (READ_BUFFER_BYTES + 4096)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk(data) + b"0\r\n\r\n"
        )
        await reader.read()

    async with engine(handler) as port:
        pool = EnginePool()
        response = await pool.post("127.0.0.1", port, CHAT, b"{}")
        connection = response._connection
        assert connection is not None

        def paused() -> bool:
            return connection._paused

        async with asyncio.timeout(5):
            while not paused():  # the engine's bytes arrive; reading pauses
                await asyncio.sleep(0.01)
        received = b""
        while part := await response.content.readany():
            received += part
        assert received == data
        assert not paused()
        response.release()
        await pool.close()
