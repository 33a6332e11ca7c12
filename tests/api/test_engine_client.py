"""The gateway's client to its engines against a real loopback HTTP server that closes idle
kept-alive connections, as llama-server does after 5 s: a request written onto a connection
the engine closed under it is sent again on a new one instead of failing with a 502."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from yarl import URL

from sbproxy.api.engine_client import ENGINE_IDLE_CLOSE_S, KEEPALIVE_S, engine_session, post

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


@dataclass
class IdleClosingEngine:
    """A loopback HTTP/1.1 server that answers the first request on each connection with a
    kept-alive JSON answer, then treats the connection as idled out: when the next request
    arrives there, it closes the socket unread with a reset -- what a client sees when its
    request crosses the engine's idle close (cpp-httplib's keep-alive timeout)."""

    answered: list[bytes] = field(default_factory=list)
    reset: int = 0
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            self.answered.append(await reader.readexactly(length))
            answer = json.dumps({"object": "chat.completion", "n": len(self.answered)}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()
            if await reader.read(1):  # the next request on the kept-alive connection
                self.reset += 1
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def idle_closing_engine() -> AsyncIterator[tuple[IdleClosingEngine, URL]]:
    engine = IdleClosingEngine()
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield engine, URL(f"http://127.0.0.1:{port}/v1/chat/completions")


async def test_a_request_on_a_connection_the_engine_closed_is_sent_again() -> None:
    async with idle_closing_engine() as (engine, url), engine_session() as session:
        first = await post(session, url, b'{"n": 1}')
        assert (await first.json())["n"] == 1
        first.release()  # back to the pool: the next request reuses this connection
        second = await post(session, url, b'{"n": 2}')
        assert second.status == 200
        assert (await second.json())["n"] == 2
        second.release()
    assert engine.answered == [b'{"n": 1}', b'{"n": 2}']
    assert engine.reset == 1  # the second request met the closed connection, then a new one
    assert engine.connections == 2


async def test_the_engine_closing_a_connection_under_a_plain_post_fails_it() -> None:
    """The failure the retry is for, shown on the same server with a bare aiohttp POST."""
    async with idle_closing_engine() as (engine, url), engine_session() as session:
        first = await session.post(url, data=b"{}")
        await first.read()
        first.release()
        with pytest.raises((aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)):
            await session.post(url, data=b"{}")
    assert engine.reset == 1


async def test_an_engine_that_is_gone_is_not_tried_twice() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    async with engine_session() as session:
        with pytest.raises(aiohttp.ClientConnectorError):
            await post(session, URL(f"http://127.0.0.1:{port}/v1/chat/completions"), b"{}")


def test_the_pool_drops_idle_connections_before_the_engines_close_them() -> None:
    assert KEEPALIVE_S < ENGINE_IDLE_CLOSE_S
