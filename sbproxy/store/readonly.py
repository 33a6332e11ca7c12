"""Reading the journal without the write path: stdlib ``sqlite3``, no migrations, no writes.

``sbproxy jobs list`` answers from a few ``SELECT`` statements; opening the journal through
:class:`~sbproxy.store.Database` would first load the write path (the repositories, the
writer thread, tenacity) and run the migration transaction, a write.
:class:`JournalReader` reads the same tables into the same records (``records.py``'s
decoders), ordered and filtered as :meth:`JobStore.list_jobs <sbproxy.store.JobStore.list_jobs>`
and :meth:`JobStore.steps <sbproxy.store.JobStore.steps>` do; a test holds their answers equal
on one journal.

It answers only where the answer is certainly the full store's: the file is a current-schema
(:data:`SCHEMA_VERSION`) WAL journal this process may write. Anything else -- an older schema
the store would migrate, a newer one it would refuse, a rollback-journal file it would switch
to WAL, a read-only directory, a damaged file, any SQLite error -- raises
:class:`ReaderDeclined`, and the caller asks the full store, which migrates, refuses or
reports the problem with its usual error.

The connection is opened read-write (``mode=rw``: never creating the file) although only
``SELECT`` runs on it, so that, like any other connection, the last one to close
checkpoints the WAL and removes the ``-wal`` and ``-shm`` files instead of leaving them
behind as a read-only connection would.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from sbproxy.errors import SbproxyError
from sbproxy.store.lifecycle import JobStatus
from sbproxy.store.records import (
    JobRecord,
    StepRecord,
    job_from_row,
    list_jobs_query,
    step_from_row,
)

__all__ = ["SCHEMA_VERSION", "JournalReader", "ReaderDeclined"]

SCHEMA_VERSION = 15
"""The journal schema these queries read: ``migrations.SCHEMA_VERSION`` (a test holds them
equal; a new migration makes this reader decline until its queries are checked again)."""

# Seconds SQLite waits for a lock, as for the full store (``database.BUSY_TIMEOUT_MS``). WAL
# readers do not wait for writers; only opening while another process recovers the WAL can.
_BUSY_TIMEOUT_S = 30.0


class ReaderDeclined(SbproxyError):
    """The reader cannot answer exactly as the full store would (code ``reader_declined``).

    Never shown to people: the caller asks the full store instead.
    """

    default_code = "reader_declined"


class JournalReader:
    """Read-only queries over an open journal file; close it (or use ``with``).

    Use :meth:`open`.
    """

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._connection = connection
        self.path = path

    @classmethod
    def open(cls, path: Path) -> JournalReader:
        """Open the journal at ``path`` for reading.

        Raises:
            ReaderDeclined: the file is missing, not writable here (nor its directory), not a
                WAL journal of :data:`SCHEMA_VERSION`, or SQLite fails to open it.
        """
        if not path.is_file():
            raise ReaderDeclined(f"no journal file at {path}")
        if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
            raise ReaderDeclined(f"the journal {path} or its directory is not writable")
        try:
            connection = sqlite3.connect(
                f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=_BUSY_TIMEOUT_S
            )
        except sqlite3.Error as exc:
            raise ReaderDeclined(f"cannot open the journal {path}: {exc}") from exc
        reader = cls(connection, path)
        try:
            reader._check_schema()
        except BaseException:
            connection.close()
            raise
        connection.row_factory = sqlite3.Row
        return reader

    def _check_schema(self) -> None:
        try:
            (mode,) = self._connection.execute("PRAGMA journal_mode").fetchone()
            (version,) = self._connection.execute(
                "SELECT COALESCE(MAX(version), 0) FROM schema_migrations"
            ).fetchone()
        except sqlite3.Error as exc:
            raise ReaderDeclined(f"cannot read the journal {self.path}: {exc}") from exc
        if str(mode).lower() != "wal" or version != SCHEMA_VERSION:
            raise ReaderDeclined(
                f"the journal {self.path} is a {mode} journal of schema {version}, "
                f"not a WAL journal of schema {SCHEMA_VERSION}"
            )

    def close(self) -> None:
        """Close the connection (checkpointing the WAL when it is the last one)."""
        self._connection.close()

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _rows(self, query: str, params: Sequence[object]) -> list[sqlite3.Row]:
        try:
            return self._connection.execute(query, params).fetchall()
        except sqlite3.Error as exc:
            raise ReaderDeclined(f"cannot read the journal {self.path}: {exc}") from exc

    def list_jobs(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        kind: str | None = None,
        subject: str | None = None,
        limit: int = 100,
    ) -> list[JobRecord]:
        """Jobs newest first, filtered as :meth:`JobStore.list_jobs` filters them
        (``limit`` ``-1``: every match).

        Raises:
            ReaderDeclined: SQLite failed to read.
        """
        query, params = list_jobs_query(statuses=statuses, kind=kind, subject=subject, limit=limit)
        return [job_from_row(row) for row in self._rows(query, params)]

    def steps(self, job_id: str) -> list[StepRecord]:
        """The journal of ``job_id`` in step order.

        Raises:
            ReaderDeclined: SQLite failed to read.
        """
        rows = self._rows("SELECT * FROM steps WHERE job_id = ? ORDER BY seq", [job_id])
        return [step_from_row(row) for row in rows]
