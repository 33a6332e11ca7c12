"""Fenced runner writes and bounded recovery, at the repository: a claim that recovery took
away (same owner id, older attempt) changes nothing, and recovery stops re-queueing a job
that keeps dying without completing a step."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sbproxy.store import (
    RECOVERY_EXHAUSTED,
    Database,
    EndedStep,
    ErrorInfo,
    JobStatus,
    JobStore,
    LeaseTime,
    StepRecord,
    StepRefusal,
    Transaction,
)

pytestmark = pytest.mark.anyio

LEASE_MS = 1_000


class Clock:
    """An injected lease clock: moves only when the test says so."""

    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="test-boot", ms=self.ms)

    def lapse(self) -> None:
        self.ms += LEASE_MS + 1


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(journal_location: Path | str, clock: Clock) -> AsyncIterator[JobStore]:
    database = await Database.open(journal_location)
    try:
        yield JobStore(database, lease_clock=clock)
    finally:
        await database.close()


async def snapshot(store: JobStore) -> tuple[list[Any], list[Any], list[Any]]:
    """Every row of jobs, steps and events, as tuples (read in one snapshot)."""

    def read(tx: Transaction) -> tuple[list[Any], list[Any], list[Any]]:
        return (
            [tuple(row) for row in tx.all("SELECT * FROM jobs ORDER BY id")],
            [tuple(row) for row in tx.all("SELECT * FROM steps ORDER BY job_id, seq")],
            [tuple(row) for row in tx.all("SELECT * FROM job_events ORDER BY seq")],
        )

    return await store.database.read(read)


async def reclaimed_by_the_same_owner(store: JobStore, clock: Clock) -> str:
    """A job claimed by ``w`` (attempt 1, step 0 begun), recovered, and claimed by ``w``
    again (attempt 2): the attempt is all that tells the two claims apart."""
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    assert await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id) is not None
    first = await store.begin_step(job_id, owner="w", attempt=1, seq=0, name="fetch")
    assert isinstance(first, StepRecord)
    clock.lapse()
    assert await store.requeue_expired() == [job_id]
    second = await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id)
    assert second is not None and (second.lease_owner, second.attempt) == ("w", 2)
    again = await store.begin_step(job_id, owner="w", attempt=2, seq=0, name="fetch")
    assert isinstance(again, StepRecord) and again.attempts == 2
    return job_id


async def test_every_write_of_a_claim_that_recovery_took_changes_nothing(
    store: JobStore, clock: Clock
) -> None:
    job_id = await reclaimed_by_the_same_owner(store, clock)
    before = await snapshot(store)
    assert not await store.heartbeat(job_id, owner="w", attempt=1, lease_ms=LEASE_MS)
    assert not await store.report_progress(
        job_id, owner="w", attempt=1, progress={"done": 1}, event=True
    )
    assert not await store.end_step(
        job_id, owner="w", attempt=1, seq=0, name="fetch", output_json='"old"'
    )
    assert not await store.end_step(
        job_id, owner="w", attempt=1, seq=0, name="fetch", error=ErrorInfo("internal", "old run")
    )
    assert (
        await store.begin_step(job_id, owner="w", attempt=1, seq=1, name="next")
        == StepRefusal.LEASE_LOST
    )
    ending = EndedStep(seq=0, name="fetch", output_json='"old"')
    assert (
        await store.begin_step(job_id, owner="w", attempt=1, seq=1, name="next", ending=ending)
        == StepRefusal.LEASE_LOST
    )
    assert not await store.finish(
        job_id, owner="w", attempt=1, status=JobStatus.SUCCEEDED, output_json="1"
    )

    assert await snapshot(store) == before  # not a row, not an event
    # The claim that holds the job writes as before.
    assert await store.heartbeat(job_id, owner="w", attempt=2, lease_ms=LEASE_MS)
    assert await store.end_step(
        job_id, owner="w", attempt=2, seq=0, name="fetch", output_json='"new"'
    )
    assert await store.finish(
        job_id, owner="w", attempt=2, status=JobStatus.SUCCEEDED, output_json="2"
    )
    (step,) = await store.steps(job_id)
    assert (step.status, step.attempts, step.output_json) == ("succeeded", 2, '"new"')


async def test_begin_step_tells_cancellation_from_a_lost_lease(
    store: JobStore, clock: Clock
) -> None:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    assert await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id) is not None
    await store.request_cancel(job_id)
    assert await store.begin_step(job_id, owner="w", attempt=1, seq=0, name="a") == (
        StepRefusal.CANCELLED
    )
    assert await store.begin_step(job_id, owner="other", attempt=1, seq=0, name="a") == (
        StepRefusal.LEASE_LOST
    )
    assert await store.steps(job_id) == []


async def claim_and_die_in(store: JobStore, clock: Clock, job_id: str, attempt: int) -> None:
    """One run: claim, begin step 0 (``fetch``), die; the lease lapses."""
    claimed = await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id)
    assert claimed is not None and claimed.attempt == attempt
    await store.begin_step(job_id, owner="w", attempt=attempt, seq=0, name="fetch")
    clock.lapse()


async def test_recovery_is_counted_and_bounded_and_a_completed_step_resets_it(
    store: JobStore, clock: Clock
) -> None:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    for attempt in (1, 2):
        await claim_and_die_in(store, clock, job_id, attempt)
        recovered = await store.recover_lapsed(max_recoveries=2)
        assert (recovered.requeued, recovered.exhausted) == ((job_id,), ())
        job = await store.get(job_id)
        assert job is not None and (job.status, job.recoveries) == (JobStatus.QUEUED, attempt)

    # A step completes: the count starts over.
    claimed = await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id)
    assert claimed is not None and claimed.recoveries == 2
    await store.begin_step(job_id, owner="w", attempt=3, seq=0, name="fetch")
    assert await store.end_step(job_id, owner="w", attempt=3, seq=0, name="fetch", output_json="1")
    job = await store.get(job_id)
    assert job is not None and job.recoveries == 0

    # Then two more deaths in step 1 are recovered; the third is one too many.
    for attempt in (3, 4, 5):
        if attempt > 3:
            assert await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id) is not None
        await store.begin_step(job_id, owner="w", attempt=attempt, seq=1, name="publish")
        clock.lapse()
        recovered = await store.recover_lapsed(max_recoveries=2)
        expected = ((), (job_id,)) if attempt == 5 else ((job_id,), ())
        assert (recovered.requeued, recovered.exhausted) == expected

    job = await store.get(job_id)
    assert job is not None
    assert (job.status, job.lease_owner, job.recoveries) == (JobStatus.FAILED, None, 2)
    assert job.error is not None and job.error.code == RECOVERY_EXHAUSTED
    message = job.error.message
    assert "recovered 2 times without completing a step" in message
    assert "last step 'publish' (#1, running, begun 3 times)" in message
    assert "no error recorded" in message
    assert f"sbproxy jobs retry {job_id}" in message
    events = [e.data for e in await store.events(job_id) if e.type == "status"]
    assert events[-1] == {
        "status": "failed",
        "reason": RECOVERY_EXHAUSTED,
        "step": "publish",
        "error": {"code": RECOVERY_EXHAUSTED, "message": message},
    }
    assert [e.get("recovery") for e in events if e.get("reason") == "lease_expired"] == [
        1,
        2,
        1,
        2,
    ]

    # An operator's retry revives it with the full count again.
    retried = await store.retry(job_id)
    assert retried is not None and (retried.status, retried.recoveries) == (JobStatus.QUEUED, 0)


async def test_a_step_ended_with_the_next_start_resets_the_count_only_when_asked(
    store: JobStore, clock: Clock
) -> None:
    # A runner that knows the count is 0 (its claim found it so, or it reset it already)
    # asks for no reset; one that does not know asks, and the count starts over.
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    await claim_and_die_in(store, clock, job_id, 1)
    assert (await store.recover_lapsed(max_recoveries=2)).requeued == (job_id,)
    claimed = await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id)
    assert claimed is not None and claimed.recoveries == 1
    await store.begin_step(job_id, owner="w", attempt=2, seq=0, name="a")
    for seq, reset, recoveries in ((1, False, 1), (2, True, 0)):
        ending = EndedStep(seq=seq - 1, name="a", output_json="1", reset_recoveries=reset)
        started = await store.begin_step(
            job_id, owner="w", attempt=2, seq=seq, name="a", ending=ending
        )
        assert isinstance(started, StepRecord) and started.seq == seq
        job = await store.get(job_id)
        assert job is not None and job.recoveries == recoveries, (seq, reset)
    steps = [(step.seq, step.status) for step in await store.steps(job_id)]
    assert steps == [(0, "succeeded"), (1, "succeeded"), (2, "running")]


async def test_a_dead_owners_job_out_of_recoveries_fails_naming_the_step_and_its_error(
    store: JobStore, clock: Clock
) -> None:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    assert await store.claim(owner="dead", lease_ms=LEASE_MS, job_id=job_id) is not None
    await store.begin_step(job_id, owner="dead", attempt=1, seq=0, name="fetch")
    # The run recorded the step's failure, then died before it recorded the job's outcome.
    error = ErrorInfo("http_error", "the mirror answered 503")
    assert await store.end_step(job_id, owner="dead", attempt=1, seq=0, name="fetch", error=error)

    assert await store.recover_from(
        job_id, owner="dead", reason="owner_gone", max_recoveries=0
    ) == (JobStatus.FAILED)
    job = await store.get(job_id)
    assert job is not None and job.status == JobStatus.FAILED
    assert job.error is not None and job.error.code == RECOVERY_EXHAUSTED
    assert "(its owner process is gone)" in job.error.message
    assert "last step 'fetch' (#0, failed, begun 1 times)" in job.error.message
    assert "its last error: http_error: the mirror answered 503" in job.error.message
    # Only the owner that held it: a second pass finds nothing to take.
    assert (
        await store.recover_from(job_id, owner="dead", reason="owner_gone", max_recoveries=0)
        is None
    )
    assert store.outcomes.counts() == {("demo", "failed"): 1}


async def test_without_a_bound_recovery_always_requeues(store: JobStore, clock: Clock) -> None:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    for attempt in range(1, 6):
        await claim_and_die_in(store, clock, job_id, attempt)
        assert await store.requeue_expired() == [job_id]
    job = await store.get(job_id)
    assert job is not None and (job.status, job.recoveries) == (JobStatus.QUEUED, 5)


async def test_a_step_end_rides_in_the_next_start_s_commit(store: JobStore) -> None:
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    assert await store.claim(owner="w", lease_ms=LEASE_MS, job_id=job_id) is not None
    assert isinstance(
        await store.begin_step(job_id, owner="w", attempt=1, seq=0, name="a"), StepRecord
    )
    commits = store.database.write_counts
    ending = EndedStep(seq=0, name="a", output_json='"A"')
    started = await store.begin_step(job_id, owner="w", attempt=1, seq=1, name="b", ending=ending)
    assert isinstance(started, StepRecord) and (started.seq, started.attempts) == (1, 1)
    assert store.database.write_counts == (commits[0] + 1, commits[1] + 1)  # one commit
    steps = [(s.seq, s.status, s.output_json) for s in await store.steps(job_id)]
    assert steps == [(0, "succeeded", '"A"'), (1, "running", None)]
    events = [
        (e.data["seq"], e.data["status"]) for e in await store.events(job_id) if e.type == "step"
    ]
    assert events == [(0, "running"), (0, "succeeded"), (1, "running")]  # the end first

    # Cancelled before the next start: the ending is still recorded, the start is not.
    await store.request_cancel(job_id)
    ending = EndedStep(seq=1, name="b", output_json='"B"')
    refused = await store.begin_step(job_id, owner="w", attempt=1, seq=2, name="c", ending=ending)
    assert refused == StepRefusal.CANCELLED
    steps = [(s.seq, s.status, s.output_json) for s in await store.steps(job_id)]
    assert steps == [(0, "succeeded", '"A"'), (1, "succeeded", '"B"')]
