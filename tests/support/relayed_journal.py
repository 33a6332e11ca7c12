"""A PostgreSQL journal reached through a :class:`~tests.support.tcp_relay.TcpRelay`, so a
test can cut, blackhole and heal the link under a real store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sbproxy.store import Database, JobStore
from tests.support.postgres import PostgresServer
from tests.support.tcp_relay import TcpRelay

__all__ = ["relayed_journal"]


@asynccontextmanager
async def relayed_journal(
    server: PostgresServer,
) -> AsyncIterator[tuple[TcpRelay, Database, JobStore]]:
    """A fresh database on ``server``, opened through a relay: ``(relay, database, store)``;
    the relay closed (a blocked call then ends) and the database closed on exit."""
    url = server.create_database()
    with TcpRelay(server.port) as relay:
        through = url.replace(f"127.0.0.1:{server.port}/", f"127.0.0.1:{relay.port}/", 1)
        database = await Database.open(through)
        try:
            yield relay, database, JobStore(database)
        finally:
            relay.close()
            await database.close()
