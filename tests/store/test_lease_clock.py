"""Leases live on the lease clock: a wall-clock step neither expires a live lease nor keeps a
dead one alive, another boot's lease has lapsed, and a schema-3 journal migrates."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from sbproxy.store import (
    Database,
    JobStatus,
    JobStore,
    LeaseStamp,
    LeaseTime,
    boot_id,
    wall_clock_ms,
)
from sbproxy.store.migrations import MIGRATIONS, SCHEMA_VERSION

pytestmark = pytest.mark.anyio

HOUR_MS = 3_600_000


class WallClock:
    """An injected wall clock that follows the real one until a test steps it."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return wall_clock_ms() + self.offset_ms


async def submit(store: JobStore) -> str:
    outcome = await store.submit(kind="demo", workflow_version=1, input_json="{}")
    return outcome.job.id


@pytest.mark.parametrize("step_ms", [HOUR_MS, -HOUR_MS])
async def test_a_wall_clock_step_does_not_expire_a_live_lease(
    database: Database, step_ms: int
) -> None:
    wall = WallClock()
    store = JobStore(database, clock=wall)  # the real lease clock
    job_id = await submit(store)
    assert await store.claim(owner="w", lease_ms=60_000) is not None
    wall.offset_ms = step_ms
    assert await store.requeue_expired() == []
    assert await store.heartbeat(job_id, owner="w", attempt=1, lease_ms=60_000)
    assert await store.requeue_expired() == []
    job = await store.get(job_id)
    assert job is not None
    assert (job.status, job.lease_owner, job.attempt) == (JobStatus.RUNNING, "w", 1)
    # Displayed times follow the (stepped) wall clock; the lease does not.
    assert abs(job.updated_at_ms - (wall_clock_ms() + step_ms)) < 60_000


@pytest.mark.parametrize("step_ms", [HOUR_MS, -HOUR_MS])
async def test_a_wall_clock_step_does_not_keep_a_dead_lease_alive(
    database: Database, step_ms: int
) -> None:
    wall = WallClock()
    store = JobStore(database, clock=wall)
    job_id = await submit(store)
    assert await store.claim(owner="dead", lease_ms=200) is not None
    wall.offset_ms = step_ms
    await anyio.sleep(0.3)  # real time: the lease lapses on the monotonic clock
    assert await store.requeue_expired() == [job_id]
    job = await store.get(job_id)
    assert job is not None
    assert (job.status, job.lease_owner, job.lease) == (JobStatus.QUEUED, None, None)
    assert not await store.heartbeat(job_id, owner="dead", attempt=1, lease_ms=200)


async def test_a_lease_is_stamped_on_this_boots_monotonic_clock(database: Database) -> None:
    store = JobStore(database)
    await submit(store)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000
    claimed = await store.claim(owner="w", lease_ms=15_000)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000
    assert claimed is not None and claimed.lease is not None
    assert claimed.lease.clock == boot_id()
    assert claimed.lease.duration_ms == 15_000
    assert before + 15_000 <= claimed.lease.deadline_ms <= after + 15_000
    shown = claimed.to_dict()
    assert shown["lease_clock"] == boot_id()
    assert shown["lease_deadline_ms"] == claimed.lease.deadline_ms
    assert shown["lease_ms"] == 15_000
    assert "lease_expires_at_ms" not in shown


def fixed(clock: str, ms: int) -> LeaseTime:
    return LeaseTime(clock=clock, ms=ms)


async def test_a_lease_from_another_boot_has_lapsed_at_once(database: Database) -> None:
    owner = JobStore(database, lease_clock=lambda: fixed("boot-a", 1_000))
    job_id = await submit(owner)
    await owner.claim(owner="w", lease_ms=60_000)
    assert await owner.requeue_expired() == []
    after_reboot = JobStore(database, lease_clock=lambda: fixed("boot-b", 1_000))
    assert await after_reboot.requeue_expired() == [job_id]


async def test_a_lease_renewed_ahead_of_this_clock_has_lapsed(database: Database) -> None:
    # Where no boot id can be read, every boot is "unknown-boot": a lease from before a
    # reboot is then recognised by its renewal lying in the future of this clock.
    owner = JobStore(database, lease_clock=lambda: fixed("unknown-boot", 9_000_000))
    job_id = await submit(owner)
    await owner.claim(owner="w", lease_ms=60_000)
    rebooted = JobStore(database, lease_clock=lambda: fixed("unknown-boot", 5_000))
    assert await rebooted.requeue_expired() == [job_id]


