"""Two runners on one job: the one that lost its lease changes nothing and stops.

Runner A claims the job and is held inside its first step; its lease lapses on an injected
lease clock (no sleeping: the clock moves when the test moves it, and A's heartbeat is too
slow to notice); recovery re-queues the job and runner B claims it (attempt 2). When A's
step then ends, or reports progress, every journal write it tries is fenced off: B's record
stands, A raises ``LeaseLost`` inside the engine, runs no further step and writes no event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from pydantic import BaseModel

from sbproxy.store import Database, JobRecord, JobStatus, JobStore, LeaseTime
from sbproxy.workflows import (
    LeaseLost,
    LeaseSettings,
    Registry,
    StepContext,
    WorkflowContext,
    WorkflowEngine,
    step,
)

pytestmark = pytest.mark.anyio

LEASE_S = 1.0
# Never within a test: the lease lapses only because the injected clock jumps.
SLOW_HEARTBEAT_S = 3600.0


class Clock:
    """The lease clock both runners read (one machine, one boot)."""

    def __init__(self) -> None:
        self.ms = 7_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="test-boot", ms=self.ms)

    def lapse(self) -> None:
        self.ms += int(LEASE_S * 1000) + 1


class Runner:
    """One runner's view of the world: gates per claim attempt, and what it did."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered: dict[int, anyio.Event] = {}
        self.released: dict[int, anyio.Event] = {}
        self.effects: list[str] = []
        self.lost: list[str] = []

    def gate(self, attempt: int) -> tuple[anyio.Event, anyio.Event]:
        return (
            self.entered.setdefault(attempt, anyio.Event()),
            self.released.setdefault(attempt, anyio.Event()),
        )


class Plan(BaseModel):
    progress: bool


@step("work")
async def work_step(ctx: StepContext, plan: Plan) -> str:
    """Idempotency: not idempotent on purpose; the runner counts its side effects."""
    runner = ctx.resource(Runner)
    entered, released = runner.gate(ctx.attempt)
    entered.set()
    await released.wait()
    runner.effects.append(f"work#{ctx.attempt}")
    if plan.progress:
        try:
            await ctx.report_progress(done=1, total=2, unit="items", force=True)
        except LeaseLost:
            runner.lost.append(f"progress#{ctx.attempt}")
            raise
    return f"{runner.name}#{ctx.attempt}"


@step("after")
async def after_step(ctx: StepContext, previous: str) -> str:
    """Idempotency: not idempotent on purpose; the runner counts its side effects."""
    ctx.resource(Runner).effects.append("after")
    return f"{previous}+after"


registry = Registry()


@registry.workflow("fenced", version=1)
async def fenced(ctx: WorkflowContext, plan: Plan) -> str:
    return await ctx.step(after_step, await ctx.step(work_step, plan))


async def open_runner(journal: Path | str, clock: Clock, runner: Runner) -> WorkflowEngine:
    """An engine over the journal as another process would open it (its own connection,
    its own owner id), reading the shared lease clock."""
    database = await Database.open(journal)
    return WorkflowEngine(
        JobStore(database, lease_clock=clock),
        registry,
        lease=LeaseSettings(lease_s=LEASE_S, heartbeat_s=SLOW_HEARTBEAT_S),
        resources=[runner],
    )


@pytest.fixture
async def engines(
    journal_location: Path | str,
) -> AsyncIterator[tuple[Clock, WorkflowEngine, WorkflowEngine]]:
    clock = Clock()
    journal = journal_location
    first = await open_runner(journal, clock, Runner("A"))
    second = await open_runner(journal, clock, Runner("B"))
    try:
        yield clock, first, second
    finally:
        await first.close()
        await second.close()


def runner_of(engine: WorkflowEngine) -> Runner:
    (runner,) = [r for r in engine.resources if isinstance(r, Runner)]
    return runner


async def journal_of(engine: WorkflowEngine, job_id: str) -> list[tuple[str, str, int, str | None]]:
    return [(s.name, s.status, s.attempts, s.output_json) for s in await engine.steps(job_id)]


