"""The job repository: jobs, their step journal and their events.

Every method is one short transaction. State changes are compare-and-set updates checked by
row count (``lifecycle.py``); callers learn whether they won, they never read-then-write.
Error messages and event payloads are redacted (``sbproxy.redact``) before they are written.

Two clocks, never mixed. Timestamps people read (created, updated, started, ended, event
times) are integer milliseconds since the Unix epoch from the repository's ``clock``; nothing
decides liveness from them. Leases are stamped on the ``lease_clock`` (``leaseclock.py``:
the boot's ``CLOCK_MONOTONIC`` plus the boot id), which a wall-clock step cannot move, so an
NTP step neither expires a live lease nor keeps a dead owner's lease alive.

Fencing. Every write a runner makes about the job it runs (begin and end of a step, progress,
heartbeat, finish) is conditioned, in the statement that writes, on the job still running
under that runner's lease owner *and* claim attempt. A runner that lost its lease to recovery
(which re-queues the job, and the next claim bumps ``attempt``) therefore changes nothing,
even when the new claim went to the same owner id; the method tells it so and the engine stops
that run. Recovery itself is bounded: a job recovered ``max_recoveries`` times without
completing a step ends ``failed`` with ``recovery_exhausted`` instead of being re-queued again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import RowMapping
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection
from ulid import ULID

from sbproxy.redact import redact
from sbproxy.store.database import Database
from sbproxy.store.leaseclock import LeaseClock, system_lease_time
from sbproxy.store.lifecycle import (
    ACTIVE_JOB_STATUSES,
    TERMINAL_JOB_STATUSES,
    JobStatus,
    StepStatus,
)
from sbproxy.store.outcomes import JobOutcomes
from sbproxy.store.records import ErrorInfo, EventRecord, JobRecord, StepRecord, wall_clock_ms
from sbproxy.store.records import job_from_row as _job
from sbproxy.store.records import step_from_row as _step

__all__ = [
    "RECOVERY_EXHAUSTED",
    "ErrorInfo",
    "EventRecord",
    "JobRecord",
    "JobStore",
    "Recovered",
    "StepRecord",
    "StepRefusal",
    "SubmitOutcome",
]

# Bounds on what one job may store: messages are for people, not for dumps.
MAX_ERROR_CHARS = 2048
MAX_EVENT_BYTES = 16 * 1024

# Reason code of a job that recovery failed instead of re-queueing it once more.
RECOVERY_EXHAUSTED = "recovery_exhausted"


# Clears a lease. ``lease_expires_at_ms`` held the wall-clock leases of schemas 1-3; it stays
# only so that an older sbproxy still attached to the journal can run its SQL. This code keeps
# it NULL, so such a process never expires a new lease by its wall clock.
_NO_LEASE = (
    "lease_owner = NULL, lease_clock = NULL, lease_deadline_ms = NULL, lease_ms = NULL,"
    " lease_expires_at_ms = NULL"
)
_SET_LEASE = (
    "lease_clock = :clock, lease_deadline_ms = :deadline, lease_ms = :lease_ms,"
    " lease_expires_at_ms = NULL"
)
# Whether a running job's lease has lapsed at lease time (:clock, :lease_now): the SQL twin of
# LeaseStamp.lapsed, which a test holds equal to it. No lease on this clock (another boot, or
# a lease from before schema 4), past its deadline, or renewed after now (not this clock).
_LAPSED = (
    "(lease_clock IS NULL OR lease_deadline_ms IS NULL OR lease_ms IS NULL"
    " OR lease_clock != :clock OR lease_deadline_ms < :lease_now"
    " OR lease_deadline_ms - lease_ms > :lease_now)"
)
# The fence of every runner write: the job still runs under this runner's claim (its lease
# owner and the attempt that claim made). A claim bumps ``attempt``, so a runner whose job was
# recovered and claimed again -- even by a worker with the same owner id -- matches nothing.
_FENCE = "status = 'running' AND lease_owner = :owner AND attempt = :attempt"
_STEP_FENCE = f"EXISTS (SELECT 1 FROM jobs WHERE id = :id AND {_FENCE})"  # noqa: S608 - fixed text
# Recovery may re-queue the job once more (``:max`` NULL: no bound).
_MAY_RECOVER = "(:max IS NULL OR recoveries < :max)"
_OUT_OF_RECOVERIES = "(:max IS NOT NULL AND recoveries >= :max)"
_RECOVERY_CAUSES = {
    "lease_expired": "its lease lapsed",
    "owner_gone": "its owner process is gone",
}


def _bounded(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    cleaned = redact(message)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"


def _in(statuses: Iterable[JobStatus]) -> str:
    # Status values are enum constants, never user input: inlining them is safe.
    return "(" + ", ".join(f"'{s.value}'" for s in statuses) + ")"


@dataclass(frozen=True)
class SubmitOutcome:
    """Result of :meth:`JobStore.submit`: the job, and whether this call created it."""

    job: JobRecord
    created: bool


@dataclass(frozen=True)
class Recovered:
    """Result of one recovery pass (:meth:`JobStore.recover_lapsed`).

    Attributes:
        requeued: Ids of the jobs returned to the queue, to resume after their last
            completed step.
        exhausted: Ids of the jobs that had no recovery left: they ended ``failed`` with
            ``recovery_exhausted``.
    """

    requeued: tuple[str, ...]
    exhausted: tuple[str, ...]


class StepRefusal(StrEnum):
    """Why :meth:`JobStore.begin_step` recorded nothing.

    ``cancelled``: cancellation of the job was requested. ``lease_lost``: the job no longer
    runs under the caller's claim (recovery took it; the caller must stop).
    """

    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"


def _redact_tree(value: Any) -> Any:
    # Redact each string before encoding: inside JSON text, escaped quotes would hide
    # patterns such as "password": "..." from the redactor.
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _redact_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_tree(v) for v in value]
    return value


def _exhausted_message(
    job_id: str, recoveries: int, cause: str, last_step: RowMapping | None
) -> str:
    """What a ``recovery_exhausted`` failure says: how often, where it died, what to do."""
    times = "once" if recoveries == 1 else f"{recoveries} times"
    text = (
        f"recovered {times} without completing a step, and its runner died again "
        f"({_RECOVERY_CAUSES.get(cause, cause)})"
    )
    if last_step is None:
        text += "; it died before its first step"
    else:
        text += (
            f"; last step {last_step['name']!r} (#{last_step['seq']}, {last_step['status']}, "
            f"begun {last_step['attempts']} times)"
        )
        if last_step["error_code"] is not None:
            text += f", its last error: {last_step['error_code']}: {last_step['error_message']}"
        else:
            text += ", no error recorded: its process died (or stopped renewing) while it ran"
    return (
        f"{text}. Find out why it dies there, then `sbproxy jobs retry {job_id}` resumes it "
        "after its last completed step."
    )


def _event_json(data: Mapping[str, Any]) -> str:
    encoded = json.dumps(_redact_tree(data), separators=(",", ":"), sort_keys=True)
    if len(encoded.encode()) > MAX_EVENT_BYTES:
        encoded = json.dumps({"truncated": True})
    return encoded


class JobStore:
    """Repository over one journal :class:`Database`.

    Args:
        database: The open journal.
        clock: Source of "now" in epoch milliseconds for the timestamps people read (tests
            inject their own).
        lease_clock: Source of lease time, the only clock leases, heartbeats and recovery
            read (tests inject their own).
    """

    def __init__(
        self,
        database: Database,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        lease_clock: LeaseClock = system_lease_time,
    ) -> None:
        self.database = database
        self.clock = clock
        self.lease_clock = lease_clock
        self.outcomes = JobOutcomes()

    def _count_outcome(self, row: Any, status: JobStatus, ended_ms: int) -> None:
        """Tally a terminal transition this store just committed (``row``: kind, started)."""
        if status not in TERMINAL_JOB_STATUSES:
            return
        started = row[1]
        self.outcomes.record(
            kind=str(row[0]),
            status=status.value,
            duration_s=None if started is None else (ended_ms - int(started)) / 1000,
        )

    # -- reads -----------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRecord | None:
        """The job with ``job_id``, or ``None``."""
        async with self.database.read() as connection:
            row = (
                (
                    await connection.execute(
                        text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}
                    )
                )
                .mappings()
                .first()
            )
        return _job(row) if row else None

    async def find_active(self, idempotency_key: str) -> JobRecord | None:
        """The unfinished (queued, running or parked) job holding ``idempotency_key``."""
        async with self.database.read() as connection:
            row = await self._active_by_key(connection, idempotency_key)
        return _job(row) if row else None

    async def list_jobs(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        kind: str | None = None,
        subject: str | None = None,
        limit: int = 100,
    ) -> list[JobRecord]:
        """Jobs newest first, optionally filtered by status, kind and subject.

        ``limit`` caps the count; ``-1`` returns every match (SQLite reads a negative
        ``LIMIT`` as none).
        """
        clauses = []
        params: dict[str, Any] = {"limit": limit}
        if statuses:
            clauses.append(f"status IN {_in(statuses)}")
        if kind is not None:
            clauses.append("kind = :kind")
            params["kind"] = kind
        if subject is not None:
            clauses.append("subject = :subject")
            params["subject"] = subject
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        query = f"SELECT * FROM jobs {where} ORDER BY created_at_ms DESC, id DESC LIMIT :limit"  # noqa: S608 - clauses are fixed text
        async with self.database.read() as connection:
            rows = (await connection.execute(text(query), params)).mappings().all()
        return [_job(row) for row in rows]

    async def steps(self, job_id: str) -> list[StepRecord]:
        """The journal of ``job_id`` in step order."""
        async with self.database.read() as connection:
            rows = (
                (
                    await connection.execute(
                        text("SELECT * FROM steps WHERE job_id = :id ORDER BY seq"), {"id": job_id}
                    )
                )
                .mappings()
                .all()
            )
        return [_step(row) for row in rows]

    async def events(
        self, job_id: str, *, after_seq: int = 0, limit: int = 500
    ) -> list[EventRecord]:
        """Events of ``job_id`` with ``seq > after_seq``, oldest first."""
        async with self.database.read() as connection:
            rows = (
                (
                    await connection.execute(
                        text(
                            "SELECT * FROM job_events WHERE job_id = :id AND seq > :after"
                            " ORDER BY seq LIMIT :limit"
                        ),
                        {"id": job_id, "after": after_seq, "limit": limit},
                    )
                )
                .mappings()
                .all()
            )
        return [
            EventRecord(
                seq=row["seq"],
                job_id=row["job_id"],
                at_ms=row["at_ms"],
                type=row["type"],
                data=json.loads(row["data_json"]),
            )
            for row in rows
        ]

    async def last_event_seq(self, job_id: str) -> int:
        """Sequence number of the newest event of ``job_id`` (0 when it has none)."""
        async with self.database.read() as connection:
            value = (
                await connection.execute(
                    text("SELECT COALESCE(MAX(seq), 0) FROM job_events WHERE job_id = :id"),
                    {"id": job_id},
                )
            ).scalar_one()
        return int(value)

    # -- submission ------------------------------------------------------------------------

    async def submit(
        self,
        *,
        kind: str,
        workflow_version: int,
        input_json: str,
        idempotency_key: str | None = None,
        subject: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> SubmitOutcome:
        """Create a queued job, or return the unfinished job holding ``idempotency_key``.

        The check and the insert share one ``BEGIN IMMEDIATE`` transaction and a partial
        unique index backs it, so concurrent submitters of one key get one job.
        """

        async def work(connection: AsyncConnection) -> SubmitOutcome:
            if idempotency_key is not None:
                existing = await self._active_by_key(connection, idempotency_key)
                if existing is not None:
                    return SubmitOutcome(job=_job(existing), created=False)
            now = self.clock()
            job_id = str(ULID())
            await connection.execute(
                text(
                    "INSERT INTO jobs (id, kind, workflow_version, subject, input_json,"
                    " idempotency_key, status, trace_context, created_at_ms, updated_at_ms)"
                    " VALUES (:id, :kind, :version, :subject, :input, :key, :status, :trace,"
                    " :now, :now)"
                ),
                {
                    "id": job_id,
                    "kind": kind,
                    "version": workflow_version,
                    "subject": subject,
                    "input": input_json,
                    "key": idempotency_key,
                    "status": JobStatus.QUEUED.value,
                    "trace": json.dumps(dict(trace_context)) if trace_context else None,
                    "now": now,
                },
            )
            await self._event(connection, job_id, "status", {"status": "queued"}, now)
            row = await self._row(connection, job_id)
            return SubmitOutcome(job=_job(row), created=True)

        try:
            return await self.database.write(work)
        except IntegrityError:
            # Another process inserted the same key between our check and insert (possible
            # only across separate databases' views; kept as a belt-and-braces path).
            assert idempotency_key is not None  # noqa: S101 - only the key index can conflict
            existing_job = await self.find_active(idempotency_key)
            if existing_job is None:
                raise
            return SubmitOutcome(job=existing_job, created=False)

    # -- leases ----------------------------------------------------------------------------

    async def claim(
        self, *, owner: str, lease_ms: int, job_id: str | None = None, kinds: Sequence[str] = ()
    ) -> JobRecord | None:
        """Move one queued job to running under ``owner``'s lease (compare-and-set).

        Args:
            owner: Lease owner id of the claiming worker.
            lease_ms: Lease duration in milliseconds of lease time; the owner must heartbeat
                before it lapses.
            job_id: Claim this job only; otherwise the oldest queued job.
            kinds: Restrict the oldest-first claim to these workflow kinds.

        Returns:
            The claimed job, or ``None`` when nothing was claimable.
        """

        async def work(connection: AsyncConnection) -> JobRecord | None:
            now = self.clock()
            if job_id is not None:
                target = job_id
            else:
                kind_clause = ""
                params: dict[str, Any] = {}
                if kinds:
                    names = ", ".join(f":k{i}" for i in range(len(kinds)))
                    kind_clause = f" AND kind IN ({names})"
                    params = {f"k{i}": k for i, k in enumerate(kinds)}
                found = (
                    await connection.execute(
                        text(
                            "SELECT id FROM jobs WHERE status = 'queued'"  # noqa: S608 - fixed text
                            f"{kind_clause} ORDER BY created_at_ms, id LIMIT 1"
                        ),
                        params,
                    )
                ).scalar()
                if found is None:
                    return None
                target = found
            # Read inside the write lock: every lease stamped before is already committed, so
            # no observer ever sees a renewal later than its own reading of the clock.
            lease_now = self.lease_clock()
            result = await connection.execute(
                text(
                    "UPDATE jobs SET status = 'running', lease_owner = :owner,"  # noqa: S608 - fixed text
                    f" {_SET_LEASE}, attempt = attempt + 1,"
                    " started_at_ms = COALESCE(started_at_ms, :now), updated_at_ms = :now"
                    " WHERE id = :id AND status = 'queued'"
                ),
                {
                    "owner": owner,
                    "clock": lease_now.clock,
                    "deadline": lease_now.ms + lease_ms,
                    "lease_ms": lease_ms,
                    "now": now,
                    "id": target,
                },
            )
            if result.rowcount != 1:
                return None
            await self._event(connection, target, "status", {"status": "running"}, now)
            return _job(await self._row(connection, target))

        return await self.database.write(work)

    async def heartbeat(self, job_id: str, *, owner: str, attempt: int, lease_ms: int) -> bool:
        """Extend the lease of ``owner``'s claim ``attempt`` to ``lease_ms`` from now on the
        lease clock.

        Returns ``False``, writing nothing, when that claim no longer holds the job (recovery
        took it): the runner must stop.
        """

        async def work(connection: AsyncConnection) -> bool:
            now = self.clock()
            lease_now = self.lease_clock()
            result = await connection.execute(
                text(
                    f"UPDATE jobs SET {_SET_LEASE}, updated_at_ms = :now"  # noqa: S608 - fixed text
                    f" WHERE id = :id AND {_FENCE}"
                ),
                {
                    "clock": lease_now.clock,
                    "deadline": lease_now.ms + lease_ms,
                    "lease_ms": lease_ms,
                    "now": now,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            )
            return bool(result.rowcount == 1)

        return await self.database.write(work)

    async def requeue_expired(self) -> list[str]:
        """Return running jobs whose lease lapsed to ``queued``, without a recovery bound;
        their ids (:meth:`recover_lapsed` with ``max_recoveries=None``)."""
        return list((await self.recover_lapsed(max_recoveries=None)).requeued)

    async def recover_lapsed(self, *, max_recoveries: int | None) -> Recovered:
        """Take every running job whose lease lapsed from its runner, in one transaction.

        Decided on the lease clock only (:meth:`LeaseStamp.lapsed`): past its deadline, or
        stamped on a clock this one cannot measure (another boot: the owner is gone). A
        wall-clock step changes nothing here. A job with a recovery left goes back to
        ``queued`` (``recoveries`` + 1, event reason ``lease_expired``); one already recovered
        ``max_recoveries`` times since a step last completed ends ``failed`` with
        ``recovery_exhausted``, its message naming the last step and that step's error.

        Args:
            max_recoveries: Recoveries allowed in a row without a completed step; ``None``
                for no bound.
        """
        exhausted_rows: list[tuple[Any, int]] = []

        async def work(connection: AsyncConnection) -> Recovered:
            exhausted_rows.clear()  # a retried transaction starts over
            now = self.clock()
            lease_now = self.lease_clock()
            params = {
                "now": now,
                "clock": lease_now.clock,
                "lease_now": lease_now.ms,
                "max": max_recoveries,
            }
            requeued = list(
                (
                    await connection.execute(
                        text(
                            f"UPDATE jobs SET status = 'queued', {_NO_LEASE},"  # noqa: S608 - fixed text
                            " recoveries = recoveries + 1, updated_at_ms = :now"
                            f" WHERE status = 'running' AND {_LAPSED} AND {_MAY_RECOVER}"
                            " RETURNING id, recoveries"
                        ),
                        params,
                    )
                ).all()
            )
            for job_id, recoveries in requeued:
                await self._event(
                    connection,
                    job_id,
                    "status",
                    {"status": "queued", "reason": "lease_expired", "recovery": recoveries},
                    now,
                )
            spent = list(
                (
                    await connection.execute(
                        text(
                            "SELECT id FROM jobs WHERE status = 'running'"  # noqa: S608 - fixed text
                            f" AND {_LAPSED} AND {_OUT_OF_RECOVERIES} ORDER BY created_at_ms, id"
                        ),
                        params,
                    )
                ).scalars()
            )
            exhausted = []
            for job_id in spent:
                row = await self._exhaust(
                    connection,
                    job_id,
                    cause="lease_expired",
                    condition=f"{_LAPSED} AND {_OUT_OF_RECOVERIES}",
                    params=params,
                )
                if row is not None:
                    exhausted.append(job_id)
                    exhausted_rows.append((row, now))
            return Recovered(
                requeued=tuple(job_id for job_id, _ in requeued), exhausted=tuple(exhausted)
            )

        recovered = await self.database.write(work)
        for row, ended in exhausted_rows:
            self._count_outcome(row, JobStatus.FAILED, ended)
        return recovered

    async def requeue_from(self, job_id: str, *, owner: str, reason: str) -> bool:
        """Re-queue ``job_id`` if it is still running under ``owner`` (a dead worker), without
        a recovery bound (:meth:`recover_from` with ``max_recoveries=None``)."""
        moved = await self.recover_from(job_id, owner=owner, reason=reason, max_recoveries=None)
        return moved == JobStatus.QUEUED

    async def recover_from(
        self, job_id: str, *, owner: str, reason: str, max_recoveries: int | None
    ) -> JobStatus | None:
        """Take ``job_id`` from ``owner`` (a dead worker) if it still runs under it.

        Args:
            job_id: The job.
            owner: The lease owner the caller found dead.
            reason: Event reason of the re-queue (``owner_gone``).
            max_recoveries: Recoveries allowed in a row without a completed step; ``None``
                for no bound.

        Returns:
            ``queued`` when it went back to the queue (``recoveries`` + 1), ``failed`` when it
            had been recovered ``max_recoveries`` times since a step last completed and ended
            with ``recovery_exhausted``, ``None`` when ``owner`` no longer held it.
        """
        exhausted_rows: list[tuple[Any, int]] = []

        async def work(connection: AsyncConnection) -> JobStatus | None:
            exhausted_rows.clear()
            now = self.clock()
            params = {"now": now, "id": job_id, "owner": owner, "max": max_recoveries}
            requeued = (
                await connection.execute(
                    text(
                        f"UPDATE jobs SET status = 'queued', {_NO_LEASE},"  # noqa: S608 - fixed text
                        " recoveries = recoveries + 1, updated_at_ms = :now"
                        " WHERE id = :id AND status = 'running' AND lease_owner = :owner"
                        f" AND {_MAY_RECOVER} RETURNING recoveries"
                    ),
                    params,
                )
            ).scalar()
            if requeued is not None:
                await self._event(
                    connection,
                    job_id,
                    "status",
                    {"status": "queued", "reason": reason, "recovery": requeued},
                    now,
                )
                return JobStatus.QUEUED
            row = await self._exhaust(
                connection,
                job_id,
                cause=reason,
                condition=f"lease_owner = :owner AND {_OUT_OF_RECOVERIES}",
                params=params,
            )
            if row is None:
                return None
            exhausted_rows.append((row, now))
            return JobStatus.FAILED

        moved = await self.database.write(work)
        for row, ended in exhausted_rows:
            self._count_outcome(row, JobStatus.FAILED, ended)
        return moved

    async def _exhaust(
        self,
        connection: AsyncConnection,
        job_id: str,
        *,
        cause: str,
        condition: str,
        params: Mapping[str, Any],
    ) -> Any:
        """Fail running ``job_id`` with ``recovery_exhausted`` if ``condition`` holds (one
        compare-and-set); its ``(kind, started_at_ms)`` row, or ``None`` when it did not."""
        now = params["now"]
        recoveries = (
            await connection.execute(
                text("SELECT recoveries FROM jobs WHERE id = :id"), {"id": job_id}
            )
        ).scalar()
        last_step = (
            (
                await connection.execute(
                    text("SELECT * FROM steps WHERE job_id = :id ORDER BY seq DESC LIMIT 1"),
                    {"id": job_id},
                )
            )
            .mappings()
            .first()
        )
        message = _bounded(_exhausted_message(job_id, int(recoveries or 0), cause, last_step))
        row = (
            await connection.execute(
                text(
                    "UPDATE jobs SET status = 'failed', error_code = :code,"  # noqa: S608 - fixed text
                    f" error_message = :message, {_NO_LEASE}, updated_at_ms = :now,"
                    " ended_at_ms = :now"
                    f" WHERE id = :job AND status = 'running' AND {condition}"
                    " RETURNING kind, started_at_ms"
                ),
                {**params, "job": job_id, "code": RECOVERY_EXHAUSTED, "message": message},
            )
        ).first()
        if row is None:
            return None
        data: dict[str, Any] = {
            "status": "failed",
            "reason": RECOVERY_EXHAUSTED,
            "error": {"code": RECOVERY_EXHAUSTED, "message": message},
        }
        if last_step is not None:
            data["step"] = last_step["name"]
        await self._event(connection, job_id, "status", data, now)
        return row

    # -- outcomes --------------------------------------------------------------------------

    async def finish(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        status: JobStatus,
        output_json: str | None = None,
        error: ErrorInfo | None = None,
    ) -> bool:
        """Record a running job's outcome if ``owner``'s claim ``attempt`` still holds it.

        ``status`` is succeeded, failed, cancelled or parked. Returns ``False`` (and writes
        nothing) when the lease was lost to recovery.
        """

        async def work(connection: AsyncConnection) -> tuple[Any, int] | None:
            now = self.clock()
            ended = now if status in TERMINAL_JOB_STATUSES else None
            result = await connection.execute(
                text(
                    "UPDATE jobs SET status = :status, output_json = :output,"  # noqa: S608 - fixed text
                    f" error_code = :code, error_message = :message, {_NO_LEASE},"
                    " updated_at_ms = :now, ended_at_ms = :ended"
                    f" WHERE id = :id AND {_FENCE}"
                    " RETURNING kind, started_at_ms"
                ),
                {
                    "status": status.value,
                    "output": output_json,
                    "code": error.code if error else None,
                    "message": _bounded(error.message) if error else None,
                    "now": now,
                    "ended": ended,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            )
            row = result.first()
            if row is None:
                return None
            data: dict[str, Any] = {"status": status.value}
            if error:
                data["error"] = {"code": error.code, "message": error.message}
            await self._event(connection, job_id, "status", data, now)
            return row, now

        done = await self.database.write(work)
        if done is None:
            return False
        self._count_outcome(done[0], status, done[1])
        return True

    async def request_cancel(self, job_id: str) -> JobRecord | None:
        """Cancel a job: queued and parked jobs at once, running ones cooperatively.

        Returns the job after the request, or ``None`` if it does not exist. Finished jobs
        are returned unchanged.
        """

        cancelled: list[tuple[Any, int]] = []

        async def work(connection: AsyncConnection) -> JobRecord | None:
            cancelled.clear()  # a retried transaction starts over
            now = self.clock()
            direct = (
                await connection.execute(
                    text(
                        "UPDATE jobs SET status = 'cancelled', cancel_requested = 1,"  # noqa: S608 - fixed text
                        f" {_NO_LEASE}, updated_at_ms = :now,"
                        " ended_at_ms = :now WHERE id = :id AND status IN ('queued', 'parked')"
                        " RETURNING kind, started_at_ms"
                    ),
                    {"now": now, "id": job_id},
                )
            ).first()
            if direct is not None:
                cancelled.append((direct, now))
                await self._event(connection, job_id, "status", {"status": "cancelled"}, now)
            else:
                flagged = await connection.execute(
                    text(
                        "UPDATE jobs SET cancel_requested = 1, updated_at_ms = :now"
                        " WHERE id = :id AND status = 'running' AND cancel_requested = 0"
                    ),
                    {"now": now, "id": job_id},
                )
                if flagged.rowcount == 1:
                    await self._event(connection, job_id, "cancel_requested", {}, now)
            row = await self._row_or_none(connection, job_id)
            return _job(row) if row else None

        record = await self.database.write(work)
        for row, ended in cancelled:
            self._count_outcome(row, JobStatus.CANCELLED, ended)
        return record

    async def cancel_requested(self, job_id: str) -> bool:
        """Whether cancellation of ``job_id`` was requested (cheap read for long loops)."""
        async with self.database.read() as connection:
            value = (
                await connection.execute(
                    text("SELECT cancel_requested FROM jobs WHERE id = :id"), {"id": job_id}
                )
            ).scalar()
        return bool(value)

    async def retry(self, job_id: str) -> JobRecord | None:
        """Re-queue a failed or parked job; it resumes after its last completed step.

        Its recovery count starts again from 0, so a job that ended ``recovery_exhausted``
        gets the full number of recoveries once more. Returns the job after the attempt
        (unchanged if it was not failed or parked), or ``None`` when it does not exist. A
        failed job whose idempotency key was taken by a newer unfinished job stays failed.
        """

        async def work(connection: AsyncConnection) -> JobRecord | None:
            now = self.clock()
            try:
                result = await connection.execute(
                    text(
                        "UPDATE jobs SET status = 'queued', error_code = NULL,"
                        " error_message = NULL, cancel_requested = 0, ended_at_ms = NULL,"
                        " recoveries = 0, updated_at_ms = :now"
                        " WHERE id = :id AND status IN ('failed', 'parked')"
                    ),
                    {"now": now, "id": job_id},
                )
            except IntegrityError:
                result = None
            if result is not None and result.rowcount == 1:
                await self._event(
                    connection, job_id, "status", {"status": "queued", "reason": "retry"}, now
                )
            row = await self._row_or_none(connection, job_id)
            return _job(row) if row else None

        return await self.database.write(work)

    async def report_progress(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        progress: Mapping[str, Any],
        event: bool,
    ) -> bool:
        """Store the latest progress of a running job; append an event when ``event``.

        Returns ``False``, writing nothing, when ``owner``'s claim ``attempt`` no longer holds
        the job.
        """

        async def work(connection: AsyncConnection) -> bool:
            now = self.clock()
            result = await connection.execute(
                text(
                    "UPDATE jobs SET progress_json = :progress, updated_at_ms = :now"  # noqa: S608 - fixed text
                    f" WHERE id = :id AND {_FENCE}"
                ),
                {
                    "progress": _event_json(progress),
                    "now": now,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            )
            if result.rowcount != 1:
                return False
            if event:
                await self._event(connection, job_id, "progress", dict(progress), now)
            return True

        return await self.database.write(work)

    async def record_event(self, job_id: str, *, kind: str, data: Mapping[str, Any]) -> None:
        """Append one event of type ``kind`` to ``job_id``'s durable event stream (the
        runtime's deployment transitions, for example); a job that is gone records nothing."""

        async def work(connection: AsyncConnection) -> None:
            if await self._row_or_none(connection, job_id) is not None:
                await self._event(connection, job_id, kind, dict(data), self.clock())

        await self.database.write(work)

    async def detach_key(self, job_id: str) -> None:
        """Drop ``job_id``'s idempotency key, so that a new submission with that key makes a
        new job instead of joining this one (a superseded job winding down)."""

        async def work(connection: AsyncConnection) -> None:
            await connection.execute(
                text("UPDATE jobs SET idempotency_key = NULL WHERE id = :id"), {"id": job_id}
            )

        await self.database.write(work)

    # -- the journal -----------------------------------------------------------------------

    async def begin_step(
        self, job_id: str, *, owner: str, attempt: int, seq: int, name: str
    ) -> StepRecord | StepRefusal:
        """Record that step ``seq`` starts (inserting it, or counting a re-run).

        The insert is fenced: it happens only while ``owner``'s claim ``attempt`` holds the
        job and no cancellation was requested, checked in the same statement.

        Returns:
            The step as recorded; or, having recorded nothing, ``StepRefusal.CANCELLED``
            (cancellation was requested) or ``StepRefusal.LEASE_LOST`` (the claim no longer
            holds the job: stop).
        """

        async def work(connection: AsyncConnection) -> StepRecord | StepRefusal:
            now = self.clock()
            params = {
                "id": job_id,
                "seq": seq,
                "name": name,
                "now": now,
                "owner": owner,
                "attempt": attempt,
            }
            # The WHERE clause also keeps SQLite from reading ON CONFLICT as a join constraint.
            row = (
                (
                    await connection.execute(
                        text(
                            "INSERT INTO steps (job_id, seq, name, status, attempts, started_at_ms)"  # noqa: S608 - fixed text
                            " SELECT id, :seq, :name, 'running', 1, :now FROM jobs"
                            f" WHERE id = :id AND {_FENCE} AND cancel_requested = 0"
                            " ON CONFLICT (job_id, seq) DO UPDATE SET status = 'running',"
                            " attempts = attempts + 1, error_code = NULL, error_message = NULL,"
                            " ended_at_ms = NULL"
                            " RETURNING *"
                        ),
                        params,
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                held = (
                    await connection.execute(
                        text(f"SELECT 1 FROM jobs WHERE id = :id AND {_FENCE}"),  # noqa: S608 - fixed text
                        params,
                    )
                ).scalar()
                return StepRefusal.CANCELLED if held else StepRefusal.LEASE_LOST
            await self._event(
                connection, job_id, "step", {"seq": seq, "name": name, "status": "running"}, now
            )
            return _step(row)

        return await self.database.write(work)

    async def end_step(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        seq: int,
        name: str,
        output_json: str | None = None,
        error: ErrorInfo | None = None,
    ) -> bool:
        """Record a step's outcome: its output (succeeded) or its error (failed).

        Fenced like :meth:`begin_step`: the step row changes only while ``owner``'s claim
        ``attempt`` holds the job, so a runner that lost its lease never overwrites what the
        new owner recorded. A succeeded step also resets the job's recovery count.

        Returns:
            ``False``, having written nothing, when the claim no longer holds the job.
        """

        async def work(connection: AsyncConnection) -> bool:
            now = self.clock()
            status = StepStatus.FAILED if error else StepStatus.SUCCEEDED
            params = {
                "status": status.value,
                "output": output_json,
                "code": error.code if error else None,
                "message": _bounded(error.message) if error else None,
                "now": now,
                "id": job_id,
                "seq": seq,
                "owner": owner,
                "attempt": attempt,
            }
            result = await connection.execute(
                text(
                    "UPDATE steps SET status = :status, output_json = :output,"  # noqa: S608 - fixed text
                    " error_code = :code, error_message = :message, ended_at_ms = :now"
                    " WHERE job_id = :id AND seq = :seq AND status = 'running'"
                    f" AND {_STEP_FENCE}"
                ),
                params,
            )
            if result.rowcount != 1:
                return False
            if status == StepStatus.SUCCEEDED:
                await connection.execute(
                    text(f"UPDATE jobs SET recoveries = 0 WHERE id = :id AND {_FENCE}"),  # noqa: S608 - fixed text
                    params,
                )
            data: dict[str, Any] = {"seq": seq, "name": name, "status": status.value}
            if error:
                data["error"] = {"code": error.code, "message": error.message}
            await self._event(connection, job_id, "step", data, now)
            return True

        return await self.database.write(work)

    # -- retention -------------------------------------------------------------------------

    async def prune_terminal(self, *, keep: int) -> int:
        """Delete the oldest finished jobs beyond the newest ``keep``; never active ones."""

        async def work(connection: AsyncConnection) -> int:
            result = await connection.execute(
                text(
                    f"DELETE FROM jobs WHERE status IN {_in(TERMINAL_JOB_STATUSES)} AND id NOT IN ("  # noqa: S608
                    f" SELECT id FROM jobs WHERE status IN {_in(TERMINAL_JOB_STATUSES)}"
                    " ORDER BY ended_at_ms DESC, created_at_ms DESC, id DESC LIMIT :keep)"
                ),
                {"keep": keep},
            )
            return int(result.rowcount)

        return await self.database.write(work)

    # -- helpers ---------------------------------------------------------------------------

    async def _active_by_key(self, connection: AsyncConnection, key: str) -> RowMapping | None:
        return (
            (
                await connection.execute(
                    text(
                        "SELECT * FROM jobs WHERE idempotency_key = :key"  # noqa: S608
                        f" AND status IN {_in(ACTIVE_JOB_STATUSES)}"
                    ),
                    {"key": key},
                )
            )
            .mappings()
            .first()
        )

    async def _row(self, connection: AsyncConnection, job_id: str) -> RowMapping:
        return (
            (await connection.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}))
            .mappings()
            .one()
        )

    async def _row_or_none(self, connection: AsyncConnection, job_id: str) -> RowMapping | None:
        return (
            (await connection.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}))
            .mappings()
            .first()
        )

    async def _event(
        self,
        connection: AsyncConnection,
        job_id: str,
        kind: str,
        data: Mapping[str, Any],
        now: int,
    ) -> None:
        await connection.execute(
            text(
                "INSERT INTO job_events (job_id, at_ms, type, data_json)"
                " VALUES (:id, :at, :type, :data)"
            ),
            {"id": job_id, "at": now, "type": kind, "data": _event_json(data)},
        )
