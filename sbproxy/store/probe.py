"""What ``sbproxy doctor`` shows of the journal: which one, its schema version, reachability.

Read-only and bounded: a SQLite journal is opened read-only (a missing file is reported, not
created), a PostgreSQL one gets one connection with a short timeout. Nothing shown carries a
password: a PostgreSQL journal is named ``postgresql://user@host:port/db``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg

from sbproxy.errors import SbproxyError
from sbproxy.store.deadline import DeadlineConnection, transport_params
from sbproxy.store.migrations import SCHEMA_VERSION
from sbproxy.store.postgres import PgTarget, is_postgres_url

__all__ = ["probe_journal"]

PROBE_TIMEOUT_S = 3
_VERSION = "SELECT COALESCE(MAX(version), 0) FROM schema_migrations"


def probe_journal(location: Path | str) -> dict[str, Any]:
    """The journal at ``location`` (a SQLite file or a ``postgresql://`` URL), as a report.

    Returns:
        ``{"backend": "sqlite" | "postgresql", "location": str, "reachable": bool,
        "schema_version": int | None, "supported_schema": int, "error": str | None,
        "code": str | None, "remediation": str | None}``; ``schema_version`` ``None`` when
        the journal is not created yet, or unknown (unreachable); ``code`` the reason code
        of ``error`` (``journal_unavailable``, ``invalid_journal_url``, ``store_failed``).
    """
    report: dict[str, Any] = {
        "backend": "sqlite",
        "location": str(location),
        "reachable": False,
        "schema_version": None,
        "supported_schema": SCHEMA_VERSION,
        "error": None,
        "code": None,
        "remediation": None,
    }
    if isinstance(location, str) and is_postgres_url(location):
        report["backend"] = "postgresql"
        try:
            target = PgTarget.parse(location)
        except SbproxyError as exc:
            report["location"] = "postgresql://(invalid URL)"
            report.update(error=exc.message, code="invalid_journal_url")
            return report
        report["location"] = target.describe()
        try:
            with DeadlineConnection.connect(
                target.conninfo,
                connect_timeout=PROBE_TIMEOUT_S,
                prepare_threshold=target.prepare_threshold,
                **transport_params(target.conninfo),
            ) as connection:
                # A server that accepts but never answers is unreachable, not a hang.
                connection.deadline_s = PROBE_TIMEOUT_S
                report["reachable"] = True
                exists = connection.execute(
                    "SELECT to_regclass('schema_migrations') IS NOT NULL"
                ).fetchone()
                if exists and exists[0]:
                    row = connection.execute(_VERSION).fetchone()
                    report["schema_version"] = int(row[0]) if row else None
        except psycopg.Error as exc:
            unavailable = target.unavailable(exc)
            report.update(
                error=unavailable.message,
                code=unavailable.code,
                remediation=unavailable.remediation,
            )
        return report
    path = Path(location)
    if not path.exists():
        report["reachable"] = True  # created at first use
        return report
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=PROBE_TIMEOUT_S) as raw:
            report["reachable"] = True
            report["schema_version"] = int(raw.execute(_VERSION).fetchone()[0])
    except sqlite3.Error as exc:
        report.update(error=f"cannot read the journal {path}: {exc}", code="store_failed")
    return report
