"""The SQLite database behind the job journal: connections, transactions and their errors.

Discipline (ARCHITECTURE.md, "SQLite discipline"; figures in measured-here.md):

* WAL journal, ``busy_timeout`` 30 s, ``synchronous=FULL`` by default (a commit survives
  power loss; ``NORMAL`` is offered for benchmarks and measured side by side).
* One writer connection per process, on its own thread (``connection.py``): every write is
  a short ``BEGIN IMMEDIATE`` transaction -- a deferred transaction that later upgrades to a
  write fails with "database is locked" under contention (71 % of transactions with four
  processes here), an immediate one waits for the lock instead. Writes that queue up behind
  a commit share the next one (group commit); a write's result is returned only once its
  ``COMMIT`` returned, so it is durable when the caller sees it.
* Reads run on reader connections of their own (``query_only``), each one ``BEGIN``
  snapshot, never waiting for a commit's fsync.
* The driver's own implicit transactions are off (``isolation_level=None``): the
  transaction mode is always the one written here.
* A write that still meets "database is locked" (a busy timeout elapsed) is retried, a few
  times with jittered backoff; the transaction is rolled back first, so a retried write
  never applies twice.
* A driver error never leaves this module as itself: a full file system -- SQLite's
  ``SQLITE_FULL``, "database or disk is full", or ``ENOSPC`` / ``EDQUOT`` -- is
  :class:`StoreError` ``disk_full`` naming the journal, the bytes a write needs at least and
  the bytes free; any other is ``store_failed`` with SQLite's own message.
  ``sqlite3.IntegrityError`` alone passes through: the repositories catch it as an answer
  (a duplicate key), not a failure.

The schema is declared in SQLModel (``tables.py``) and created by the versioned migrations
(``migrations.py``); statements run as fixed SQL texts that the driver keeps prepared.
"""

from __future__ import annotations

import errno
import os
import queue
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import psycopg

from sbproxy.errors import SbproxyError
from sbproxy.store.connection import (
    LOCK_RETRY_ATTEMPTS,
    ConnectionClosed,
    Params,
    ReaderThread,
    StatementHook,
    Transaction,
    WriterThread,
    is_locked,
)
from sbproxy.store.lane import LaneUnopened, StatementLane
from sbproxy.store.leaseclock import LeaseClock, system_lease_time
from sbproxy.store.outcomes import WriteTallies
from sbproxy.store.postgres import (
    DatabaseLeaseTime,
    JournalUnavailable,
    PgConnection,
    PgTarget,
    is_postgres_url,
)

__all__ = [
    "Database",
    "StoreError",
    "Synchronous",
    "Transaction",
    "journal_error",
    "journal_fault",
]

Synchronous = Literal["FULL", "NORMAL"]
T = TypeVar("T")

# Milliseconds SQLite waits for a lock before reporting "database is locked".
BUSY_TIMEOUT_MS = 30_000
# SQLite's page size (its default; never changed here): a write that cannot get one more
# page for the WAL or the database file fails, so this is the least a write needs.
JOURNAL_PAGE_BYTES = 4096
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Reader connections per database: reads are short point queries; two let a long listing
# and a step's read not wait for each other.
READERS = 2
# Prepared statements the driver keeps per connection (the journal uses about 60 texts).
_CACHED_STATEMENTS = 256


class StoreError(SbproxyError):
    """The journal database could not be opened or written (code ``store_failed``)."""

    default_code = "store_failed"
    default_retryable = True


def journal_fault(exc: BaseException) -> bool:
    """Whether ``exc`` says the journal itself could not be used -- its PostgreSQL server is
    away (``journal_unavailable``), its file system is full (``disk_full``), its file or
    driver failed (``store_failed``) -- rather than anything about what was asked of it.

    Such an error is never a job's outcome (it could not even be recorded): the run that
    meets it stops, the job keeps its claim in the journal, and it resumes once the journal
    answers (``sbproxy.workflows``). A PostgreSQL error about the statement itself (one that
    carries a ``sqlstate`` outside the connection classes, e.g. a value a column refuses) is
    not a fault of the journal.
    """
    if isinstance(exc, JournalUnavailable):
        return True
    return isinstance(exc, StoreError) and "sqlstate" not in exc.details


