"""The statement lane: a PostgreSQL write of one statement, sent from the event loop itself.

Why (``benchmarks/journal.py``, profiled here): a journaled step on PostgreSQL is one
statement, one round trip (``jobs.py``), yet through the writer thread (``connection.py``) it
cost 0.2-0.3 ms more than the same statement sent straight through psycopg: the request
wakes the writer thread, the answer wakes the event loop through its self-pipe, and the two
threads hand the GIL back and forth at every system call in between. The server's own time
for the statement is about as much. The lane sends such a write on a connection of its own,
driven by the event loop (psycopg's asyncio connection): no thread, no hand-over.

The lane keeps the writer thread's contracts for such a write:

* **One transaction, durable before return**: the statement goes alone on an autocommit
  connection; the server runs it as its own transaction and answers after its commit
  (waiting for the WAL flush: the server's ``synchronous_commit``), and only then does the
  call return.
* **Fencing** stays in the statement (its ``WHERE``), as on the thread.
* **Errors**: a constraint violation leaves as :class:`~sbproxy.store.postgres.
  ConstraintViolation` (a ``sqlite3.IntegrityError``, the repositories' answer); a lost
  connection, or a server that does not answer within :data:`STATEMENT_DEADLINE_S`, drops the
  connection and is ``journal_unavailable``; any other driver error is ``store_failed`` with
  its ``sqlstate`` (:class:`~sbproxy.store.Database` maps them as for the thread). A
  statement that lost a race (serialization failure, deadlock: rolled back) runs again
  through the writer thread, which retries such races.
* **Cancellation**: once sent, a cancelled caller still waits for the statement's end
  (shielded), so nothing of it is left in flight behind the caller's back.
* **Statement hooks** see the statement before it is sent, as on the threads.

The lane is taken only when it is free: a write that finds it busy (another task's statement
in flight), unopened on another event loop, or shut after a failure goes to the writer
thread, which queues, groups commits, reconnects within its window and refuses the writes
queued in one outage at once. A lane whose connection failed stays shut until the writer
thread has committed again (the server answers); the next write then reopens it (at most
:data:`CONNECT_TIMEOUT_S`; a failure there is ``journal_unavailable`` at once). Every
write it commits is counted in the writer's tallies, a commit of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import psycopg
from psycopg.pq import ExecStatus

from sbproxy.store.connection import Params, StatementHook
from sbproxy.store.deadline import AsyncDeadlineConnection, transport_params
from sbproxy.store.outcomes import WriteTallies
from sbproxy.store.postgres import (
    CONNECT_TIMEOUT_S,
    STATEMENT_DEADLINE_S,
    ConstraintViolation,
    PgTarget,
    is_prepared,
    row_factory,
    translate,
)

__all__ = ["LaneUnopened", "StatementLane"]


class LaneUnopened(Exception):
    """The lane could not connect, quickly (refused, closed): nothing was sent, the writer
    thread runs the statement instead."""


class StatementLane:
    """One autocommit connection on the event loop for writes of one statement.

    Owned by one :class:`~sbproxy.store.Database`; used from the event loop it first ran on.

    Attributes:
        writes: Writes it committed so far (each its own commit).
    """

    def __init__(
        self, target: PgTarget, *, hooks: Sequence[StatementHook], tallies: WriteTallies
    ) -> None:
        self.target = target
        self._hooks = hooks
        self._tallies = tallies
        self._connection: AsyncDeadlineConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # A statement (or the connect) is in flight; the lane is shut (a failure, until the
        # writer commits again); closed for good.
        self._busy = False
        self._shut = False
        self._closed = False
        self._distrusted = False
        self.writes = 0
        # The hot statements this connection's server session has prepared.
        self._prepared_here: set[str] = set()

    def free(self) -> bool:
        """Whether a write may take the lane now (see the module docstring)."""
        if self._busy or self._shut or self._closed:
            return False
        return self._loop is None or self._loop is asyncio.get_running_loop()

    def reopen(self) -> None:
        """The writer thread committed: the server answers, a shut lane may reconnect."""
        self._shut = False

    def distrust(self) -> None:
        """Another connection of this process found the server gone: reconnect before the
        next statement rather than find this one lost (it sat idle meanwhile) by a write
        that then fails."""
        self._distrusted = True

    async def run(self, sql: str, params: Params) -> list[Any]:
        """Run ``sql`` (SQLite's text, :func:`~sbproxy.store.postgres.translate`) as a
        transaction of its own; its rows once it committed. Call only when :meth:`free`.

        Raises:
            ConstraintViolation: a constraint the statement broke (nothing applied).
            psycopg.Error: the driver's error (the connection is dropped and the lane shut
                when it was lost or the server did not answer in time).
            Exception: what a statement hook raised (nothing was sent).
        """
        self._busy = True
        try:
            with anyio.CancelScope(shield=True):
                rows = await self._run(sql, params)
        finally:
            self._busy = False
            if self._closed:
                await self._drop()
        return rows

    async def _run(self, sql: str, params: Params) -> list[Any]:
        for hook in self._hooks:
            hook(sql)
        connection = self._connection
        if connection is None or connection.closed or connection.broken or self._distrusted:
            try:
                connection = await self._connect()
            except psycopg.errors.ConnectionTimeout:
                raise  # a silent server: the caller waited its connect timeout already
            except psycopg.OperationalError as exc:
                # Refused or closed at once -- or a link that came back while the handshake
                # waited: nothing was sent; the writer thread, which reconnects within its
                # window, takes the statement.
                raise LaneUnopened(str(exc)) from exc
        text = translate(sql)
        prepared = self.target.prepared_statements and is_prepared(text)
        values = params if isinstance(params, Mapping) else list(params)
        started = time.perf_counter()
        try:
            if prepared and text not in self._prepared_here:
                # Its first use on this connection: alone, psycopg would wait for the
                # preparation before it executes (two round trips); in a pipeline the
                # preparation travels with the execution (and the Sync ends the statement's
                # own transaction, as sent alone).
                rows = await _first_prepared(connection, text, values)
                self._prepared_here.add(text)
            else:
                rows = await _send_alone(connection, text, values, prepared=prepared)
        except psycopg.IntegrityError as exc:
            raise ConstraintViolation(str(exc)) from exc
        except psycopg.Error:
            if connection.broken or connection.closed:
                self._shut = True
                await self._drop()
            raise
        self._tallies.began([0.0])
        self._tallies.committed(seconds=time.perf_counter() - started, writes=1)
        self.writes += 1
        return rows

    async def open(self) -> None:
        """Connect now (the database's opening: every later write finds it ready).

        Raises:
            psycopg.OperationalError: the server could not be reached.
        """
        self._busy = True
        try:
            await self._connect()
        finally:
            self._busy = False

    async def _connect(self) -> AsyncDeadlineConnection:
        self._distrusted = False
        await self._drop()
        try:
            connection = await AsyncDeadlineConnection.connect(
                self.target.conninfo,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                cursor_factory=psycopg.AsyncClientCursor,
                application_name="sbproxy-journal",
                prepare_threshold=self.target.prepare_threshold,
                **transport_params(self.target.conninfo),
            )
        except psycopg.OperationalError:
            self._shut = True
            raise
        connection.row_factory = row_factory
        connection.deadline_s = STATEMENT_DEADLINE_S
        self._connection = connection
        self._prepared_here = set()
        self._loop = asyncio.get_running_loop()
        return connection

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def close(self) -> None:
        """Close the connection (after the statement in flight, if any); the lane is not
        used again."""
        self._closed = True
        if self._busy:
            return  # the statement in flight drops it at its end
        if self._loop is None or self._loop is asyncio.get_running_loop():
            await self._drop()
        elif self._connection is not None:
            # Opened on another event loop: close the socket without it.
            self._connection.pgconn.finish()
            self._connection = None


async def _send_alone(
    connection: AsyncDeadlineConnection, text: str, values: Any, *, prepared: bool
) -> list[Any]:
    """Run ``text`` alone (the connection is in autocommit); its rows. ``prepared``: bound on
    the server and prepared (already, on this connection)."""
    cursor = (
        psycopg.AsyncCursor(connection, row_factory=row_factory)
        if prepared
        else connection.cursor()
    )
    async with cursor:
        await cursor.execute(text, values, prepare=prepared)
        return await _rows(cursor)


async def _first_prepared(connection: AsyncDeadlineConnection, text: str, values: Any) -> list[Any]:
    """Run ``text`` prepared on the server for the first time on ``connection``, its
    preparation and execution in one pipeline (one round trip); its rows.

    Raises:
        psycopg.Error: the first error met, once (a lost connection fails the pipeline's end
            too; handed the first, psycopg would log the second as ``error ignored
            terminating <psycopg.AsyncPipeline [BAD]>``).
    """
    cursor = psycopg.AsyncCursor(connection, row_factory=row_factory)
    failed: psycopg.Error | None = None
    try:
        async with connection.pipeline():
            try:
                await cursor.execute(text, values, prepare=True)
            except psycopg.Error as exc:
                failed = exc  # the pipeline's end meets it again and raises it silently
    except psycopg.Error:
        if failed is None:
            raise
    if failed is not None:
        raise failed
    async with cursor:
        return await _rows(cursor)


async def _rows(cursor: psycopg.AsyncCursor[Any]) -> list[Any]:
    """The rows of the statement ``cursor`` ran: none when it answered none. Read from the
    result's status, not ``cursor.description`` (which builds a column object per column,
    each time)."""
    result = cursor.pgresult
    if result is None or result.status != ExecStatus.TUPLES_OK:
        return []
    return list(await cursor.fetchall())
