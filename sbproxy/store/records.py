"""The records the journal returns: jobs, steps and events as frozen values, never rows.

They and their row decoders live apart from the repositories (``jobs.py``) so that a reader
that only needs records -- ``store.readonly``, the CLI's job tables -- imports nothing of
the write path. A row is anything read by column name (a ``sqlite3.Row``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sbproxy.store.leaseclock import LeaseStamp
from sbproxy.store.lifecycle import TERMINAL_JOB_STATUSES, JobStatus, StepStatus

__all__ = [
    "EndedStep",
    "ErrorInfo",
    "EventRecord",
    "JobRecord",
    "Row",
    "StepRecord",
    "error_info",
    "job_from_row",
    "list_jobs_query",
    "step_from_row",
    "wall_clock_ms",
]


class Row(Protocol):
    """One database row read by column name (``RowMapping``, ``sqlite3.Row``, a dict)."""

    def __getitem__(self, key: str, /) -> Any: ...


def list_jobs_query(
    *,
    statuses: Sequence[JobStatus] = (),
    kind: str | None = None,
    subject: str | None = None,
    limit: int = 100,
    node: str | None = None,
) -> tuple[str, list[object]]:
    """The one ``SELECT`` behind every job listing (the store's and the read-only reader's):
    jobs newest first, filtered by status, kind, subject and node, ``limit`` of them (``-1``:
    every match; SQLite reads a negative ``LIMIT`` as none). ``(sql, positional params)``."""
    clauses = []
    params: list[object] = []
    if statuses:
        clauses.append(f"status IN ({', '.join('?' for _ in statuses)})")
        params.extend(status.value for status in statuses)
    if kind is not None:
        clauses.append("kind = ?")
        params.append(kind)
    if subject is not None:
        clauses.append("subject = ?")
        params.append(subject)
    if node is not None:
        clauses.append("node = ?")
        params.append(node)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    query = f"SELECT * FROM jobs {where} ORDER BY created_at_ms DESC, id DESC LIMIT ?"  # noqa: S608 - clauses are fixed text
    return query, [*params, limit]


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class ErrorInfo:
    """A recorded failure: stable reason code and a bounded, redacted message."""

    code: str
    message: str


@dataclass(frozen=True)
class JobRecord:
    """A job as stored (never an ORM row).

    Attributes:
        id: ULID text.
        kind: Workflow name.
        workflow_version: Version of the workflow code that created it.
        subject: What the job acts on (``artifact:sha256:<digest>``, ``deployment:<id>``).
        input: The workflow input as a JSON object.
        idempotency_key: Key that deduplicates submissions while the job is unfinished.
        status: Lifecycle state.
        attempt: How many times a worker has claimed it.
        lease_owner: Worker holding it while running.
        lease: That worker's lease, on the lease clock (``None`` when not running, or for
            a lease an sbproxy before schema 4 wrote, which counts as lapsed).
        cancel_requested: An operator asked for cancellation.
        progress: Latest progress report (``{"done", "total", "unit", "current"}``).
        output: Workflow result (JSON) once succeeded.
        error: Failure, for failed and parked jobs.
        trace_context: W3C trace context of the request that created it.
        recoveries: How many times recovery took the job from a dead or lapsed runner since a
            step last completed (0 after a completed step or an operator's retry).
        node: The node that submitted it, the only one that claims and recovers it
            (``store.node``); ``None`` for a job from before schema 6 (any node).
    """

    id: str
    kind: str
    workflow_version: int
    subject: str | None
    input: Mapping[str, Any]
    idempotency_key: str | None
    status: JobStatus
    attempt: int
    lease_owner: str | None
    lease: LeaseStamp | None
    cancel_requested: bool
    progress: Mapping[str, Any] | None
    output: Any
    error: ErrorInfo | None
    trace_context: Mapping[str, str] | None
    created_at_ms: int
    updated_at_ms: int
    started_at_ms: int | None
    ended_at_ms: int | None
    recoveries: int = 0
    node: str | None = None

    @property
    def terminal(self) -> bool:
        """Whether the job has finished (succeeded, failed or cancelled)."""
        return self.status in TERMINAL_JOB_STATUSES

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (the shape of ``jobs show`` and the admin API).

        The lease is three fields: ``lease_clock`` (boot id), ``lease_deadline_ms`` (ms on
        that boot's ``CLOCK_MONOTONIC``, not an epoch time) and ``lease_ms`` (its length);
        all ``None`` when no lease is held.
        """
        return {
            "id": self.id,
            "kind": self.kind,
            "workflow_version": self.workflow_version,
            "subject": self.subject,
            "status": self.status.value,
            "attempt": self.attempt,
            "recoveries": self.recoveries,
            "node": self.node,
            "idempotency_key": self.idempotency_key,
            "cancel_requested": self.cancel_requested,
            "progress": dict(self.progress) if self.progress else None,
            "output": self.output,
            "error": {"code": self.error.code, "message": self.error.message}
            if self.error
            else None,
            "lease_owner": self.lease_owner,
            "lease_clock": self.lease.clock if self.lease else None,
            "lease_deadline_ms": self.lease.deadline_ms if self.lease else None,
            "lease_ms": self.lease.duration_ms if self.lease else None,
            "created_at_ms": self.created_at_ms,
            "updated_at_ms": self.updated_at_ms,
            "started_at_ms": self.started_at_ms,
            "ended_at_ms": self.ended_at_ms,
        }


@dataclass(frozen=True)
class StepRecord:
    """One journal entry."""

    job_id: str
    seq: int
    name: str
    status: StepStatus
    attempts: int
    output_json: str | None
    error: ErrorInfo | None
    started_at_ms: int
    ended_at_ms: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {
            "seq": self.seq,
            "name": self.name,
            "status": self.status.value,
            "attempts": self.attempts,
            "output": json.loads(self.output_json) if self.output_json else None,
            "error": {"code": self.error.code, "message": self.error.message}
            if self.error
            else None,
            "started_at_ms": self.started_at_ms,
            "ended_at_ms": self.ended_at_ms,
        }


@dataclass(frozen=True)
class EndedStep:
    """A step that succeeded, whose result a runner records together with the start of the
    job's next step (one commit; ``JobStore.begin_step``'s ``ending``).

    Attributes:
        seq: The step's position in the journal.
        name: Its journal name.
        output_json: Its result, encoded.
        reset_recoveries: Whether recording it must also reset the job's recovery count (a
            completed step ends a run of recoveries). ``False`` when the runner knows the
            count is 0 already -- its claim found it so, or an earlier step of the run reset
            it; nothing else changes the count while the claim holds -- and the write then
            skips the reset (one table less to write on PostgreSQL).
    """

    seq: int
    name: str
    output_json: str
    reset_recoveries: bool = True


@dataclass(frozen=True)
class EventRecord:
    """One job event. ``seq`` is global and strictly increasing across restarts."""

    seq: int
    job_id: str
    at_ms: int
    type: str
    data: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {
            "seq": self.seq,
            "job_id": self.job_id,
            "at_ms": self.at_ms,
            "type": self.type,
            **self.data,
        }


def error_info(code: str | None, message: str | None) -> ErrorInfo | None:
    """The recorded failure of a row's ``error_code`` and ``error_message`` (``None``: none)."""
    if code is None:
        return None
    return ErrorInfo(code=code, message=message or "")


def _lease(row: Row) -> LeaseStamp | None:
    clock, deadline, duration = row["lease_clock"], row["lease_deadline_ms"], row["lease_ms"]
    if clock is None or deadline is None or duration is None:
        return None
    return LeaseStamp(clock=clock, deadline_ms=deadline, duration_ms=duration)


def job_from_row(row: Row) -> JobRecord:
    """The record of one ``jobs`` row (every column, by name)."""
    return JobRecord(
        id=row["id"],
        kind=row["kind"],
        workflow_version=row["workflow_version"],
        subject=row["subject"],
        input=json.loads(row["input_json"]),
        idempotency_key=row["idempotency_key"],
        status=JobStatus(row["status"]),
        attempt=row["attempt"],
        lease_owner=row["lease_owner"],
        lease=_lease(row),
        cancel_requested=bool(row["cancel_requested"]),
        progress=json.loads(row["progress_json"]) if row["progress_json"] else None,
        output=json.loads(row["output_json"]) if row["output_json"] is not None else None,
        error=error_info(row["error_code"], row["error_message"]),
        trace_context=json.loads(row["trace_context"]) if row["trace_context"] else None,
        created_at_ms=row["created_at_ms"],
        updated_at_ms=row["updated_at_ms"],
        started_at_ms=row["started_at_ms"],
        ended_at_ms=row["ended_at_ms"],
        recoveries=row["recoveries"],
        node=row["node"],
    )


def step_from_row(row: Row) -> StepRecord:
    """The record of one ``steps`` row (every column, by name)."""
    return StepRecord(
        job_id=row["job_id"],
        seq=row["seq"],
        name=row["name"],
        status=StepStatus(row["status"]),
        attempts=row["attempts"],
        output_json=row["output_json"],
        error=error_info(row["error_code"], row["error_message"]),
        started_at_ms=row["started_at_ms"],
        ended_at_ms=row["ended_at_ms"],
    )
