"""The ``admin_managed`` revision documents in the shared PostgreSQL journal.

Hosts sharing a PostgreSQL journal share their desired state too: the revision documents
(``sbproxy.model_host.runtime.desired_store``) are rows of ``desired_revisions``, one per
revision. A write is a compare-and-set on the revision by the primary key itself: the row of
revision ``n + 1`` is inserted only when the newest row is ``n`` (or the table is empty for
``n = None``), and of two hosts writing ``n + 1`` at once the key admits one; the other learns
the revision it lost to. Synchronous and short (one connection per call, ``autocommit`` off,
one transaction), as the file store it replaces is: its callers run it on a worker thread.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from sbproxy.store.deadline import DeadlineConnection, transport_params
from sbproxy.store.migrations import migrate_postgres
from sbproxy.store.postgres import STATEMENT_DEADLINE_S, PgTarget

__all__ = ["SharedRevisions"]

FLEET_CHANNEL = "sbproxy_fleet"
"""The ``LISTEN``/``NOTIFY`` channel of fleet changes (``fleet.py``)."""
_LATEST = "SELECT revision, document FROM desired_revisions ORDER BY revision DESC LIMIT 1"
_INSERT_NEXT = (
    "INSERT INTO desired_revisions (revision, document, committed_at_ms)"
    " SELECT %(revision)s, %(document)s, %(now)s"
    " WHERE (SELECT MAX(revision) FROM desired_revisions) IS NOT DISTINCT FROM %(expected)s"
    " ON CONFLICT (revision) DO NOTHING"
)


class SharedRevisions:
    """Revision documents in the journal database at ``url`` (module docstring).

    The schema comes from the journal's migrations (migration 7), which every host runs
    when it opens the journal.
    """

    def __init__(self, url: str) -> None:
        self.target = PgTarget.parse(url)
        self._migrated = False

    def _ensure_schema(self) -> None:
        """Run the journal's migrations once (this store is read at start, before the host
        opens its journal); a no-op on an up-to-date journal.

        Raises:
            StoreError: ``journal_schema_newer``; JournalUnavailable.
        """
        if self._migrated:
            return
        migrate_postgres(self.target)
        self._migrated = True

    @property
    def location(self) -> str:
        """``postgresql://user@host:port/db`` (never the password)."""
        return self.target.describe()

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            connection = DeadlineConnection.connect(
                self.target.conninfo,
                connect_timeout=5,
                prepare_threshold=self.target.prepare_threshold,
                **transport_params(self.target.conninfo),
            )
        except psycopg.OperationalError as exc:
            raise self.target.unavailable(exc) from None
        # A server gone silent ends the call (journal_unavailable), as on the journal's own.
        connection.deadline_s = STATEMENT_DEADLINE_S
        return connection

    def latest(self) -> tuple[int, str] | None:
        """``(revision, document JSON)`` of the newest revision, or ``None`` when empty.

        Raises:
            JournalUnavailable: ``journal_unavailable`` when the server cannot be reached.
        """
        self._ensure_schema()
        try:
            with self._connect() as connection:
                row = connection.execute(_LATEST).fetchone()
        except psycopg.OperationalError as exc:
            raise self.target.unavailable(exc) from None
        return None if row is None else (int(row[0]), str(row[1]))

    def insert_next(self, *, expected: int | None, revision: int, document: str) -> int | None:
        """Insert ``document`` as ``revision`` if the newest revision is still ``expected``.

        Returns:
            ``None`` when it was written; else the revision the store is at (the winner's;
            0 when it is still empty).

        Raises:
            JournalUnavailable: ``journal_unavailable`` when the server cannot be reached.
        """
        self._ensure_schema()
        try:
            with self._connect() as connection:
                written = connection.execute(
                    _INSERT_NEXT,
                    {
                        "revision": revision,
                        "document": document,
                        "now": time.time_ns() // 1_000_000,
                        "expected": expected,
                    },
                ).rowcount
                if written == 1:
                    # Fleet hosts re-plan and re-route at once (FleetStore.wait_for_change).
                    connection.execute("SELECT pg_notify(%s, 'desired')", (FLEET_CHANNEL,))
                    return None
                row = connection.execute("SELECT MAX(revision) FROM desired_revisions").fetchone()
        except psycopg.OperationalError as exc:
            raise self.target.unavailable(exc) from None
        actual = None if row is None or row[0] is None else int(row[0])
        return actual if actual is not None else 0
