"""Driver errors of the journal leave the store as ours: ``disk_full`` or ``store_failed``.

Driver errors (and SQLAlchemy's codes such as ``e3q8``, from when the store ran on it) must
never reach a job, the CLI or the admin API. A full disk is ``disk_full`` naming the
journal, the bytes a write needs at least and the bytes free; anything else is
``store_failed`` with SQLite's message. Real SQLite throughout: a database capped with
``PRAGMA max_page_count`` (SQLite's own "database or disk is full"), and a real 1 MiB tmpfs
where this process may mount one.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from sbproxy.store import Database, StoreError, Transaction
from tests.support.small_fs import fill, small_filesystem

pytestmark = pytest.mark.anyio

ROW = b"r" * 16_384


async def make_table(database: Database) -> None:
    def work(tx: Transaction) -> None:
        tx.execute("CREATE TABLE filler (id INTEGER PRIMARY KEY, body BLOB)")

    await database.write(work)


async def insert_until_it_fails(database: Database, *, rows: int = 400) -> StoreError:
    def work(tx: Transaction) -> None:
        tx.execute("INSERT INTO filler (body) VALUES (:b)", {"b": ROW})

    for _ in range(rows):
        try:
            await database.write(work)
        except StoreError as exc:
            return exc
    raise AssertionError(f"{rows} rows of {len(ROW)} bytes all fit")


def assert_journal_full(error: StoreError, path: Path) -> None:
    assert error.code == "disk_full"
    assert error.retryable is False
    assert error.details["path"] == str(path)
    assert error.details["needed_bytes"] == 4096
    assert isinstance(error.details["free_bytes"], int)
    assert f"the job journal {path} cannot be written" in error.message
    assert "e3q8" not in str(error) and "sqlalche.me" not in str(error)
    assert "unfinished job stays resumable" in str(error)


async def test_sqlite_reporting_the_database_full_is_disk_full(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    database = await Database.open(path)
    try:
        await make_table(database)
        # The writer is the one connection that writes: cap it.
        await database.write(lambda tx: tx.execute("PRAGMA max_page_count = 64"))
        error = await insert_until_it_fails(database)
        assert_journal_full(error, path)
        assert type(error.__cause__).__name__ == "OperationalError"
    finally:
        await database.close()


async def test_a_journal_on_a_full_file_system_is_disk_full(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "jobs", size_bytes=1024 * 1024) as directory:
        path = directory / "journal.db"
        database = await Database.open(path)
        try:
            await make_table(database)
            fill(directory)
            error = await insert_until_it_fails(database)
            assert_journal_full(error, path)
            free = error.details["free_bytes"]
            assert isinstance(free, int) and free < 4096
        finally:
            await database.close()


async def test_opening_a_journal_on_a_full_file_system_is_disk_full(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "jobs", size_bytes=256 * 1024) as directory:
        fill(directory)
        path = directory / "journal.db"
        with pytest.raises(StoreError) as raised:
            await Database.open(path)
        assert_journal_full(raised.value, path)


async def test_any_other_driver_error_is_store_failed_with_sqlites_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    database = await Database.open(path)
    try:

        def broken_write(tx: Transaction) -> None:
            tx.execute("INSERT INTO no_such_table VALUES (1)")

        with pytest.raises(StoreError) as raised:
            await database.write(broken_write)
        assert raised.value.code == "store_failed"
        assert raised.value.message == (
            f"the job journal {path} failed: no such table: no_such_table"
        )
        assert raised.value.details == {"path": str(path), "sqlite_error": "SQLITE_ERROR"}

        with pytest.raises(StoreError) as read_failed:
            await database.read(lambda tx: tx.execute("SELECT x FROM nowhere"))
        assert read_failed.value.code == "store_failed"
        assert "no such table: nowhere" in read_failed.value.message
        assert "e3q8" not in str(raised.value) + str(read_failed.value)
    finally:
        await database.close()


async def test_a_broken_constraint_still_reaches_the_repository(tmp_path: Path) -> None:
    """``IntegrityError`` is an answer the repositories handle (a duplicate key), not a
    failure to translate."""
    database = await Database.open(tmp_path / "journal.db")
    try:

        def duplicate(tx: Transaction) -> None:
            tx.execute("CREATE TABLE once (id INTEGER PRIMARY KEY)")
            tx.execute("INSERT INTO once VALUES (1)")
            tx.execute("INSERT INTO once VALUES (1)")

        with pytest.raises(sqlite3.IntegrityError):
            await database.write(duplicate)
    finally:
        await database.close()
