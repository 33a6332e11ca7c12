"""Connection threads: each owns one stdlib ``sqlite3`` connection and runs transactions on it.

Why threads and not an async driver (profiled with ``benchmarks/journal.py``): when the
journal ran on SQLAlchemy's asyncio layer and aiosqlite, every statement, fetch and cursor
close was its own round trip from the event loop to the driver's thread and back -- about 40
per journaled step -- so a trivial step cost 2.2-2.7 ms with ``synchronous=FULL`` and
1.7-2.5 ms with ``NORMAL`` here, while one fsynced commit costs ~0.2 ms: the traffic was the
cost, not the fsyncs. Here a whole transaction is one closure: the event loop hands it to the
connection's thread, the thread runs every statement of it against SQLite (which releases the
GIL while it steps and fsyncs) and hands back one result, one round trip (~30 us) per
transaction.

The writer (:class:`WriterThread`, one per :class:`~sbproxy.store.Database`) is the only
connection of this process that writes. Each transaction is ``BEGIN IMMEDIATE`` ... ``COMMIT``
and its result is delivered only after ``COMMIT`` returned, so with ``synchronous=FULL`` a
result means the write is on disk. **Group commit**: transactions that queued up while one
committed run together in one ``BEGIN IMMEDIATE`` transaction, each inside its own
``SAVEPOINT``, and share one ``COMMIT`` (one fsync) -- nothing is delayed to form a group, it
forms only when writers already wait. A grouped transaction that fails (other than by
``IntegrityError``, which its savepoint undoes) or a failed shared ``COMMIT`` sends the whole
group back to run one transaction at a time, so each request meets only its own outcome.

Readers (:class:`ReaderThread`) have their own connections (``query_only``), so a read never
waits for a commit's fsync; each read is one ``BEGIN`` ... ``ROLLBACK`` snapshot. WAL lets them
read while the writer writes.

Work closures run on the connection's thread: they must not touch the event loop, and they
may run more than once (a lock that outlived the busy timeout, a group sent back), every run
but the last rolled back -- so a closure resets any state of its own it keeps outside the
database before it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from sbproxy.store.outcomes import WriteTallies

__all__ = [
    "LOCK_RETRY_ATTEMPTS",
    "MAX_GROUP",
    "ConnectionClosed",
    "ConnectionThread",
    "ReaderThread",
    "StatementHook",
    "Transaction",
    "WriterThread",
    "is_locked",
]

T = TypeVar("T")

Params = Mapping[str, Any] | Sequence[Any]
StatementHook = Callable[[str], None]
"""Called on a connection thread with each statement's SQL before it runs (tests arm faults
with one; an exception it raises fails the statement as a driver error would)."""

# Attempts of one transaction whose lock outlasted the busy timeout (each waited that long).
LOCK_RETRY_ATTEMPTS = 5
# Most transactions one group commit may hold: bounds how long the first of them waits for
# the others' statements before its fsync.
MAX_GROUP = 64


class ConnectionClosed(Exception):
    """The connection thread was closed before the request was handed to it."""


# PostgreSQL's SQLSTATEs of a transaction that lost a race and may simply run again:
# serialization_failure, deadlock_detected.
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})


def is_locked(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" (a busy timeout elapsed), or a
    PostgreSQL transaction that lost a race (serialization failure, deadlock): either way the
    transaction was rolled back and may run again."""
    if getattr(exc, "sqlstate", None) in _RETRYABLE_SQLSTATES:
        return True
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower()


