"""A journal that cannot record mid-step is never a job's outcome, and nothing acknowledged
is lost: the run stops, the job keeps its claim, and an engine that waits such faults out (a
serving host's) resumes it under the same id and claim once the journal answers.

Two real faults: SQLite's "database or disk is full" raised under the driver while a step
writes its progress, and the real PostgreSQL server stopped (``pg_ctl stop -m fast``) while a
step runs. A CLI engine (no waiting) keeps raising the fault at once, the job left running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from pydantic import BaseModel

from sbproxy.store import JobStatus, StepStatus
from sbproxy.workflows import LeaseSettings, Registry, StepContext, WorkflowContext, WorkflowEngine
from sbproxy.workflows import step as declare_step
from tests.support.journal_faults import JournalFull
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio

LEASE = LeaseSettings(lease_s=60, heartbeat_s=0.2)  # never lapses here: the claim is taken up


class Count(BaseModel):
    n: int


# What the step does on its first run, before reporting progress (the fault to meet).
before_progress: list[Callable[[], None]] = []
runs: list[int] = []


@declare_step("first")
async def first(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure."""
    return Count(n=arg.n + 1)


@declare_step("second")
async def second(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure; its first run meets the fault at its progress write."""
    runs.append(ctx.attempt)
    if ctx.attempt == 1:
        for action in before_progress:
            await anyio.to_thread.run_sync(action)
    await ctx.report_progress(done=1, total=2, unit="items", force=True)
    return Count(n=arg.n * 10)


def registry() -> Registry:
    chosen = Registry()

    @chosen.workflow("count", version=1)
    async def run(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(second, await ctx.step(first, arg))

    return chosen


@pytest.fixture(autouse=True)
def _reset() -> None:
    before_progress.clear()
    runs.clear()


def said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in record.getMessage() for record in caplog.records)


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    with anyio.move_on_after(30):
        while not predicate():
            await anyio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not within 30 s")


async def resumed_through(
    engine: WorkflowEngine, caplog: pytest.LogCaptureFixture, heal: Callable[[], None]
) -> None:
    """Run a job whose second step meets the armed fault; heal the journal once the run
    has stopped on it; the job must finish under its id and first claim, the step's fault
    never recorded as its outcome."""
    caplog.set_level(logging.INFO, logger="sbproxy.workflows")
    chosen = engine.registry.get("count")
    assert chosen is not None
    job = (await engine.submit(chosen, Count(n=1))).job
    async with anyio.create_task_group() as group:
        finished: list[object] = []

        async def join() -> None:
            finished.append(await engine.join(job.id))

        group.start_soon(join)
        stopped = "the journal cannot record this run"
        await wait_for(lambda: said(caplog, stopped), "the run stopped on the fault")
        assert not finished  # waiting, not failed
        await anyio.to_thread.run_sync(heal)
    (done,) = finished
    assert done == await engine.get(job.id)
    record = await engine.get(job.id)
    assert record.status == JobStatus.SUCCEEDED, record.error
    assert record.output == {"n": 20}
    assert record.attempt == 1  # the same claim, taken up again
    assert said(caplog, f"job {job.id} (count): the journal answers again; resuming it")
    assert runs == [1, 2]
    steps = await engine.steps(job.id)
    assert [(s.name, s.status, s.attempts) for s in steps] == [
        ("first", StepStatus.SUCCEEDED, 1),
        ("second", StepStatus.SUCCEEDED, 2),
    ]
    failed = [
        event
        for event in await engine.store.events(job.id)
        if event.type == "step" and event.data.get("status") == "failed"
    ]
    assert failed == []  # the fault was never written as the step's (or the job's) outcome


async def test_a_full_sqlite_journal_mid_step_is_waited_out_and_the_job_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await WorkflowEngine.open(
        tmp_path / "journal.db", registry(), lease=LEASE, wait_out_journal_faults=True
    )
    try:
        full = JournalFull(engine.store)
        before_progress.append(lambda: setattr(full, "on", True))

        def heal() -> None:
            assert full.failures > 0
            full.on = False

        await resumed_through(engine, caplog, heal)
    finally:
        await engine.close()


async def test_a_postgres_outage_mid_step_is_waited_out_and_the_job_resumes(
    own_postgres_server: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await WorkflowEngine.open(
        own_postgres_server.create_database(),
        registry(),
        lease=LEASE,
        wait_out_journal_faults=True,
    )
    try:
        before_progress.append(lambda: own_postgres_server.stop_server("fast"))
        await resumed_through(engine, caplog, own_postgres_server.start_server)
    finally:
        await engine.close()


async def test_an_engine_that_does_not_wait_raises_the_fault_and_leaves_the_job_running(
    tmp_path: Path,
) -> None:
    engine = await WorkflowEngine.open(tmp_path / "journal.db", registry(), lease=LEASE)
    try:
        full = JournalFull(engine.store)
        before_progress.append(lambda: setattr(full, "on", True))
        chosen = engine.registry.get("count")
        assert chosen is not None
        job = (await engine.submit(chosen, Count(n=1))).job
        with pytest.raises(Exception) as raised:
            await engine.join(job.id)
        assert getattr(raised.value, "code", None) == "disk_full", raised.value
        full.on = False
        record = await engine.get(job.id)
        assert record.status == JobStatus.RUNNING  # nothing recorded: resumable
        steps = await engine.steps(job.id)
        assert [(s.name, s.status) for s in steps] == [
            ("first", StepStatus.SUCCEEDED),
            ("second", StepStatus.RUNNING),
        ]
    finally:
        await engine.close()
