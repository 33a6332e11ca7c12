"""The workflow engine in one process: replay, nondeterminism, retries, cancellation,
leases, the worker loop and progress events."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import psycopg
import pytest
from pydantic import BaseModel

from sbproxy.errors import SbproxyError
from sbproxy.store import JobStatus, JobStore
from sbproxy.workflows import (
    LeaseSettings,
    Registry,
    RetryPolicy,
    StepContext,
    WorkflowContext,
    WorkflowEngine,
    arm,
    disarm_all,
    step,
)

pytestmark = pytest.mark.anyio

FAST_RETRY = RetryPolicy(max_attempts=3, initial_delay_s=0.001, max_delay_s=0.01)


class Count(BaseModel):
    n: int


class Boom(BaseException):
    """Stands in for a process dying mid-run (not an Exception: nothing handles it)."""


calls: dict[str, int] = {}


def bump(name: str) -> int:
    calls[name] = calls.get(name, 0) + 1
    return calls[name]


@pytest.fixture(autouse=True)
def _reset() -> None:
    calls.clear()
    disarm_all()


@pytest.fixture
async def journal(journal_location: Path | str) -> Path | str:
    return journal_location


async def open_engine(
    journal: Path | str, registry: Registry, lease_s: float = 5.0
) -> WorkflowEngine:
    return await WorkflowEngine.open(
        journal, registry, lease=LeaseSettings(lease_s=lease_s, heartbeat_s=0.05)
    )


@step("one")
async def one(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure except for the test's call counter."""
    bump("one")
    return Count(n=arg.n + 1)