def _unwritable_reason(directory: Path) -> str | None:
    """The OS reason ``directory`` cannot be written (read-only file system, no permission),
    found by creating an unnamed file there; ``None`` when it can be, or fails otherwise.

    SQLite reports both as a bare "unable to open database file", without the errno.
    """
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return exc.strerror or str(exc)
        return None


def _free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``directory``."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def _is_full(cause: BaseException, directory: Path) -> bool:
    """Whether a driver (or OS) error means the journal's file system is full.

    SQLite reports ``ENOSPC`` as ``SQLITE_FULL`` ("database or disk is full"); other write
    errors (``EDQUOT`` among them) come as an ``SQLITE_IOERR`` variant, which counts as full
    when less than a page is free there.
    """
    if isinstance(cause, OSError):
        return cause.errno in _FULL_ERRNOS
    if not isinstance(cause, sqlite3.Error):
        return False
    code = getattr(cause, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    if primary == sqlite3.SQLITE_FULL or "database or disk is full" in str(cause).lower():
        return True
    return primary == sqlite3.SQLITE_IOERR and _free_bytes(directory) < JOURNAL_PAGE_BYTES


def journal_error(exc: BaseException, path: Path) -> StoreError:
    """Our error for a driver (or OS) error met on the journal at ``path``.

    Returns:
        ``disk_full`` (not retryable; details ``path``, ``needed_bytes`` -- at least one
        page -- and ``free_bytes``) when the file system is full, else ``store_failed`` with
        SQLite's message (details ``path`` and, when known, ``sqlite_error``, e.g.
        ``SQLITE_CORRUPT``).
    """
    cause = getattr(exc, "orig", None) or exc
    if _is_full(cause, path.parent):
        free = _free_bytes(path.parent)
        return StoreError(
            f"the job journal {path} cannot be written: SQLite reports its disk full (a "
            f"write needs at least {JOURNAL_PAGE_BYTES} more bytes, {free} bytes are free)",
            code="disk_full",
            retryable=False,
            remediation="Free space on that file system (`sbproxy models gc` or `sbproxy "
            "models prune` when the cache shares it); an unfinished job stays resumable and "
            "finishes when its command runs again.",
            details={"path": str(path), "needed_bytes": JOURNAL_PAGE_BYTES, "free_bytes": free},
        )
    name = getattr(cause, "sqlite_errorname", None)
    details: dict[str, str | int | float | bool | None] = {"path": str(path)}
    if isinstance(name, str):
        details["sqlite_error"] = name
    reason = getattr(cause, "strerror", None) or str(cause) or type(cause).__name__
    return StoreError(
        f"the job journal {path} failed: {reason}",
        remediation="Check the disk and the file; `sbproxy doctor` checks the cache directory.",
        details=details,
    )


def _driver_failure(exc: BaseException) -> bool:
    """A driver error this module turns into ours (see the module docstring)."""
    if isinstance(exc, sqlite3.IntegrityError):
        return False
    return isinstance(exc, sqlite3.Error)


def _connect(path: Path, synchronous: Synchronous, *, writer: bool) -> sqlite3.Connection:
    """Open one configured connection to ``path`` (on the thread that will own it).

    The first statement reads the schema version, so a damaged or foreign file fails here,
    before anything is written to it. Only the writer switches the file to WAL (a property
    of the file, which every later connection sees); readers are ``query_only``.
    """
    connection = sqlite3.connect(
        path,
        timeout=BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,
        cached_statements=_CACHED_STATEMENTS,
    )
    try:
        connection.row_factory = sqlite3.Row
        connection.execute("PRAGMA schema_version").fetchall()
        if writer:
            _use_wal(connection)
        connection.execute(f"PRAGMA synchronous={synchronous}")
        connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        connection.execute("PRAGMA foreign_keys=ON")
        if not writer:
            connection.execute("PRAGMA query_only=ON")
    except BaseException:
        connection.close()
        raise
    return connection


def _use_wal(connection: sqlite3.Connection) -> None:
    """Switch the file to WAL unless it is already. The switch needs the file to itself,
    and SQLite answers "database is locked" at once -- without waiting out the busy timeout
    -- when another process opens the same new journal at that moment, so it is retried
    (within the busy timeout) until one of them has switched it."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() == "wal":
            return
        try:
            connection.execute("PRAGMA journal_mode=WAL").fetchall()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class Database:
    """An open journal database file: one writer thread and a few reader threads.

    Use :meth:`open` to create one; close it with :meth:`close`. Safe to share between tasks
    of one asyncio event loop; every process opens its own.

    Attributes:
        path: The database file.
        synchronous: ``FULL`` or ``NORMAL``.
    """

    def __init__(
        self,
        path: Path,
        synchronous: Synchronous,
        *,
        writer: WriterThread,
        readers: list[ReaderThread],
        hooks: list[StatementHook],
        postgres: PgTarget | None = None,
    ) -> None:
        self.path = path
        self.synchronous = synchronous
        self.postgres = postgres
        self._lease_clock: LeaseClock = system_lease_time
        self._writer = writer
        self._readers = readers
        self._hooks = hooks
        # PostgreSQL: writes of one statement sent from the event loop (``lane.py``).
        self._lane = (
            None
            if postgres is None
            else StatementLane(postgres, hooks=hooks, tallies=writer.tallies)
        )

    @property
    def lease_clock(self) -> LeaseClock:
        """The clock leases on this journal are stamped on: this boot's ``CLOCK_MONOTONIC``
        (``leaseclock.py``) on SQLite, the server's ``clock_timestamp()`` on PostgreSQL (one
        clock for every host sharing it)."""
        return self._lease_clock

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return "sqlite" if self.postgres is None else "postgresql"

    @property
    def location(self) -> str:
        """What to show of the journal: the SQLite file, or ``postgresql://user@host:port/db``
        (never a password)."""
        return str(self.path) if self.postgres is None else self.postgres.describe()

    @classmethod
    async def open(cls, path: Path | str, *, synchronous: Synchronous = "FULL") -> Database:
        """Open (creating if needed) the database at ``path`` and apply pending migrations.

        ``path`` is the SQLite file, or a ``postgresql://`` URL (``postgres.py``; libpq reads
        its parameters: ``sslmode``, ``service``, ``passfile`` ...); a PostgreSQL journal
        must exist as a database, its tables are created here. ``synchronous`` applies to
        SQLite only (PostgreSQL keeps the server's ``synchronous_commit``).

        Raises:
            StoreError: ``store_failed`` when the directory cannot be created or the file is
                not a usable SQLite database; ``disk_full`` when its file system is full;
                ``invalid_cache_dir`` (not retryable) when the directory cannot be written
                (read-only file system, no permission); ``store_version_mismatch`` when the
                file is newer than this code (``journal_schema_newer`` on PostgreSQL);
                ``journal_unavailable`` when the PostgreSQL server cannot be reached.
        """
        from sbproxy.store.migrations import migrate

        if isinstance(path, str):
            if is_postgres_url(path):
                return await cls._open_postgres(PgTarget.parse(path), synchronous)
            path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise journal_error(exc, path) from exc
            raise StoreError(
                f"cannot create the journal directory {path.parent}: {exc.strerror}",
                remediation="Check the cache directory's permissions and free space.",
            ) from exc
        hooks: list[StatementHook] = []
        writer = WriterThread(
            name=f"sbproxy-journal-writer:{path.name}",
            connect=lambda: _connect(path, synchronous, writer=True),
            hooks=hooks,
        )
        try:
            await writer.open()
        except sqlite3.DatabaseError as exc:
            raise await _open_error(exc, path) from exc
        database = cls(path, synchronous, writer=writer, readers=[], hooks=hooks)
        try:
            await migrate(database)
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            for index in range(READERS):
                reader = ReaderThread(
                    name=f"sbproxy-journal-reader-{index}:{path.name}",
                    connect=lambda: _connect(path, synchronous, writer=False),
                    hooks=hooks,
                    requests=requests,
                )
                await reader.open()
                database._readers.append(reader)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await database.close()
            if isinstance(exc, sqlite3.Error) and _driver_failure(exc):
                raise journal_error(exc, path) from exc
            raise
        return database

    @classmethod
    async def _open_postgres(cls, target: PgTarget, synchronous: Synchronous) -> Database:
        from sbproxy.store.migrations import migrate

        hooks: list[StatementHook] = []
        writer = WriterThread(
            name=f"sbproxy-journal-writer:{target.address}",
            connect=lambda: PgConnection(target, read_only=False),
            hooks=hooks,
        )
        try:
            await writer.open()
        except psycopg.Error as exc:
            raise _pg_error(exc, target) from exc
        database = cls(
            Path(target.describe()),
            synchronous,
            writer=writer,
            readers=[],
            hooks=hooks,
            postgres=target,
        )
        try:
            await migrate(database)
            database._lease_clock = DatabaseLeaseTime(await database.write(_server_offset_ms))
            requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
            for index in range(READERS):
                reader = ReaderThread(
                    name=f"sbproxy-journal-reader-{index}:{target.address}",
                    connect=lambda: PgConnection(target, read_only=True),
                    hooks=hooks,
                    requests=requests,
                )
                await reader.open()
                database._readers.append(reader)
            if database._lane is not None:
                await database._lane.open()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await database.close()
            if isinstance(exc, psycopg.Error):
                raise _pg_error(exc, target) from exc
            raise
        return database

    def _driver_error(self, exc: BaseException) -> SbproxyError | None:
        """Our error for a driver error met in a transaction, or ``None`` to let it pass."""
        if self.postgres is not None:
            if isinstance(exc, psycopg.Error):
                return _pg_error(exc, self.postgres)
            return None
        if _driver_failure(exc):
            return journal_error(exc, self.path)
        return None

    async def close(self) -> None:
        """Finish the queued writes, then close every connection and end their threads.

        Using the database afterwards raises ``StoreError`` (``store_failed``).
        """
        if self._lane is not None:
            await self._lane.close()
        await self._writer.close()
        for reader in self._readers:
            await reader.close()

    @property
    def write_counts(self) -> tuple[int, int]:
        """``(writes, commits)`` committed so far by this process: the writes that
        succeeded, and the ``COMMIT`` statements (one fsync each under ``FULL``) they took;
        fewer commits than writes means group commits formed."""
        lane = 0 if self._lane is None else self._lane.writes
        return self._writer.writes + lane, self._writer.commits + lane

    @property
    def write_tallies(self) -> WriteTallies:
        """How this process's writes waited, committed and grouped (for metrics)."""
        return self._writer.tallies

    def add_statement_hook(self, hook: StatementHook) -> None:
        """Call ``hook`` with the SQL of every statement a transaction runs from now on, on
        the connection's thread, before it runs (tests make writes fail with it)."""
        self._hooks.append(hook)

    async def read(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in a read transaction (a consistent snapshot, no write lock) on a
        reader connection, and return its result.

        ``work`` runs on a reader thread: it must not touch the event loop.

        Raises:
            StoreError: ``disk_full`` or ``store_failed`` for a driver error in ``work``
                (see the module docstring); ``store_failed`` once the database is closed.
        """
        if not self._readers:
            raise _closed_error(self.location)
        try:
            return await self._readers[0].run(work)
        except ConnectionClosed as exc:
            raise _closed_error(self.location) from exc
        except Exception as exc:
            failure = self._failure(exc)
            if failure is exc:
                raise
            raise failure from exc

    async def write(self, work: Callable[[Transaction], T]) -> T:
        """Run ``work`` in one ``BEGIN IMMEDIATE`` transaction, commit it, return its result.

        ``work`` runs on the writer thread (it must not touch the event loop) and may run
        more than once -- when the database stays locked past the busy timeout, or when a
        group commit it was part of failed -- each failed run rolled back before the next,
        so its effects apply once; state it keeps outside the database must be reset at its
        start. The result is returned only after ``COMMIT`` returned: with
        ``synchronous=FULL`` it is on disk.

        Raises:
            StoreError: ``store_failed`` when the database stays locked after every retry,
                the driver fails otherwise, or the database is closed; ``disk_full`` (not
                retryable) when the journal's file system is full -- the transaction is
                rolled back, nothing of it applies.
            sqlite3.IntegrityError: a constraint ``work`` broke (the caller's answer).
        """
        try:
            value = await self._writer.run(work)
        except ConnectionClosed as exc:
            raise _closed_error(self.location) from exc
        except Exception as exc:
            if is_locked(exc):
                raise StoreError(
                    f"the journal {self.location} stayed locked after {LOCK_RETRY_ATTEMPTS} "
                    "attempts",
                    remediation="Another process holds a long write transaction; retry.",
                ) from exc
            failure = self._failure(exc)
            if failure is exc:
                raise
            raise failure from exc
        if self._lane is not None:
            self._lane.reopen()  # the server answers: a lane shut by a failure may reconnect
        return value

    def _failure(self, exc: Exception) -> Exception:
        """What a call's driver error ``exc`` leaves as (:meth:`_driver_error`; ``exc`` itself
        when that maps it to nothing); an outage (``journal_unavailable``) also has the idle
        writing connections reopened at their next use."""
        mapped = self._driver_error(exc)
        if isinstance(mapped or exc, JournalUnavailable):
            self._distrust_writers()
        return exc if mapped is None else mapped

    def _distrust_writers(self) -> None:
        """The server was found gone (``journal_unavailable``): the writing connections,
        idle meanwhile, are reopened at their next use rather than found lost by a write
        that then fails -- after an outage the next write goes through."""
        self._writer.distrust()
        if self._lane is not None:
            self._lane.distrust()

    async def write_statement(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        """Run the one statement ``sql`` as a write transaction of its own; its rows (as
        :meth:`Transaction.last`) once it committed.

        On PostgreSQL it is sent from the event loop when the statement lane is free
        (``lane.py``: no hand-over to the writer thread), else, and on SQLite, it runs as
        :meth:`write` runs a closure. Durable, fenced and mapped the same either way.

        Raises:
            StoreError | JournalUnavailable: as :meth:`write`.
            sqlite3.IntegrityError: a constraint the statement broke.
        """
        lane = self._lane
        if lane is not None and lane.free():
            try:
                return await lane.run(sql, params)
            except sqlite3.IntegrityError:
                raise
            except LaneUnopened:
                # Nothing was sent: the writer thread runs it (below), on a fresh connection
                # (the server refused the lane's, so the writer's idle one is suspect too).
                self._writer.distrust()
            except Exception as exc:
                if not is_locked(exc):
                    failure = self._failure(exc)
                    if failure is exc:
                        raise
                    raise failure from exc
                # Lost a race (rolled back): the writer thread runs it again, and retries.
        return await self.write(lambda tx: tx.last(sql, params))


def _closed_error(location: str) -> StoreError:
    return StoreError(
        f"the job journal {location} is closed",
        remediation="This is a bug: the journal was used after its engine closed it.",
        details={"path": location},
    )


def _server_offset_ms(tx: Transaction) -> int:
    """The server's clock minus this host's ``CLOCK_MONOTONIC``, in ms."""
    now = int(tx.scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"))
    return now - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000


def _pg_error(exc: BaseException, target: PgTarget) -> SbproxyError:
    """Our error for a psycopg error on the journal at ``target`` (no secrets in it)."""
    if isinstance(exc, psycopg.OperationalError):
        return target.unavailable(exc)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    details: dict[str, str | int | float | bool | None] = {"path": target.describe()}
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str):
        details["sqlstate"] = sqlstate
    return StoreError(
        f"the job journal {target.describe()} failed: {first}",
        remediation="Check the PostgreSQL server's log; `sbproxy doctor` checks the journal.",
        details=details,
    )


async def _open_error(exc: sqlite3.DatabaseError, path: Path) -> StoreError:
    """Our error for a connection to ``path`` that could not be opened and configured."""
    if _is_full(exc, path.parent):
        return journal_error(exc, path)
    unwritable = await anyio.to_thread.run_sync(_unwritable_reason, path.parent)
    if unwritable is not None:
        return StoreError(
            f"cannot open the journal {path}: its directory {path.parent} is not "
            f"writable ({unwritable})",
            # The journal lives in the cache root (<root>/jobs/journal.db): the root is
            # what the operator chose wrongly, as for any other unwritable cache root.
            code="invalid_cache_dir",
            retryable=False,
            remediation="Make the directory writable for this user, or use a cache "
            "directory on a writable file system (--cache-dir or "
            "proxy.model_host.cache.directory); the journal itself is not damaged.",
            details={"path": str(path)},
        )
    return StoreError(
        f"cannot open the journal {path}: {exc}",
        remediation="Check that the file is a SQLite database and the disk is writable; "
        "move a damaged file aside to start a new journal.",
    )
