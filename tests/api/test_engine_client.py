"""The gateway's aiohttp client (peer hops) against a real loopback HTTP server that closes
idle kept-alive connections, as llama-server does after 5 s: a request written onto a
connection the server closed under it is sent again on a new one instead of failing with a
502 (``test_engine_http.py`` checks the same of the client of this host's engines)."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from yarl import URL

from sbproxy.api.engine_client import ENGINE_IDLE_CLOSE_S, KEEPALIVE_S, engine_session, post
from tests.api.idle_engine import idle_closing_engine

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


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
