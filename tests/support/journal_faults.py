"""Make a real SQLite journal's writes fail the way a full disk makes them fail.

The error (``sqlite3.OperationalError: database or disk is full``, SQLite's ``SQLITE_FULL``
text) is raised on the connection's thread just before the statement runs, where the driver
would raise a real one, so the store meets it exactly as it meets a real one. Reads still
work, as on a full disk. ``tests/support/small_fs.py`` gives the real thing where a tmpfs
can be mounted.
"""

from __future__ import annotations

import sqlite3

from sbproxy.store import Database, JobJournal, JobStore

__all__ = ["JournalFull"]

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class JournalFull:
    """While :attr:`on`, every write statement on the journal fails with SQLITE_FULL.

    Attributes:
        on: Whether writes fail now.
        failures: How many statements failed so far.
    """

    def __init__(self, journal: Database | JobJournal) -> None:
        self.on = False
        self.failures = 0
        if not isinstance(journal, Database):
            assert isinstance(journal, JobStore), "faults are armed on the SQLite journal"
            journal = journal.database
        journal.add_statement_hook(self._check)

    def _check(self, sql: str) -> None:
        statement = sql.lstrip().upper()
        if self.on and statement.startswith(_WRITES):
            self.failures += 1
            raise sqlite3.OperationalError("database or disk is full")