@step("two")
async def two(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure except for the test's call counter."""
    bump("two")
    return Count(n=arg.n * 10)


@step("other")
async def other(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure."""
    return arg


def two_step_registry() -> Registry:
    registry = Registry()

    @registry.workflow("pair", version=1)
    async def pair(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(two, await ctx.step(one, arg))

    return registry


@pytest.fixture
async def engine(journal: Path | str) -> AsyncIterator[WorkflowEngine]:
    engine = await open_engine(journal, two_step_registry())
    try:
        yield engine
    finally:
        await engine.close()


async def test_completed_steps_are_replayed_not_rerun(journal: Path | str) -> None:
    registry = two_step_registry()
    pair = registry.get("pair")
    assert pair is not None

    def die() -> None:
        raise Boom

    arm("step:two:before", action=die)
    first = await open_engine(journal, registry, lease_s=0.3)
    submitted = await first.submit(pair, Count(n=4))
    with pytest.raises(BaseExceptionGroup) as died:
        await first.join(submitted.job.id)
    assert died.group_contains(Boom)
    await first.close()
    assert calls == {"one": 1}

    disarm_all()
    second = await open_engine(journal, registry, lease_s=0.3)
    job = await second.join(submitted.job.id)  # waits for the dead lease to lapse
    steps = await second.steps(job.id)
    await second.close()
    assert job.status == JobStatus.SUCCEEDED
    assert job.output == {"n": 50}
    assert job.attempt == 2
    assert calls == {"one": 1, "two": 1}
    assert [(s.name, s.status, s.attempts) for s in steps] == [
        ("one", "succeeded", 1),
        ("two", "succeeded", 2),
    ]


def journal_rows(journal: Path | str) -> list[tuple[int, str, str]]:
    """The steps table as another process reads it now (its own connection)."""
    query = "SELECT seq, name, status FROM steps ORDER BY seq"
    if isinstance(journal, str):
        with psycopg.connect(journal) as pg:
            return [(int(r[0]), str(r[1]), str(r[2])) for r in pg.execute(query)]
    with sqlite3.connect(journal) as raw:
        return list(raw.execute(query))


async def test_the_committed_point_passes_once_the_output_is_journaled(journal: Path | str) -> None:
    registry = two_step_registry()
    pair = registry.get("pair")
    assert pair is not None
    seen: list[list[tuple[int, str, str]]] = []

    def die_after_commit() -> None:
        seen.append(journal_rows(journal))  # what another process would read at this moment
        raise Boom

    arm("step:one:committed", action=die_after_commit)
    first = await open_engine(journal, registry, lease_s=0.3)
    submitted = await first.submit(pair, Count(n=4))
    with pytest.raises(BaseExceptionGroup) as died:
        await first.join(submitted.job.id)
    assert died.group_contains(Boom)
    await first.close()
    # Step one's output had committed, in one commit with step two's start; step two's
    # body had not run.
    assert seen == [[(0, "one", "succeeded"), (1, "two", "running")]]
    assert calls == {"one": 1}

    disarm_all()
    passed: list[str] = []

    def record(name: str) -> Callable[[], None]:
        return lambda: passed.append(name)

    for name in ("one", "two"):
        arm(f"step:{name}:committed", action=record(name))
    second = await open_engine(journal, registry, lease_s=0.3)
    job = await second.join(submitted.job.id)
    await second.close()
    assert (job.status, job.output, job.attempt) == (JobStatus.SUCCEEDED, {"n": 50}, 2)
    assert calls == {"one": 1, "two": 1}  # the committed step was replayed, not rerun
    assert passed == ["two"]  # a replayed step commits nothing, so passes no point


async def test_a_step_costs_one_commit(journal: Path | str) -> None:
    registry = Registry()

    @registry.workflow("chain", version=1)
    async def chain(ctx: WorkflowContext, arg: Count) -> Count:
        for index in range(4):
            arg = await ctx.step(one, arg, name=f"one:{index}")
        return arg

    engine = await WorkflowEngine.open(journal, registry, lease=LeaseSettings(lease_s=60))
    try:
        store = engine.store
        assert isinstance(store, JobStore)
        submitted = await engine.submit(chain, Count(n=0))
        before = store.database.write_counts
        job = await engine.join(submitted.job.id)
        writes, commits = store.database.write_counts
    finally:
        await engine.close()
    assert (job.status, job.output) == (JobStatus.SUCCEEDED, {"n": 4})
    # The claim, the first start, three ends each with the next start, the last end and
    # the outcome: four steps, four commits of their own (eight before the ends rode).
    assert (writes - before[0], commits - before[1]) == (7, 7)


async def test_changed_step_sequence_parks_the_job(journal: Path | str) -> None:
    original = two_step_registry()
    pair = original.get("pair")
    assert pair is not None

    def die() -> None:
        raise Boom

    arm("step:two:before", action=die)
    engine = await open_engine(journal, original, lease_s=0.3)
    submitted = await engine.submit(pair, Count(n=1))
    with pytest.raises(BaseExceptionGroup) as died:
        await engine.join(submitted.job.id)
    assert died.group_contains(Boom)
    await engine.close()
    disarm_all()

    changed = Registry()

    @changed.workflow("pair", version=1)
    async def pair_changed(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(other, arg)  # step 0 used to be "one"

    engine = await open_engine(journal, changed, lease_s=0.3)
    parked = await engine.join(submitted.job.id)
    await engine.close()
    assert parked.status == JobStatus.PARKED
    assert parked.error is not None
    assert parked.error.code == "nondeterminism"
    assert "'one'" in parked.error.message
    assert calls == {"one": 1}

    # The original code can take it back: retry resumes after the completed step.
    engine = await open_engine(journal, original)
    await engine.retry(parked.id)
    done = await engine.join(parked.id)
    await engine.close()
    assert done.status == JobStatus.SUCCEEDED
    assert done.output == {"n": 20}
    assert calls == {"one": 1, "two": 1}


async def test_a_job_of_another_workflow_version_is_parked(journal: Path | str) -> None:
    engine = await open_engine(journal, two_step_registry())
    pair = engine.registry.get("pair")
    assert pair is not None
    submitted = await engine.submit(pair, Count(n=1))
    await engine.close()
    newer = Registry()

    @newer.workflow("pair", version=2)
    async def pair_v2(ctx: WorkflowContext, arg: Count) -> Count:
        return arg

    engine = await open_engine(journal, newer)
    job = await engine.join(submitted.job.id)
    await engine.close()
    assert job.status == JobStatus.PARKED
    assert job.error is not None
    assert "v1" in job.error.message


class Flaky(SbproxyError):
    default_code = "upstream_unavailable"
    default_retryable = True


@step("flaky", retry=FAST_RETRY)
async def flaky(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure except for the counter."""
    if bump("flaky") <= arg.n:
        raise Flaky("503 from the mirror")
    return arg


@step("permanent", retry=FAST_RETRY)
async def permanent(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: raises before any effect."""
    bump("permanent")
    raise SbproxyError("sha256 of model.gguf is wrong", code="digest_mismatch")


@step("buggy", retry=FAST_RETRY)
async def buggy(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: raises before any effect."""
    bump("buggy")
    raise KeyError("oops")


def single(definition: object) -> Registry:
    registry = Registry()

    @registry.workflow("single")
    async def run(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(definition, arg)  # type: ignore[arg-type]

    return registry


@pytest.mark.parametrize(
    ("definition", "failures", "status", "code", "expected_calls"),
    [
        (flaky, 2, JobStatus.SUCCEEDED, None, 3),
        (flaky, 5, JobStatus.FAILED, "upstream_unavailable", 3),
        (permanent, 0, JobStatus.FAILED, "digest_mismatch", 1),
        (buggy, 0, JobStatus.FAILED, "internal", 1),
    ],
)
async def test_retry_policy_and_reason_codes(
    journal: Path | str,
    definition: object,
    failures: int,
    status: JobStatus,
    code: str | None,
    expected_calls: int,
) -> None:
    registry = single(definition)
    engine = await open_engine(journal, registry)
    workflow = registry.get("single")
    assert workflow is not None
    submitted = await engine.submit(workflow, Count(n=failures))
    job = await engine.join(submitted.job.id)
    steps = await engine.steps(job.id)
    await engine.close()
    assert job.status == status
    assert (job.error.code if job.error else None) == code
    assert sum(calls.values()) == expected_calls
    assert steps[0].status == ("succeeded" if status == JobStatus.SUCCEEDED else "failed")


@step("long")
async def long_step(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: only counts loop turns."""
    for turn in range(2000):
        bump("turns")
        ctx.check_cancelled()
        await ctx.report_progress(done=turn, total=2000, unit="items")
        await anyio.sleep(0.005)
    return arg


async def test_cooperative_cancellation_of_a_running_job(journal: Path | str) -> None:
    registry = single(long_step)
    engine = await open_engine(journal, registry)
    workflow = registry.get("single")
    assert workflow is not None
    submitted = await engine.submit(workflow, Count(n=0))
    result = {}

    async def run() -> None:
        result["job"] = await engine.join(submitted.job.id)

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        while calls.get("turns", 0) < 5:
            await anyio.sleep(0.01)
        await engine.cancel(submitted.job.id)
    await engine.close()
    job = result["job"]
    assert job.status == JobStatus.CANCELLED
    assert calls["turns"] < 2000


async def test_progress_events_are_throttled_and_the_last_one_kept(journal: Path | str) -> None:
    registry = Registry()

    @step("count")
    async def count(ctx: StepContext, arg: Count) -> Count:
        """Idempotency: pure."""
        for done in range(1, arg.n + 1):
            await ctx.report_progress(done=done, total=arg.n, current="file.bin")
        return arg

    @registry.workflow("progress")
    async def run(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(count, arg)

    engine = await open_engine(journal, registry)
    submitted = await engine.submit(run, Count(n=5000))
    job = await engine.join(submitted.job.id)
    events = [e async for e in engine.follow(job.id)]
    await engine.close()
    progress = [e for e in events if e.type == "progress"]
    assert 1 <= len(progress) < 50
    assert progress[-1].data["done"] == 5000
    assert job.progress is not None
    assert job.progress["done"] == 5000
    assert job.progress["current"] == "file.bin"
    assert [e.data["status"] for e in events if e.type == "status"] == [
        "queued",
        "running",
        "succeeded",
    ]


async def test_worker_loop_respects_its_concurrency_limit(journal: Path | str) -> None:
    registry = Registry()
    active = {"now": 0, "max": 0}

    @step("busy")
    async def busy(ctx: StepContext, arg: Count) -> Count:
        """Idempotency: only tracks concurrency."""
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        await anyio.sleep(0.05)
        active["now"] -= 1
        return arg

    @registry.workflow("busy")
    async def run(ctx: WorkflowContext, arg: Count) -> Count:
        return await ctx.step(busy, arg)

    engine = await open_engine(journal, registry)
    ids = [(await engine.submit(run, Count(n=i))).job.id for i in range(7)]
    with anyio.fail_after(30):
        await engine.run_worker(concurrency=2, poll_s=0.01, until_idle=True)
    jobs = [await engine.get(job_id) for job_id in ids]
    await engine.close()
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs)
    assert active["max"] == 2


async def test_join_of_an_unknown_id(engine: WorkflowEngine) -> None:
    with pytest.raises(SbproxyError) as info:
        await engine.join("01ARZ3NDEKTSV4RRFFQ69G5FAV")
    assert info.value.code == "job_not_found"
