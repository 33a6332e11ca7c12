"""``JOB_TRANSITIONS`` checked against the SQL fences: every status a job can be in, put
through every store operation that moves a status, moves exactly along the table -- no
fence allows a move the table lacks, and every move the table lists has a fence."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from sbproxy.store import (
    JOB_TRANSITIONS,
    Database,
    ErrorInfo,
    JobStatus,
    JobStore,
    LeaseTime,
)

pytestmark = pytest.mark.anyio

LEASE_MS = 1_000
OWNER = "w"


class Clock:
    """An injected lease clock: moves only when the test says so."""

    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="test-boot", ms=self.ms)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobStore]:
    database = await Database.open(tmp_path / "journal.db")
    try:
        yield JobStore(database, lease_clock=Clock())
    finally:
        await database.close()


async def _running(store: JobStore) -> str:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    assert await store.claim(owner=OWNER, lease_ms=LEASE_MS, job_id=job_id) is not None
    return job_id


async def _finished(store: JobStore, status: JobStatus) -> str:
    job_id = await _running(store)
    error = None if status is JobStatus.SUCCEEDED else ErrorInfo("boom", "it failed")
    output = "1" if status is JobStatus.SUCCEEDED else None
    done = await store.finish(
        job_id, owner=OWNER, attempt=1, status=status, output_json=output, error=error
    )
    assert done is not None and done.status is status
    return job_id


async def _in(store: JobStore, status: JobStatus) -> str:
    """A fresh job in ``status``, reached through the store's own operations."""
    if status is JobStatus.QUEUED:
        return (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    if status is JobStatus.RUNNING:
        return await _running(store)
    if status is JobStatus.CANCELLED:
        job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
        await store.request_cancel(job_id)
        return job_id
    return await _finished(store, status)


def _operations(store: JobStore) -> dict[str, Callable[[str], Awaitable[object]]]:
    """Every store operation that may move a job's status, applied to one job."""

    def finish(status: JobStatus) -> Callable[[str], Awaitable[object]]:
        error = None if status is JobStatus.SUCCEEDED else ErrorInfo("boom", "it failed")
        return lambda job_id: store.finish(
            job_id, owner=OWNER, attempt=1, status=status, output_json="1", error=error
        )

    return {
        "claim": lambda job_id: store.claim(owner=OWNER, lease_ms=LEASE_MS, job_id=job_id),
        **{f"finish_{s.value}": finish(s) for s in JobStatus if s is not JobStatus.QUEUED},
        "request_cancel": store.request_cancel,
        "retry": store.retry,
        "requeue_from": lambda job_id: store.requeue_from(job_id, owner=OWNER, reason="t"),
        "recover_exhausted": lambda job_id: store.recover_from(
            job_id, owner=OWNER, reason="t", max_recoveries=0
        ),
    }


async def test_every_fenced_status_change_is_a_move_of_the_table(store: JobStore) -> None:
    observed: dict[tuple[JobStatus, JobStatus], list[str]] = {}
    for before in JobStatus:
        for name, operation in _operations(store).items():
            job_id = await _in(store, before)
            await operation(job_id)
            job = await store.get(job_id)
            assert job is not None
            if job.status is not before:
                observed.setdefault((before, job.status), []).append(name)
    allowed = {(a, b) for a, targets in JOB_TRANSITIONS.items() for b in targets}
    not_in_table = {edge: ops for edge, ops in observed.items() if edge not in allowed}
    assert not_in_table == {}, "a fence allows a move JOB_TRANSITIONS does not list"
    assert allowed - set(observed) == set(), "JOB_TRANSITIONS lists a move no fence makes"