RENEWAL_MS = 100_000
LEASE_MS = 10_000


@pytest.mark.parametrize("clock", ["boot-a", "boot-b"])
@pytest.mark.parametrize(
    "now_ms",
    [
        RENEWAL_MS - 1,
        RENEWAL_MS,
        RENEWAL_MS + LEASE_MS - 1,
        RENEWAL_MS + LEASE_MS,
        RENEWAL_MS + LEASE_MS + 1,
    ],
)
async def test_recovery_and_the_lease_record_agree_on_what_has_lapsed(
    database: Database, clock: str, now_ms: int
) -> None:
    owner = JobStore(database, lease_clock=lambda: fixed("boot-a", RENEWAL_MS))
    job_id = await submit(owner)
    claimed = await owner.claim(owner="w", lease_ms=LEASE_MS)
    assert claimed is not None and claimed.lease is not None
    now = fixed(clock, now_ms)
    observer = JobStore(database, lease_clock=lambda: now)
    requeued = await observer.requeue_expired()
    assert (requeued == [job_id]) == claimed.lease.lapsed(now)
    expected = clock == "boot-b" or now_ms in (RENEWAL_MS - 1, RENEWAL_MS + LEASE_MS + 1)
    assert claimed.lease.lapsed(now) == expected


def test_remaining_time_of_a_lease() -> None:
    lease = LeaseStamp(clock="boot-a", deadline_ms=110_000, duration_ms=10_000)
    assert lease.remaining_ms(fixed("boot-a", 100_000)) == 10_000
    assert lease.remaining_ms(fixed("boot-a", 125_000)) == -15_000
    assert lease.remaining_ms(fixed("boot-a", 99_999)) is None
    assert lease.remaining_ms(fixed("boot-b", 100_000)) is None


def schema_3_journal(path: Path) -> None:
    """A journal as the sbproxy before leases moved off the wall clock left it."""
    with sqlite3.connect(path) as raw:
        raw.execute(
            "CREATE TABLE schema_migrations (version INTEGER NOT NULL PRIMARY KEY,"
            " description TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)"
        )
        for version, description, statements in MIGRATIONS:
            if version > 3:
                break
            for statement in statements:
                raw.execute(statement)
            raw.execute("INSERT INTO schema_migrations VALUES (?, ?, 0)", (version, description))
        now = wall_clock_ms()
        raw.executemany(
            "INSERT INTO jobs (id, kind, workflow_version, input_json, status, attempt,"
            " lease_owner, lease_expires_at_ms, created_at_ms, updated_at_ms)"
            " VALUES (?, 'demo', 1, '{}', ?, ?, ?, ?, ?, ?)",
            [
                ("running-before", "running", 1, "old-owner", now + HOUR_MS, now, now),
                ("queued-before", "queued", 0, None, None, now, now),
            ],
        )


async def test_a_schema_3_journal_migrates_and_its_wall_clock_lease_lapses(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    schema_3_journal(path)
    database = await Database.open(path)
    try:
        with sqlite3.connect(path) as raw:
            version = raw.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
            legacy = raw.execute("SELECT lease_expires_at_ms FROM jobs").fetchall()
        assert version == SCHEMA_VERSION
        assert legacy == [(None,), (None,)]
        store = JobStore(database)
        running = await store.get("running-before")
        assert running is not None
        assert (running.status, running.lease_owner, running.lease) == (
            JobStatus.RUNNING,
            "old-owner",
            None,
        )
        # A wall-clock lease says nothing on the lease clock: recovery takes the job at once.
        assert await store.requeue_expired() == ["running-before"]
        assert not await store.heartbeat(
            "running-before", owner="old-owner", attempt=1, lease_ms=1_000
        )
        claimed = await store.claim(owner="new", lease_ms=5_000, job_id="running-before")
        assert claimed is not None and claimed.lease is not None
        assert (claimed.attempt, claimed.lease.clock) == (2, boot_id())
        queued = await store.get("queued-before")
        assert queued is not None and queued.status == JobStatus.QUEUED
    finally:
        await database.close()
