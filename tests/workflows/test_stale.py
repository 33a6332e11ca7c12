"""Judging staleness: who is silent, why, and for how long (lease clock first, wall clock
only where the lease clock cannot measure)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from sbproxy.store import JobRecord, JobStatus, LeaseStamp, LeaseTime
from sbproxy.workflows import WorkerIdentity, staleness

BOOT = "boot-a"
WALL_MS = 10**12


def job(
    *, owner: str, lease: LeaseStamp | None, status: JobStatus = JobStatus.RUNNING
) -> JobRecord:
    return JobRecord(
        id="01JABCDEFGHJKMNPQRSTVWXYZ0",
        kind="remove",
        workflow_version=1,
        subject=None,
        input={},
        idempotency_key=None,
        status=status,
        attempt=1,
        lease_owner=owner,
        lease=lease,
        cancel_requested=False,
        progress=None,
        output=None,
        error=None,
        trace_context=None,
        created_at_ms=WALL_MS,
        updated_at_ms=WALL_MS,
        started_at_ms=WALL_MS,
        ended_at_ms=None,
    )


def dead_owner() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = WorkerIdentity.current()
    return f"{me.boot_id}/{child.pid}/{me.start_ticks}/dead"


# Renewed at 100_000 ms with a 15 s lease.
LEASE = LeaseStamp(clock=BOOT, deadline_ms=115_000, duration_ms=15_000)
ALIVE = WorkerIdentity.current().owner


def test_a_live_owner_under_a_live_lease_is_not_stale() -> None:
    assert (
        staleness(
            job(owner=ALIVE, lease=LEASE), [], lease_now=LeaseTime(BOOT, 110_000), now_ms=WALL_MS
        )
        is None
    )
    finished = job(owner=ALIVE, lease=None, status=JobStatus.SUCCEEDED)
    assert staleness(finished, [], lease_now=LeaseTime(BOOT, 110_000), now_ms=WALL_MS) is None


def test_a_dead_owner_is_stale_at_once_and_its_age_is_on_the_lease_clock() -> None:
    owner = dead_owner()
    found = staleness(
        job(owner=owner, lease=LEASE), [], lease_now=LeaseTime(BOOT, 103_000), now_ms=WALL_MS * 2
    )
    assert found is not None
    assert (found.reason, found.owner, found.age_ms, found.last_step) == (
        "owner_gone",
        owner,
        3_000,  # since the renewal, not since the wall-clock update
        None,
    )


def test_a_lapsed_lease_is_stale_and_an_unmeasurable_one_ages_on_the_wall_clock() -> None:
    lapsed = staleness(
        job(owner=ALIVE, lease=LEASE), [], lease_now=LeaseTime(BOOT, 160_000), now_ms=WALL_MS
    )
    assert lapsed is not None and (lapsed.reason, lapsed.age_ms) == ("lease_expired", 60_000)
    other_boot = dataclasses.replace(LEASE, clock="boot-b")
    rebooted = staleness(
        job(owner=ALIVE, lease=other_boot),
        [],
        lease_now=LeaseTime(BOOT, 1_000),
        now_ms=WALL_MS + 90_000,
    )
    assert rebooted is not None and (rebooted.reason, rebooted.age_ms) == ("lease_expired", 90_000)
