"""``JOB_TRANSITIONS`` against the store's SQL fences, on real SQLite.

Every operation of :class:`JobStore` that can change a job's status is applied to a job in
every status (a fresh journal per case, an injected lease clock for lapses). What each case
did is read back from the database itself -- the row's status, and the ``status`` events the
store wrote -- so the table is checked against what the fences let through, not against
what the Python says:

* every status change the store makes is an edge of ``JOB_TRANSITIONS``;
* every edge of ``JOB_TRANSITIONS`` is made by some operation;
* everything else is refused: the row, its status events and its lease stay as they were.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
FAILURE = ErrorInfo(code="step_failed", message="it broke")


class Clock:
    """An injected lease clock: moves only when a case says so."""

    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="test-boot", ms=self.ms)

    def lapse(self) -> None:
        self.ms += LEASE_MS + 1


@dataclass
class Case:
    """One job in a known status, and what an operation needs to address it."""

    store: JobStore
    clock: Clock
    job_id: str
    attempt: int  # the live claim's attempt (0 when never claimed)


async def claimed(store: JobStore, job_id: str) -> int:
    job = await store.claim(owner=OWNER, lease_ms=LEASE_MS, job_id=job_id)
    assert job is not None and job.status == JobStatus.RUNNING
    return job.attempt


async def put_in(store: JobStore, status: JobStatus) -> tuple[str, int]:
    """A new job brought to ``status`` by the store's own API; its id and claim attempt."""
    job_id = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job.id
    if status == JobStatus.QUEUED:
        return job_id, 0
    if status == JobStatus.CANCELLED:
        cancelled = await store.request_cancel(job_id)
        assert cancelled is not None and cancelled.status == JobStatus.CANCELLED
        return job_id, 0
    attempt = await claimed(store, job_id)
    if status != JobStatus.RUNNING:
        error = None if status == JobStatus.SUCCEEDED else FAILURE
        done = await store.finish(
            job_id, owner=OWNER, attempt=attempt, status=status, output_json="{}", error=error
        )
        assert done is not None and done.status == status
    return job_id, attempt


async def lapse_then(case: Case, recover: Callable[[], Awaitable[Any]]) -> None:
    case.clock.lapse()
    await recover()


def _finish(status: JobStatus) -> Callable[[Case], Awaitable[Any]]:
    async def run(case: Case) -> None:
        error = None if status == JobStatus.SUCCEEDED else FAILURE
        await case.store.finish(
            case.job_id,
            owner=OWNER,
            attempt=case.attempt,
            status=status,
            output_json="{}",
            error=error,
        )

    return run


# Every operation of the store that writes a job row, by name. ``finish`` is tried with every
# status, the ones a runner may not record included.
OPERATIONS: dict[str, Callable[[Case], Awaitable[Any]]] = {
    "claim(job_id)": lambda c: c.store.claim(owner=OWNER, lease_ms=LEASE_MS, job_id=c.job_id),
    "claim(oldest)": lambda c: c.store.claim(owner=OWNER, lease_ms=LEASE_MS),
    "heartbeat": lambda c: c.store.heartbeat(
        c.job_id, owner=OWNER, attempt=c.attempt, lease_ms=LEASE_MS
    ),
    "report_progress": lambda c: c.store.report_progress(
        c.job_id, owner=OWNER, attempt=c.attempt, progress={"done": 1}, event=True
    ),
    "begin_step": lambda c: c.store.begin_step(
        c.job_id, owner=OWNER, attempt=c.attempt, seq=0, name="fetch"
    ),
    **{f"finish({s.value})": _finish(s) for s in JobStatus},
    "request_cancel": lambda c: c.store.request_cancel(c.job_id),
    "retry": lambda c: c.store.retry(c.job_id),
    "requeue_from": lambda c: c.store.requeue_from(c.job_id, owner=OWNER, reason="owner_gone"),
    "recover_from(bound 0)": lambda c: c.store.recover_from(
        c.job_id, owner=OWNER, reason="owner_gone", max_recoveries=0
    ),
    "lapse, requeue_expired": lambda c: lapse_then(c, c.store.requeue_expired),
    "lapse, recover_lapsed(bound 0)": lambda c: lapse_then(
        c, lambda: c.store.recover_lapsed(max_recoveries=0)
    ),
}


def row_of(store: JobStore, job_id: str) -> dict[str, Any]:
    """The job's row, read with a plain sqlite3 connection (not through the store)."""
    with sqlite3.connect(store.database.path) as raw:
        raw.row_factory = sqlite3.Row
        row = raw.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    assert row is not None
    return dict(row)


