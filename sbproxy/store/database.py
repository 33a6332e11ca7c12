"""The SQLite database behind the job journal: connection setup and transactions.

Discipline (ARCHITECTURE.md, "SQLite discipline"; figures in measured-here.md):

* WAL journal, ``busy_timeout`` 30 s, ``synchronous=FULL`` by default (a commit survives
  power loss; ``NORMAL`` is offered for benchmarks and measured side by side).
* Every write is a short ``BEGIN IMMEDIATE`` transaction: a deferred transaction that later
  upgrades to a write fails with "database is locked" under contention (71 % of transactions
  with four processes here), an immediate one waits for the lock instead.
* The driver's own implicit ``BEGIN`` is disabled (``isolation_level = None``) so that the
  ``begin`` event decides the transaction mode.
* A write that still meets "database is locked" (a busy timeout elapsed) is retried with
  tenacity, a few times with jittered backoff; the transaction is rolled back first, so a
  retried write never applies twice.
* A driver error never leaves this module as itself (SQLAlchemy's carry their own codes,
  such as ``e3q8``, which are not ours): a full file system -- SQLite's ``SQLITE_FULL``,
  "database or disk is full", or ``ENOSPC`` / ``EDQUOT`` -- is :class:`StoreError`
  ``disk_full`` naming the journal, the bytes a write needs at least and the bytes free;
  any other is ``store_failed`` with SQLite's own message. ``IntegrityError`` alone passes
  through: the repositories catch it as an answer (a duplicate key), not a failure.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy import event
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from sbproxy.errors import SbproxyError

__all__ = ["Database", "StoreError", "Synchronous", "journal_error"]

Synchronous = Literal["FULL", "NORMAL"]
T = TypeVar("T")

# Milliseconds SQLite waits for a lock before reporting "database is locked".
BUSY_TIMEOUT_MS = 30_000
_LOCK_RETRY_ATTEMPTS = 5
# SQLite's page size (its default; never changed here): a write that cannot get one more
# page for the WAL or the database file fails, so this is the least a write needs.
JOURNAL_PAGE_BYTES = 4096
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class StoreError(SbproxyError):
    """The journal database could not be opened or written (code ``store_failed``)."""

    default_code = "store_failed"
    default_retryable = True


def _preflight(path: Path) -> None:
    # Open with the stdlib driver first: a damaged or foreign file fails here cleanly,
    # before the async pool holds a half-initialised connection.
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        connection.execute("PRAGMA schema_version").fetchone()
    finally:
        connection.close()


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


def _is_locked(exc: BaseException) -> bool:
    cause = getattr(exc, "orig", exc)
    return isinstance(cause, sqlite3.OperationalError) and "locked" in str(cause).lower()


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
    if isinstance(exc, IntegrityError):
        return False
    return isinstance(exc, DBAPIError | sqlite3.Error)


class Database:
    """An open journal database file.

    Use :meth:`open` to create one; close it with :meth:`close`. Safe to share between tasks
    of one event loop; every process opens its own.

    Attributes:
        path: The database file.
        synchronous: ``FULL`` or ``NORMAL``.
    """

    def __init__(self, engine: AsyncEngine, path: Path, synchronous: Synchronous) -> None:
        self._engine = engine
        self.path = path
        self.synchronous = synchronous

    @classmethod
    async def open(cls, path: Path, *, synchronous: Synchronous = "FULL") -> Database:
        """Open (creating if needed) the database at ``path`` and apply pending migrations.

        Raises:
            StoreError: ``store_failed`` when the directory cannot be created or the file is
                not a usable SQLite database; ``invalid_cache_dir`` (not retryable) when the
                directory cannot be written (read-only file system, no permission).
        """
        from sbproxy.store.migrations import migrate

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise journal_error(exc, path) from exc
            raise StoreError(
                f"cannot create the journal directory {path.parent}: {exc.strerror}",
                remediation="Check the cache directory's permissions and free space.",
            ) from exc
        try:
            await anyio.to_thread.run_sync(_preflight, path)
        except sqlite3.DatabaseError as exc:
            if _is_full(exc, path.parent):
                raise journal_error(exc, path) from exc
            unwritable = await anyio.to_thread.run_sync(_unwritable_reason, path.parent)
            if unwritable is not None:
                raise StoreError(
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
                ) from exc
            raise StoreError(
                f"cannot open the journal {path}: {exc}",
                remediation="Check that the file is a SQLite database and the disk is writable; "
                "move a damaged file aside to start a new journal.",
            ) from exc
        engine = create_async_engine(
            f"sqlite+aiosqlite:///{path}",
            pool_size=4,
            max_overflow=8,
            connect_args={"timeout": BUSY_TIMEOUT_MS / 1000},
        )

        @event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={synchronous}")
            cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _on_begin(connection: Any) -> None:
            mode = connection.get_execution_options().get("sbproxy_begin", "DEFERRED")
            connection.exec_driver_sql(f"BEGIN {mode}")

        database = cls(engine, path, synchronous)
        try:
            await migrate(database)
        except StoreError:
            await engine.dispose()
            raise
        except BaseException:
            await engine.dispose()
            raise
        return database

    async def close(self) -> None:
        """Close every pooled connection."""
        await self._engine.dispose()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read transaction (``BEGIN DEFERRED``): a consistent snapshot, no write lock.

        Opening and closing the connection are shielded from cancellation so that a
        cancelled reader never leaves a pooled connection half-closed.

        Raises:
            StoreError: ``disk_full`` or ``store_failed`` for a driver error in the block
                (see the module docstring).
        """
        try:
            with anyio.CancelScope(shield=True):
                connection = await self._engine.connect()
                transaction = await connection.begin()
        except Exception as exc:
            if _driver_failure(exc):
                raise journal_error(exc, self.path) from exc
            raise
        try:
            yield connection
        except Exception as exc:
            if _driver_failure(exc):
                raise journal_error(exc, self.path) from exc
            raise
        finally:
            with anyio.CancelScope(shield=True):
                # Nothing was written: ending with a rollback is the cheapest close.
                await transaction.rollback()
                await connection.close()

    async def write(self, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run ``work`` in one ``BEGIN IMMEDIATE`` transaction and commit it.

        ``work`` may run more than once if the database stays locked past the busy timeout;
        each failed attempt is rolled back before the next, so its effects apply once.

        Raises:
            StoreError: ``store_failed`` when the database stays locked after every retry or
                the driver fails otherwise; ``disk_full`` (not retryable) when the journal's
                file system is full -- the transaction is rolled back, nothing of it applies.
            IntegrityError: a constraint ``work`` broke (the caller's answer to handle).
        """
        retrying = AsyncRetrying(
            retry=retry_if_exception(_is_locked),
            stop=stop_after_attempt(_LOCK_RETRY_ATTEMPTS),
            wait=wait_random_exponential(multiplier=0.05, max=2),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    async with self._engine.connect() as connection:
                        immediate = await connection.execution_options(sbproxy_begin="IMMEDIATE")
                        async with immediate.begin():
                            return await work(immediate)
        except Exception as exc:
            if _is_locked(exc):
                raise StoreError(
                    f"the journal {self.path} stayed locked after {_LOCK_RETRY_ATTEMPTS} attempts",
                    remediation="Another process holds a long write transaction; retry.",
                ) from exc
            if _driver_failure(exc):
                raise journal_error(exc, self.path) from exc
            raise
        raise AssertionError("unreachable")  # pragma: no cover - tenacity reraises