class DriverConnection(Protocol):
    """What the connection threads use of a driver connection: ``DriverConnection``, or
    the PostgreSQL strategy's :class:`~sbproxy.store.postgres.PgConnection`, which answers
    with cursors and rows shaped as ``sqlite3``'s (``rowcount``, ``fetchall``; rows by
    position and by column name)."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Any = (), /) -> Any: ...

    def executemany(self, sql: str, parameters: Any, /) -> Any: ...

    def close(self) -> None: ...


class Transaction:
    """One open transaction, handed to a work closure on its connection's thread.

    Parameters are SQLite's named (``:name`` with a mapping) or positional (``?`` with a
    sequence) style. The driver keeps each distinct SQL text prepared (its statement cache),
    so fixed statement texts are parsed once per connection.
    """

    __slots__ = ("_connection", "_hooks", "alone", "dialect")

    def __init__(self, connection: DriverConnection, hooks: Sequence[StatementHook]) -> None:
        self._connection = connection
        self._hooks = hooks
        # ``sqlite`` or ``postgresql``: the few statements that differ ask (a claim's
        # ``FOR UPDATE SKIP LOCKED``).
        self.dialect: str = getattr(connection, "dialect", "sqlite")
        # Whether the running request has the transaction to itself (the writer says; see
        # :meth:`last`).
        self.alone = False

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        """Run one statement; its cursor (``rowcount``: rows an UPDATE/INSERT/DELETE changed).

        Raises:
            sqlite3.Error: the driver's error, as is (the database maps it for callers).
        """
        for hook in self._hooks:
            hook(sql)
        cursor: sqlite3.Cursor = self._connection.execute(sql, params)
        return cursor

    def executemany(self, sql: str, rows: Iterable[Params]) -> sqlite3.Cursor:
        """Run one statement once per parameter set in ``rows``."""
        for hook in self._hooks:
            hook(sql)
        cursor: sqlite3.Cursor = self._connection.executemany(sql, rows)
        return cursor

    def last(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        """Run the request's last statement and return its rows (as :meth:`all`).

        On PostgreSQL, when the request has the transaction to itself, the statement goes in
        one query with the ``COMMIT`` -- one round trip for the whole transaction; alone
        when it is the transaction's first (a write the server commits itself, a read one
        ``SELECT`` whose snapshot is its own) -- so the request must run nothing after it
        (the thread's own ``COMMIT`` or ``ROLLBACK`` then has nothing left to do).
        Elsewhere it is :meth:`all`.
        """
        commit_with = getattr(self._connection, "execute_and_commit", None)
        if not self.alone or commit_with is None:
            return self.all(sql, params)
        for hook in self._hooks:
            hook(sql)
        rows: list[sqlite3.Row] = commit_with(sql, params).fetchall()
        return rows

    def all(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        """Every row the statement returns (rows index by position and by column name)."""
        rows: list[sqlite3.Row] = self.execute(sql, params).fetchall()
        return rows

    def one(self, sql: str, params: Params = ()) -> sqlite3.Row | None:
        """The first row, or ``None``; the statement is always run to its end (a
        ``RETURNING`` statement applies all its changes)."""
        rows = self.all(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: Params = ()) -> Any:
        """The first column of the first row, or ``None`` when there is no row."""
        row = self.one(sql, params)
        return None if row is None else row[0]


class _Request(Generic[T]):
    """A closure to run on a connection thread, and where its outcome goes (``queued_at``:
    when it was handed over, ``time.perf_counter()``)."""

    __slots__ = ("future", "loop", "queued_at", "work")

    def __init__(
        self,
        work: Callable[[Transaction], T] | None,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[T],
    ) -> None:
        self.work = work
        self.loop = loop
        self.future = future
        self.queued_at = time.perf_counter()

    def settle(self, value: Any, error: BaseException | None) -> None:
        """Hand the outcome to the requesting event loop (from the connection thread)."""
        # A closed loop (RuntimeError) has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_settle, self.future, value, error)


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class ConnectionThread:
    """A daemon thread that owns one SQLite connection and runs requests from a queue.

    Args:
        name: Thread name (shown by debuggers and ``py-spy``).
        connect: Opens and configures the connection; runs on the thread.
        hooks: Statement hooks shared with the database (see :data:`StatementHook`).
        requests: The queue to take requests from (several readers may share one; whichever
            is free takes the next); a queue of its own when ``None``.
    """

    def __init__(
        self,
        *,
        name: str,
        connect: Callable[[], DriverConnection],
        hooks: Sequence[StatementHook],
        requests: queue.SimpleQueue[_Request[Any]] | None = None,
    ) -> None:
        self.name = name
        self._connect = connect
        self._hooks = hooks
        self._queue: queue.SimpleQueue[_Request[Any]] = (
            requests if requests is not None else queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready: _Request[None] | None = None
        self._closed = False
        # The connection's ``note_request`` (PostgreSQL's), told when each request it runs
        # was queued: one that waited while the connection found its server unreachable is
        # refused at once instead of waiting out a reconnect of its own.
        self._note: Callable[[float], None] | None = None
        # The connection's ``distrust`` (PostgreSQL's): another connection of this process
        # found the server gone, so this one is reopened at its next transaction.
        self.distrust: Callable[[], None] = _nothing

    async def open(self) -> None:
        """Start the thread and wait until its connection is open.

        Raises:
            sqlite3.Error | OSError: what opening the connection raised (the thread ends).
        """
        loop = asyncio.get_running_loop()
        self._ready = _Request(None, loop, loop.create_future())
        self._thread.start()
        await _shielded(self._ready.future)

    async def run(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in a transaction on the thread; its result once the transaction ended.

        The wait is shielded from cancellation: a request, once handed over, runs to its
        end, and a cancelled caller still waits for that before the cancellation takes
        effect, so nothing of its transaction is left in flight behind the caller's back.

        Raises:
            ConnectionClosed: the thread was closed.
            Exception: what ``work`` or the driver raised (see the subclasses).
        """
        if self._closed:
            raise ConnectionClosed(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        request: _Request[T] = _Request(work, loop, loop.create_future())
        self._queue.put(request)
        return await _shielded(request.future)

    async def close(self) -> None:
        """Finish every request queued before, close the connection and end the thread."""
        # Not the thread's liveness: readers sharing a queue stop on whichever close request
        # they take, so each close puts exactly one and waits for whoever took it.
        if self._closed or self._ready is None:
            self._closed = True
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        done: _Request[None] = _Request(None, loop, loop.create_future())
        self._queue.put(done)
        await _shielded(done.future)

    def _main(self) -> None:
        ready = self._ready
        assert ready is not None  # noqa: S101 - open() sets it before the thread starts
        try:
            connection = self._connect()
        except BaseException as exc:  # noqa: BLE001 - handed to the opener, who maps it
            self._closed = True
            ready.settle(None, exc)
            return
        self._note = getattr(connection, "note_request", None)
        self.distrust = getattr(connection, "distrust", _nothing)
        ready.settle(None, None)
        self._serve(connection)

    def _serve(self, connection: DriverConnection) -> None:
        """Take requests until the close request (one role per subclass)."""
        raise NotImplementedError

    @staticmethod
    def _stop(connection: DriverConnection, request: _Request[Any]) -> None:
        try:
            connection.close()
        finally:
            request.settle(None, None)


def _nothing() -> None:
    return None


async def _shielded(future: asyncio.Future[T]) -> T:
    """Wait for ``future``, shielded from anyio cancellation (it is delivered at the caller's
    next checkpoint instead)."""
    with anyio.CancelScope(shield=True):
        result = await future
    return result


class ReaderThread(ConnectionThread):
    """Runs read closures, each in its own ``BEGIN`` ... ``ROLLBACK`` snapshot."""

    def _serve(self, connection: DriverConnection) -> None:
        transaction = Transaction(connection, self._hooks)
        # Each read has its snapshot to itself: a read of one statement (``last``) needs no
        # transaction around it on PostgreSQL (one round trip, no ROLLBACK after).
        transaction.alone = True
        while True:
            request = self._queue.get()
            if request.work is None:
                self._stop(connection, request)
                return
            try:
                if self._note is not None:
                    self._note(request.queued_at)
                connection.execute("BEGIN")
                try:
                    value = request.work(transaction)
                finally:
                    if connection.in_transaction:
                        connection.execute("ROLLBACK")
            except BaseException as exc:  # noqa: BLE001 - every outcome goes to the caller
                request.settle(None, exc)
            else:
                request.settle(value, None)


class WriterThread(ConnectionThread):
    """Runs write closures in ``BEGIN IMMEDIATE`` transactions, committing queued ones together.

    A result (or error) is delivered only after the transaction's ``COMMIT`` returned (or it
    was rolled back): under ``synchronous=FULL`` a delivered result is durable.

    Attributes:
        writes: Write requests committed so far.
        commits: ``COMMIT`` statements that succeeded so far (fewer than ``writes`` when
            groups formed).
        tallies: Each write's wait before its transaction began, each commit's duration
            and group size (``sbproxy_journal_write_wait_seconds`` and friends).
    """

    writes = 0
    commits = 0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tallies = WriteTallies()

    def _begin(self, connection: DriverConnection, group: Sequence[_Request[Any]]) -> None:
        """``BEGIN IMMEDIATE`` (waiting out another process's lock up to the busy timeout),
        counting how long each write of ``group`` waited for it."""
        if self._note is not None:
            self._note(group[0].queued_at)
        connection.execute("BEGIN IMMEDIATE")
        began = time.perf_counter()
        self.tallies.began([began - request.queued_at for request in group])

    def _commit(self, connection: DriverConnection, writes: int) -> None:
        """``COMMIT``, counted in the tallies (its seconds and the group's size)."""
        started = time.perf_counter()
        connection.execute("COMMIT")
        self.tallies.committed(seconds=time.perf_counter() - started, writes=writes)
        self.commits += 1
        self.writes += writes

    def _serve(self, connection: DriverConnection) -> None:
        transaction = Transaction(connection, self._hooks)
        while True:
            first = self._queue.get()
            if first.work is None:
                self._stop(connection, first)
                return
            group = [first]
            stop: _Request[Any] | None = None
            while len(group) < MAX_GROUP:
                try:
                    extra = self._queue.get_nowait()
                except queue.Empty:
                    break
                if extra.work is None:
                    stop = extra
                    break
                group.append(extra)
            if len(group) == 1:
                self._alone(connection, transaction, first)
            else:
                self._together(connection, transaction, group)
            if stop is not None:
                self._stop(connection, stop)
                return

    def _alone(
        self, connection: DriverConnection, transaction: Transaction, request: _Request[Any]
    ) -> None:
        """One request, one transaction: retried while the lock outlasts the busy timeout."""
        work = request.work
        assert work is not None  # noqa: S101 - the close request never gets here

        def attempt() -> Any:
            self._begin(connection, (request,))
            try:
                transaction.alone = True
                try:
                    value = work(transaction)
                finally:
                    transaction.alone = False
                self._commit(connection, 1)
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
            return value

        try:
            try:
                value = attempt()
            except Exception as exc:
                if not is_locked(exc):
                    raise
                # The lock outlasted a whole busy timeout: tenacity runs the other attempts,
                # with jittered backoff between them (the first attempt stays off its
                # machinery: it is every write's path).
                value = Retrying(
                    retry=retry_if_exception(is_locked),
                    stop=stop_after_attempt(LOCK_RETRY_ATTEMPTS - 1),
                    wait=wait_random_exponential(multiplier=0.05, max=2),
                    sleep=time.sleep,
                    reraise=True,
                )(attempt)
        except BaseException as exc:  # noqa: BLE001 - every outcome goes to the caller
            request.settle(None, exc)
        else:
            request.settle(value, None)

    def _together(
        self,
        connection: DriverConnection,
        transaction: Transaction,
        group: list[_Request[Any]],
    ) -> None:
        """Several requests, one transaction and one ``COMMIT``; on any failure but a
        constraint one savepoint undid, the whole group runs again one request at a time."""
        outcomes: list[tuple[Any, BaseException | None]] = []
        try:
            self._begin(connection, group)
            for request in group:
                work = request.work
                assert work is not None  # noqa: S101 - the close request never gets here
                connection.execute("SAVEPOINT grouped")
                try:
                    value = work(transaction)
                except sqlite3.IntegrityError as exc:
                    # A statement-level failure: SQLite undid the statement, the savepoint
                    # undoes the rest of this request; the others stand.
                    connection.execute("ROLLBACK TO grouped")
                    connection.execute("RELEASE grouped")
                    outcomes.append((None, exc))
                    continue
                connection.execute("RELEASE grouped")
                outcomes.append((value, None))
            self._commit(connection, len(group))
        except BaseException:  # noqa: BLE001 - each request is rerun alone to meet its own
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            for request in group:
                self._alone(connection, transaction, request)
            return
        for request, (value, error) in zip(group, outcomes, strict=True):
            request.settle(value, error)