def status_events(store: JobStore, job_id: str) -> list[str]:
    """The statuses the store recorded for the job, oldest first (its ``status`` events)."""
    with sqlite3.connect(store.database.path) as raw:
        rows = raw.execute(
            "SELECT json_extract(data_json, '$.status') FROM job_events"
            " WHERE job_id = ? AND type = 'status' ORDER BY seq",
            (job_id,),
        ).fetchall()
    return [str(status) for (status,) in rows]


@dataclass(frozen=True)
class Outcome:
    source: JobStatus
    operation: str
    before: dict[str, Any]
    after: dict[str, Any]
    recorded: list[str]  # status events the operation added
    raised: str | None  # the error the operation raised, by type name

    @property
    def target(self) -> JobStatus:
        return JobStatus(self.after["status"])

    @property
    def label(self) -> str:
        return f"{self.operation} on a {self.source.value} job -> {self.target.value}"


async def explore(root: Path) -> list[Outcome]:
    """Every operation applied to a job in every status, each case in its own journal."""
    outcomes = []
    for index, (source, (name, operation)) in enumerate(
        (s, op) for s in JobStatus for op in OPERATIONS.items()
    ):
        clock = Clock()
        database = await Database.open(root / f"case-{index}" / "journal.db")
        try:
            store = JobStore(database, lease_clock=clock)
            job_id, attempt = await put_in(store, source)
            before, seen = row_of(store, job_id), status_events(store, job_id)
            assert before["status"] == source.value and seen[-1] == source.value
            raised = None
            try:
                await operation(Case(store=store, clock=clock, job_id=job_id, attempt=attempt))
            except ValueError as error:  # a call the store refuses outright
                raised = type(error).__name__
            after = row_of(store, job_id)
            recorded = status_events(store, job_id)[len(seen) :]
        finally:
            await database.close()
        outcomes.append(Outcome(source, name, before, after, recorded, raised))
    return outcomes


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    """The exploration, run once for the module's tests (about a hundred journals)."""
    return await explore(tmp_path_factory.mktemp("transitions"))


def moved(outcome: Outcome) -> bool:
    return outcome.target != outcome.source or bool(outcome.recorded)


async def test_every_status_change_the_store_makes_is_in_the_table(outcomes: list[Outcome]) -> None:
    illegal = [o.label for o in outcomes if moved(o) and o.target not in JOB_TRANSITIONS[o.source]]
    assert not illegal, "status changes the table does not allow:\n" + "\n".join(illegal)
    # The journal says the same as the row: one status event per change, naming the new status.
    for outcome in outcomes:
        expected = [outcome.target.value] if moved(outcome) else []
        assert outcome.recorded == expected, outcome.label


async def test_every_edge_of_the_table_is_made_through_the_stores_api(
    outcomes: list[Outcome],
) -> None:
    made = {(o.source, o.target) for o in outcomes if moved(o)}
    edges = {(source, target) for source, targets in JOB_TRANSITIONS.items() for target in targets}
    assert edges - made == set(), f"edges no operation makes: {sorted(edges - made)}"
    # The table names every status, so a status it forgot would not pass silently.
    assert set(JOB_TRANSITIONS) == set(JobStatus)


async def test_an_operation_the_table_does_not_allow_is_refused_and_changes_nothing(
    outcomes: list[Outcome],
) -> None:
    for outcome in outcomes:
        if moved(outcome):
            continue
        # Refused: the row as it was but for what a live claim renews (its lease, progress).
        renewed = {"lease_deadline_ms", "lease_ms", "lease_clock", "updated_at_ms"}
        renewed |= {"progress_json"} if outcome.operation == "report_progress" else set()
        changed = {k for k in outcome.before if outcome.before[k] != outcome.after[k]} - renewed
        if outcome.source == JobStatus.RUNNING and outcome.operation == "request_cancel":
            changed -= {"cancel_requested"}  # cooperative: the runner ends it
        assert not changed, f"{outcome.operation} on a {outcome.source.value} job: {changed}"
    # The ones that must be refused, named: a finished job never moves again, a queued job
    # is never finished without a claim, a runner records no status it may not.
    refused = {(o.source, o.operation) for o in outcomes if not moved(o)}
    for source in (JobStatus.SUCCEEDED, JobStatus.CANCELLED):
        assert {name for s, name in refused if s == source} == set(OPERATIONS)
    for status in JobStatus:
        assert (JobStatus.QUEUED, f"finish({status.value})") in refused
    # finish records an outcome: a re-queue is recovery's (it counts the recovery).
    for status in (JobStatus.RUNNING, JobStatus.QUEUED):
        (outcome,) = [
            o
            for o in outcomes
            if (o.source, o.operation) == (JobStatus.RUNNING, f"finish({status.value})")
        ]
        assert not moved(outcome) and outcome.raised == "ValueError", outcome
    assert (JobStatus.RUNNING, "retry") in refused
