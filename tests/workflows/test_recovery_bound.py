"""Bounded recovery in one process: a run that dies (an exception nothing handles stands in
for the process dying) leaves its job ``running``; once its lease lapses on the injected
lease clock the next ``join`` recovers it -- at most ``max_recoveries`` times in a row
without a step completing. The real-process version is in ``test_crash_recovery.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from sbproxy.store import RECOVERY_EXHAUSTED, Database, JobStatus, JobStore, LeaseTime
from sbproxy.workflows import (
    DEFAULT_MAX_RECOVERIES,
    LeaseSettings,
    Registry,
    StepContext,
    WorkflowContext,
    WorkflowEngine,
    arm,
    disarm_all,
    step,
)

pytestmark = pytest.mark.anyio

LEASE_S = 1.0


class Boom(BaseException):
    """Stands in for the process dying mid-run (not an Exception: nothing handles it)."""


class Clock:
    def __init__(self) -> None:
        self.ms = 9_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="test-boot", ms=self.ms)

    def lapse(self) -> None:
        self.ms += int(LEASE_S * 1000) + 1


class Empty(BaseModel):
    pass


ran: list[str] = []


def _make(name: str):  # type: ignore[no-untyped-def]
    @step(name)
    async def body(ctx: StepContext, arg: Empty) -> str:
        """Idempotency: records its run for the test."""
        ran.append(name)
        return name

    return body


STEPS = [_make(name) for name in ("a", "b", "c")]
registry = Registry()


@registry.workflow("abc", version=1)
async def abc(ctx: WorkflowContext, arg: Empty) -> list[str]:
    return [await ctx.step(definition, arg) for definition in STEPS]


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()
    disarm_all()


@pytest.fixture
async def opened(journal_location: Path | str) -> AsyncIterator[tuple[Clock, Database]]:
    database = await Database.open(journal_location)
    try:
        yield Clock(), database
    finally:
        await database.close()


def engine_on(clock: Clock, database: Database, **options: int | None) -> WorkflowEngine:
    return WorkflowEngine(
        JobStore(database, lease_clock=clock),
        registry,
        lease=LeaseSettings(lease_s=LEASE_S, heartbeat_s=3600),
        **options,  # type: ignore[arg-type]
    )


def die() -> None:
    raise Boom


async def run_and_die_at(engine: WorkflowEngine, clock: Clock, job_id: str, point: str) -> None:
    """One run that dies at ``point``; afterwards its lease has lapsed."""
    disarm_all()
    arm(point, action=die)
    with pytest.raises(BaseExceptionGroup) as died:
        await engine.join(job_id, poll_s=0.01)
    assert died.group_contains(Boom)
    job = await engine.get(job_id)
    assert job.status == JobStatus.RUNNING  # nobody recorded the death
    clock.lapse()


async def test_the_limit_is_the_engines_and_a_completed_step_starts_the_count_again(
    opened: tuple[Clock, Database],
) -> None:
    clock, database = opened
    engine = engine_on(clock, database, max_recoveries=1)
    job_id = (await engine.submit(abc, Empty())).job.id

    await run_and_die_at(engine, clock, job_id, "step:a:before")  # attempt 1
    await run_and_die_at(engine, clock, job_id, "step:b:before")  # 2: recovery 1, a completes
    assert (await engine.get(job_id)).recoveries == 0
    await run_and_die_at(engine, clock, job_id, "step:b:before")  # 3: recovery 1, nothing new
    assert (await engine.get(job_id)).recoveries == 1

    disarm_all()
    job = await engine.join(job_id, poll_s=0.01)  # a second recovery in a row: refused
    assert (job.status, job.attempt, job.recoveries) == (JobStatus.FAILED, 3, 1)
    assert job.error is not None and job.error.code == RECOVERY_EXHAUSTED
    assert "recovered once without completing a step" in job.error.message
    assert "last step 'b' (#1, running, begun 2 times)" in job.error.message
    assert ran == ["a"]

    retried = await engine.retry(job_id)
    assert (retried.status, retried.recoveries) == (JobStatus.QUEUED, 0)
    job = await engine.join(job_id, poll_s=0.01)
    assert (job.status, job.attempt, job.output) == (JobStatus.SUCCEEDED, 4, ["a", "b", "c"])
    assert ran == ["a", "b", "c"]


async def test_the_default_allows_three_recoveries_and_none_lifts_the_bound(
    opened: tuple[Clock, Database],
) -> None:
    clock, database = opened
    assert DEFAULT_MAX_RECOVERIES == 3
    bounded = engine_on(clock, database)
    job_id = (await bounded.submit(abc, Empty())).job.id
    for _ in range(1 + DEFAULT_MAX_RECOVERIES):
        await run_and_die_at(bounded, clock, job_id, "step:a:before")
    disarm_all()
    failed = await bounded.join(job_id, poll_s=0.01)
    assert (failed.status, failed.attempt) == (JobStatus.FAILED, 4)
    assert failed.error is not None and failed.error.code == RECOVERY_EXHAUSTED

    unbounded = engine_on(clock, database, max_recoveries=None)
    other = (await unbounded.submit(abc, Empty())).job.id
    for _ in range(6):
        await run_and_die_at(unbounded, clock, other, "step:a:before")
    disarm_all()
    done = await unbounded.join(other, poll_s=0.01)
    assert (done.status, done.attempt) == (JobStatus.SUCCEEDED, 7)


async def test_a_negative_limit_is_refused(opened: tuple[Clock, Database]) -> None:
    clock, database = opened
    with pytest.raises(ValueError, match="max_recoveries"):
        engine_on(clock, database, max_recoveries=-1)
