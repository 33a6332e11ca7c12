"""Moving a SQLite journal into a PostgreSQL one (``sbproxy journal migrate --to URL``).

Everything the journal holds is copied in one PostgreSQL transaction -- jobs, their steps
and events (event ``seq`` kept, the identity moved past it), deployment generations,
committed runtime revisions and token usage -- so the target is either complete or
untouched. Refused (nothing written) when:

* a job on the source still holds a live lease (``journal_in_use``): a host or CLI process
  is running it; stop it first (a lapsed lease is copied and recovered on PostgreSQL);
* the target already holds jobs (``journal_not_empty``): never merged into.

Copied jobs that recorded no node (SQLite journals before schema 6) get this node's id:
they act on this node's cache and engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbproxy.errors import SbproxyError
from sbproxy.store.database import Database, Transaction
from sbproxy.store.leaseclock import LeaseStamp, system_lease_time
from sbproxy.store.node import node_id

__all__ = ["CopyReport", "copy_journal"]

# Tables in dependency order (jobs before what references them).
TABLES = (
    "jobs",
    "steps",
    "job_events",
    "deployment_generations",
    "runtime_revisions",
    "token_usage",
)
# Identity columns whose sequence must move past the copied values.
_IDENTITIES = (("job_events", "seq"), ("runtime_revisions", "revision"))


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_journal` copied: rows per table."""

    rows: dict[str, int]


def _read_all(tx: Transaction) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    for table in TABLES:
        rows = tx.all(f"SELECT * FROM {table}")  # noqa: S608 - fixed table names
        columns = [row[1] for row in tx.all(f"PRAGMA table_info({table})")]
        tables[table] = (columns, [tuple(row) for row in rows])
    return tables


def _live_leases(tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]]) -> list[str]:
    columns, rows = tables["jobs"]
    at = {name: index for index, name in enumerate(columns)}
    now = system_lease_time()
    live = []
    for row in rows:
        if row[at["status"]] != "running":
            continue
        clock, deadline, length = (
            row[at["lease_clock"]],
            row[at["lease_deadline_ms"]],
            row[at["lease_ms"]],
        )
        if clock is None or deadline is None or length is None:
            continue
        if not LeaseStamp(clock, int(deadline), int(length)).lapsed(now):
            live.append(str(row[at["id"]]))
    return live


async def copy_journal(source: Path, target_url: str) -> CopyReport:
    """Copy the SQLite journal at ``source`` into the PostgreSQL journal at ``target_url``.

    Both are opened (and migrated) first, so they share one schema version.

    Raises:
        SbproxyError: ``journal_in_use`` (a live lease on the source; details ``jobs``),
            ``journal_not_empty`` (the target holds jobs), ``journal_unavailable``,
            ``store_failed``; nothing is written to the target then.
    """
    sqlite = await Database.open(source)
    try:
        tables = await sqlite.read(_read_all)
    finally:
        await sqlite.close()
    live = _live_leases(tables)
    if live:
        raise SbproxyError(
            f"the journal {source} is in use: {len(live)} running job(s) hold a live lease "
            f"({', '.join(live[:5])})",
            code="journal_in_use",
            remediation="Stop the host (and any CLI job) using this cache, then migrate.",
            details={"jobs": ",".join(live)},
        )
    target = await Database.open(target_url)
    try:
        copied = await target.write(lambda tx: _write_all(tx, tables, node_id()))
    finally:
        await target.close()
    return CopyReport(rows=copied)


def _write_all(
    tx: Transaction, tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]], node: str
) -> dict[str, int]:
    if tx.scalar("SELECT 1 FROM jobs LIMIT 1") is not None:
        raise SbproxyError(
            "the target journal already holds jobs; a journal is copied only into an empty one",
            code="journal_not_empty",
            remediation="Name a new, empty database (CREATE DATABASE ...).",
        )
    copied: dict[str, int] = {}
    for table in TABLES:
        columns, rows = tables[table]
        if table == "jobs":
            at = columns.index("node")
            rows = [(*row[:at], row[at] or node, *row[at + 1 :]) for row in rows]
        names = ", ".join(columns)
        marks = ", ".join("?" for _ in columns)
        tx.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)  # noqa: S608
        copied[table] = len(rows)
    for table, column in _IDENTITIES:
        tx.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'),"  # noqa: S608 - fixed
            f" COALESCE((SELECT MAX({column}) FROM {table}), 0) + 1, false)"
        )
    return copied
