"""Make a real SQLite journal's writes fail the way a full disk makes them fail.

The error (``sqlite3.OperationalError: database or disk is full``, SQLite's ``SQLITE_FULL``
text) is raised where the driver runs the statement, so SQLAlchemy wraps it exactly as it
wraps a real one: an ``OperationalError`` whose own code is ``e3q8``. Reads still work, as on
a full disk. ``tests/support/small_fs.py`` gives the real thing where a tmpfs can be mounted.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import event

from sbproxy.store import Database

__all__ = ["JournalFull"]

_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class JournalFull:
    """While :attr:`on`, every write statement on ``database`` fails with SQLITE_FULL.

    Attributes:
        on: Whether writes fail now.
        failures: How many statements failed so far.
    """

    def __init__(self, database: Database) -> None:
        self.on = False
        self.failures = 0
        # The pool's engine is the one place the driver can be reached from outside.
        event.listen(database._engine.sync_engine, "before_cursor_execute", self._check)

    def _check(self, *args: Any) -> None:
        statement = str(args[2]).lstrip().upper()
        if self.on and statement.startswith(_WRITES):
            self.failures += 1
            raise sqlite3.OperationalError("database or disk is full")
