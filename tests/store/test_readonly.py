"""``JournalReader``: the stdlib-``sqlite3`` reader answers exactly as the full store does, and
declines wherever it could not."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from itertools import product
from pathlib import Path

import pytest

from sbproxy.store import Database, JobStatus, JobStore, JournalReader, ReaderDeclined, readonly
from sbproxy.store.migrations import SCHEMA_VERSION
from tests.support.journals import fill_varied_journal

pytestmark = pytest.mark.anyio


@pytest.fixture
async def journal(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    path = tmp_path / "jobs" / "journal.db"
    return path, await fill_varied_journal(path)


@pytest.fixture
async def store(journal: tuple[Path, dict[str, str]]) -> AsyncIterator[JobStore]:
    database = await Database.open(journal[0])
    try:
        yield JobStore(database)
    finally:
        await database.close()


def test_reads_the_schema_the_migrations_write() -> None:
    assert readonly.SCHEMA_VERSION == SCHEMA_VERSION


async def test_lists_the_same_records_as_the_store_for_every_filter(
    journal: tuple[Path, dict[str, str]], store: JobStore
) -> None:
    path, ids = journal
    status_filters: list[tuple[JobStatus, ...]] = [
        (),
        (JobStatus.RUNNING,),
        (JobStatus.QUEUED, JobStatus.FAILED, JobStatus.PARKED),
        (JobStatus.SUCCEEDED, JobStatus.CANCELLED),
    ]
    subjects = [None, "artifact:sha256:" + f"{1:064x}", "artifact:sha256:none"]
    with JournalReader.open(path) as reader:
        for statuses, kind, subject, limit in product(
            status_filters, [None, "pull", "gc", "nope"], subjects, [100, 3, 1, -1]
        ):
            expected = await store.list_jobs(
                statuses=statuses, kind=kind, subject=subject, limit=limit
            )
            read = reader.list_jobs(statuses=statuses, kind=kind, subject=subject, limit=limit)
            assert read == expected, (statuses, kind, subject, limit)
        everything = reader.list_jobs(limit=-1)
        assert {job.id for job in everything} == set(ids.values())
        for job_id in [*ids.values(), "01NOSUCHJOB0000000000000000"]:
            assert reader.steps(job_id) == await store.steps(job_id)
    # The records carry every column: errors, progress, leases, outputs, trace contexts.
    by_id = {job.id: job for job in everything}
    assert by_id[ids["failed"]].error is not None
    assert by_id[ids["succeeded"]].output == {"digest": "abc"}
    assert by_id[ids["running_live"]].lease is not None
    assert by_id[ids["cancel_requested"]].cancel_requested


async def test_leaves_no_wal_files_behind(journal: tuple[Path, dict[str, str]]) -> None:
    path, _ = journal
    with JournalReader.open(path) as reader:
        reader.list_jobs()
    assert sorted(p.name for p in path.parent.iterdir()) == ["journal.db"]


async def test_declines_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ReaderDeclined):
        JournalReader.open(tmp_path / "journal.db")
    assert not (tmp_path / "journal.db").exists()


async def test_declines_an_older_schema_the_store_would_migrate(
    journal: tuple[Path, dict[str, str]],
) -> None:
    path, _ = journal
    with sqlite3.connect(path) as raw:
        raw.execute("DELETE FROM schema_migrations WHERE version = ?", (SCHEMA_VERSION,))
    with pytest.raises(ReaderDeclined, match="schema"):
        JournalReader.open(path)


async def test_declines_a_newer_schema_the_store_would_refuse(
    journal: tuple[Path, dict[str, str]],
) -> None:
    path, _ = journal
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT INTO schema_migrations VALUES (?, 'from the future', 0)", (SCHEMA_VERSION + 1,)
        )
    with pytest.raises(ReaderDeclined, match="schema"):
        JournalReader.open(path)


async def test_declines_a_rollback_journal_the_store_would_switch_to_wal(
    journal: tuple[Path, dict[str, str]],
) -> None:
    path, _ = journal
    with sqlite3.connect(path) as raw:
        raw.execute("PRAGMA journal_mode=DELETE")
    with pytest.raises(ReaderDeclined, match="delete journal"):
        JournalReader.open(path)


async def test_declines_a_file_that_is_not_a_journal(tmp_path: Path) -> None:
    damaged = tmp_path / "journal.db"
    damaged.write_bytes(b"not a database, just bytes\n" * 200)
    with pytest.raises(ReaderDeclined):
        JournalReader.open(damaged)
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    with pytest.raises(ReaderDeclined):
        JournalReader.open(empty)


async def test_declines_a_journal_this_process_may_not_write(
    journal: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root, whom file modes do not stop; the reader asks access(2), as here.
    path, _ = journal
    monkeypatch.setattr(os, "access", lambda target, mode: Path(target) != path.parent)
    with pytest.raises(ReaderDeclined, match="not writable"):
        JournalReader.open(path)