@pytest.mark.parametrize("fenced_write", ["end of step", "progress"])
async def test_a_runner_that_lost_its_lease_cannot_overwrite_the_new_owners_result(
    engines: tuple[Clock, WorkflowEngine, WorkflowEngine], fenced_write: str
) -> None:
    clock, a_engine, b_engine = engines
    a, b = runner_of(a_engine), runner_of(b_engine)
    submitted = await a_engine.submit(fenced, Plan(progress=fenced_write == "progress"))
    job_id = submitted.job.id
    results: dict[str, JobRecord] = {}

    async def run(name: str, engine: WorkflowEngine) -> None:
        results[name] = await engine.join(job_id, poll_s=0.01)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(run, "A", a_engine)
            await a.gate(1)[0].wait()  # A is inside "work" under attempt 1
            clock.lapse()
            assert await b_engine.recover() == [job_id]
            group.start_soon(run, "B", b_engine)
            await b.gate(2)[0].wait()
            b.gate(2)[1].set()
            while "B" not in results:
                await anyio.sleep(0.01)
            done = results["B"]
            assert (done.status, done.attempt, done.output) == (
                JobStatus.SUCCEEDED,
                2,
                "B#2+after",
            )
            events_before = await b_engine.store.last_event_seq(job_id)
            a.gate(1)[1].set()  # A's step returns now, long after it lost the lease

    # A did its side effect, but the journal is B's: A wrote nothing and ran nothing more.
    assert a.effects == ["work#1"]
    assert b.effects == ["work#2", "after"]
    assert a.lost == (["progress#1"] if fenced_write == "progress" else [])
    assert await journal_of(a_engine, job_id) == [
        ("work", "succeeded", 2, '"B#2"'),
        ("after", "succeeded", 1, '"B#2+after"'),
    ]
    assert await a_engine.store.last_event_seq(job_id) == events_before
    final = results["A"]  # A's join ends with the job as B left it
    assert (final.status, final.attempt, final.output) == (JobStatus.SUCCEEDED, 2, "B#2+after")


async def test_the_same_owner_claiming_again_fences_off_its_own_older_claim(
    engines: tuple[Clock, WorkflowEngine, WorkflowEngine], caplog: pytest.LogCaptureFixture
) -> None:
    # One engine, one owner id, two claims: only the attempt tells them apart. The older
    # claim's step ends while the newer claim is still inside the same step.
    clock, engine, _ = engines
    runner = runner_of(engine)
    submitted = await engine.submit(fenced, Plan(progress=False))
    job_id = submitted.job.id
    results: list[JobRecord] = []

    async def run() -> None:
        results.append(await engine.join(job_id, poll_s=0.01))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await runner.gate(1)[0].wait()
            clock.lapse()
            assert await engine.recover() == [job_id]
            group.start_soon(run)
            await runner.gate(2)[0].wait()
            job = await engine.get(job_id)
            assert (job.lease_owner, job.attempt) == (engine.identity.owner, 2)
            events_before = await engine.store.last_event_seq(job_id)
            runner.gate(1)[1].set()  # the older claim's step ends first
            # Until it has tried to journal that end (with the next step's start, and was
            # fenced off, or -- the bug -- was not, and overwrote the step).
            while not any(
                "end of step work" in m and "changed nothing" in m for m in caplog.messages
            ):
                if await journal_of(engine, job_id) != [("work", "running", 2, None)]:
                    break
                await anyio.sleep(0.01)
            # It stopped at the fence: the step is still the newer claim's, running.
            assert await journal_of(engine, job_id) == [("work", "running", 2, None)]
            assert await engine.store.last_event_seq(job_id) == events_before
            runner.gate(2)[1].set()

    assert runner.effects == ["work#1", "work#2", "after"]
    assert await journal_of(engine, job_id) == [
        ("work", "succeeded", 2, '"A#2"'),
        ("after", "succeeded", 1, '"A#2+after"'),
    ]
    assert [(r.status, r.output) for r in results] == [
        (JobStatus.SUCCEEDED, "A#2+after"),
        (JobStatus.SUCCEEDED, "A#2+after"),
    ]
