"""Job outcome tallies: each terminal transition is counted once, by the store that made it,
with its run time; a job cancelled before it ran is counted but not timed."""

from __future__ import annotations

import pytest

from sbproxy.store import DURATION_BUCKETS_S, Database, ErrorInfo, JobStatus, JobStore

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


async def test_terminal_transitions_are_counted_once_with_durations(database: Database) -> None:
    clock = Clock()
    store = JobStore(database, clock=clock)
    ran = (await store.submit(kind="pull", workflow_version=1, input_json="{}")).job.id
    claimed = await store.claim(owner="w1", lease_ms=10_000, job_id=ran)
    assert claimed is not None
    clock.now_ms += 2_500
    assert await store.finish(
        ran, owner="w1", attempt=1, status=JobStatus.SUCCEEDED, output_json="{}"
    )
    # A second finish (a lost lease, a replayed call) writes nothing and counts nothing.
    assert not await store.finish(ran, owner="w1", attempt=1, status=JobStatus.FAILED)

    failed = (await store.submit(kind="pull", workflow_version=1, input_json="{}")).job.id
    await store.claim(owner="w1", lease_ms=10_000, job_id=failed)
    clock.now_ms += 400
    error = ErrorInfo("digest_mismatch", "bytes differ")
    assert await store.finish(failed, owner="w1", attempt=1, status=JobStatus.FAILED, error=error)

    queued = (await store.submit(kind="gc", workflow_version=1, input_json="{}")).job.id
    await store.request_cancel(queued)
    await store.request_cancel(queued)  # already cancelled: not counted again

    parked = (await store.submit(kind="gc", workflow_version=1, input_json="{}")).job.id
    await store.claim(owner="w1", lease_ms=10_000, job_id=parked)
    # Parked is not terminal: not counted.
    assert await store.finish(parked, owner="w1", attempt=1, status=JobStatus.PARKED)

    assert store.outcomes.counts() == {
        ("pull", "succeeded"): 1,
        ("pull", "failed"): 1,
        ("gc", "cancelled"): 1,
    }
    durations = store.outcomes.durations()
    assert set(durations) == {"pull"}  # the cancelled gc job never ran
    pull = durations["pull"]
    assert pull.count == 2
    assert pull.total_s == pytest.approx(2.9)
    cumulative = dict(pull.cumulative())
    assert cumulative["0.5"] == 1  # 0.4 s
    assert cumulative["1.0"] == 1
    assert cumulative["2.5"] == 2  # 2.5 s is inside its bucket (le)
    assert cumulative["+Inf"] == 2
    assert len(cumulative) == len(DURATION_BUCKETS_S) + 1
