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
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ulid import ULID

from sbproxy.redact import redact, secrets_generation
from sbproxy.store.database import Database, Transaction
from sbproxy.store.leaseclock import LeaseClock
from sbproxy.store.lifecycle import (
    ACTIVE_JOB_STATUSES,
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATUSES,
    JobStatus,
    StepStatus,
)
from sbproxy.store.node import node_id
from sbproxy.store.outcomes import JobOutcomes, WriteTallies
from sbproxy.store.postgres import DB_CLOCK, LEASE_LOCK_KEY, DatabaseLeaseTime, prepare_on_server
from sbproxy.store.records import (
    EndedStep,
    ErrorInfo,
    EventRecord,
    JobRecord,
    StepRecord,
    list_jobs_query,
    wall_clock_ms,
)
from sbproxy.store.records import job_from_row as _job
from sbproxy.store.records import step_from_row as _step

__all__ = [
    "RECOVERY_EXHAUSTED",
    "EndedStep",
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
# The jobs this node claims and recovers: its own, and those of no node (from before schema
# 6). A dead node's jobs wait for it (``node.py``).
_THIS_NODE = "(node IS NULL OR node = :node)"
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
    job_id: str, recoveries: int, cause: str, last_step: sqlite3.Row | None
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
    return _bounded_event(json.dumps(_redact_tree(data), separators=(",", ":"), sort_keys=True))


def _bounded_event(encoded: str) -> str:
    return encoded if len(encoded.encode()) <= MAX_EVENT_BYTES else json.dumps({"truncated": True})


def _step_event(seq: int, name: str, status: StepStatus) -> str:
    """The ``step`` event of a step's start (``running``) or success: the text
    ``_event_json({"seq", "name", "status"})`` writes, built without its tree walk -- every
    step writes two of these. Only the name is free text (redacted, :func:`_step_name_json`);
    the seq is an integer and the status the journal's own constant, which JSON writes as
    they are."""
    name_json = _step_name_json(name)
    # Keys sorted, no spaces: json.dumps(data, separators=(",", ":"), sort_keys=True).
    return _bounded_event(f'{{"name":{name_json},"seq":{seq:d},"status":"{status.value}"}}')


# Step names redacted and encoded as JSON strings, each with the secrets generation it was
# made under. A job's steps are named as every other job of its workflow names them, and
# the redactor's patterns cost ~8 us a name, two names a step (benchmarks/journal.py): kept,
# a name is redacted once per registered secret, not twice a step. Bounded, for workflows
# that put data in their step names.
_STEP_NAMES_KEPT = 1024
_step_names: dict[str, tuple[int, str]] = {}


def _step_name_json(name: str) -> str:
    """``json.dumps(redact(name))``, kept while no new secret is registered."""
    generation = secrets_generation()
    kept = _step_names.get(name)
    if kept is not None and kept[0] == generation:
        return kept[1]
    # The generation was read before redacting: a secret registered meanwhile makes this
    # entry look older than it is, so it is only ever redone, never trusted too long.
    encoded = json.dumps(redact(name))
    if len(_step_names) >= _STEP_NAMES_KEPT:
        _step_names.clear()
    _step_names[name] = (generation, encoded)
    return encoded


class JobStore:
    """Repository over one journal :class:`Database`.

    Args:
        database: The open journal.
        clock: Source of "now" in epoch milliseconds for the timestamps people read (tests
            inject their own).
        lease_clock: Source of lease time, the only clock leases, heartbeats and recovery
            read (tests inject their own); by default the database's
            (:attr:`Database.lease_clock`).
        node: The node this store's jobs record and the only one whose jobs it claims and
            recovers (``store.node``: ``$SBPROXY_NODE_ID`` or the host name by default).
    """

    def __init__(
        self,
        database: Database,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        lease_clock: LeaseClock | None = None,
        node: str | None = None,
    ) -> None:
        self.database = database
        self.node = node_id() if node is None else node
        self.clock = clock
        # The database's own unless a test injects one: this boot's monotonic clock on
        # SQLite, the server's clock on PostgreSQL.
        self.lease_clock = database.lease_clock if lease_clock is None else lease_clock
        self.outcomes = JobOutcomes()

    @property
    def write_tallies(self) -> WriteTallies:
        """How this process's journal writes waited, committed and grouped (metrics)."""
        return self.database.write_tallies

    async def close(self) -> None:
        """Close the journal database (its connections and their threads)."""
        await self.database.close()

    def _count_outcome(self, row: sqlite3.Row, status: JobStatus, ended_ms: int) -> None:
        """Tally a terminal transition this store just committed (``row``: the job's row,
        or at least its ``kind`` and ``started_at_ms``)."""
        if status not in TERMINAL_JOB_STATUSES:
            return
        started = row["started_at_ms"]
        self.outcomes.record(
            kind=str(row["kind"]),
            status=status.value,
            duration_s=None if started is None else (ended_ms - int(started)) / 1000,
        )

    # -- reads -----------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRecord | None:
        """The job with ``job_id``, or ``None``."""
        rows = await self.database.read(lambda tx: tx.last(_JOB_BY_ID, {"id": job_id}))
        return _job(rows[0]) if rows else None

    async def find_active(self, idempotency_key: str) -> JobRecord | None:
        """This node's unfinished (queued, running or parked) job holding ``idempotency_key``
        (keys are per node: hosts sharing a journal never join each other's jobs)."""
        row = await self.database.read(
            lambda tx: tx.one(_ACTIVE_BY_KEY, {"key": idempotency_key, "node": self.node})
        )
        return _job(row) if row else None

    async def list_jobs(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        kind: str | None = None,
        subject: str | None = None,
        limit: int = 100,
        node: str | None = None,
    ) -> list[JobRecord]:
        """Jobs newest first, optionally filtered by status, kind, subject and the node that
        submitted them (``node``).

        ``limit`` caps the count; ``-1`` returns every match (SQLite reads a negative
        ``LIMIT`` as none).
        """
        query, params = list_jobs_query(
            statuses=statuses, kind=kind, subject=subject, limit=limit, node=node
        )
        if limit < 0 and self.database.dialect == "postgresql":
            params[-1] = None  # PostgreSQL reads LIMIT NULL as none (a negative one fails)
        rows = await self.database.read(lambda tx: tx.all(query, params))
        return [_job(row) for row in rows]

    async def steps(self, job_id: str) -> list[StepRecord]:
        """The journal of ``job_id`` in step order."""
        rows = await self.database.read(lambda tx: tx.last(_STEPS_OF_JOB, {"id": job_id}))
        return [_step(row) for row in rows]

    async def events(
        self, job_id: str, *, after_seq: int = 0, limit: int = 500
    ) -> list[EventRecord]:
        """Events of ``job_id`` with ``seq > after_seq``, oldest first."""
        params = {"id": job_id, "after": after_seq, "limit": limit}
        rows = await self.database.read(lambda tx: tx.last(_EVENTS_AFTER, params))
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
        value = await self.database.read(
            lambda tx: tx.scalar(
                "SELECT COALESCE(MAX(seq), 0) FROM job_events WHERE job_id = :id", {"id": job_id}
            )
        )
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
        """Create a queued job, or return this node's unfinished job holding ``idempotency_key``.

        The check and the insert share one ``BEGIN IMMEDIATE`` transaction and a partial
        unique index backs it, so concurrent submitters of one key get one job.
        """
        trace = json.dumps(dict(trace_context)) if trace_context else None

        def parameters() -> dict[str, Any]:
            return {
                "id": str(ULID()),
                "kind": kind,
                "version": workflow_version,
                "subject": subject,
                "input": input_json,
                "key": idempotency_key,
                "trace": trace,
                "now": self.clock(),
                "node": self.node,
            }

        if idempotency_key is None and self.database.dialect == "postgresql":
            # Nothing to look up first: the job and its event in one statement (the
            # statement lane when free).
            params = {**parameters(), "event": _QUEUED_EVENT}
            [created] = await self.database.write_statement(_SUBMIT_PG, params)
            return SubmitOutcome(job=_job(created), created=True)

        def work(tx: Transaction) -> SubmitOutcome:
            if idempotency_key is not None:
                existing = tx.one(_ACTIVE_BY_KEY, {"key": idempotency_key, "node": self.node})
                if existing is not None:
                    return SubmitOutcome(job=_job(existing), created=False)
            params = parameters()
            job_id, now = params["id"], params["now"]
            if tx.dialect == "postgresql":
                # The job and its event in one statement, sent with the COMMIT.
                [created] = tx.last(_SUBMIT_PG, {**params, "event": _QUEUED_EVENT})
                return SubmitOutcome(job=_job(created), created=True)
            row = tx.one(_SUBMIT, params)
            assert row is not None  # noqa: S101 - an INSERT ... RETURNING returns its row
            _event(tx, job_id, "status", {"status": "queued"}, now)
            return SubmitOutcome(job=_job(row), created=True)

        try:
            return await self.database.write(work)
        except sqlite3.IntegrityError:
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
        kind_clause = ""
        kind_params: dict[str, Any] = {"node": self.node}
        if kinds:
            names = ", ".join(f":k{i}" for i in range(len(kinds)))
            kind_clause = f" AND kind IN ({names})"
            kind_params.update({f"k{i}": k for i, k in enumerate(kinds)})
        oldest = (
            f"SELECT id FROM jobs WHERE status = 'queued' AND {_THIS_NODE}"  # noqa: S608 - fixed text
            f"{kind_clause} ORDER BY created_at_ms, id LIMIT 1"
        )

        # PostgreSQL: hosts claim side by side; each takes the oldest row no other claim
        # holds locked (SQLite serialises writers, so the plain read is enough there).
        oldest_pg = f"{oldest} FOR UPDATE SKIP LOCKED"
        clock = self.lease_clock
        if job_id is not None and isinstance(clock, DatabaseLeaseTime):
            # A named job on the server's clock: one statement (the statement lane when
            # free), as ``_claim_on_server_clock`` sends it.
            params = _claim_params(
                owner=owner, lease_ms=lease_ms, now=self.clock(), target=job_id, node=self.node
            )
            [answer] = await self.database.write_statement(_CLAIM_ON_SERVER_CLOCK_PG, params)
            clock.observe(int(answer["lease_now_ms"]))
            return None if answer["id"] is None else _job(answer)

        def work(tx: Transaction) -> JobRecord | None:
            now = self.clock()
            pick = oldest_pg if tx.dialect == "postgresql" else oldest
            target = job_id if job_id is not None else tx.scalar(pick, kind_params)
            if target is None:
                return None
            if tx.dialect == "postgresql" and isinstance(self.lease_clock, DatabaseLeaseTime):
                return _claim_on_server_clock(
                    tx,
                    self.lease_clock,
                    owner=owner,
                    lease_ms=lease_ms,
                    now=now,
                    target=target,
                    node=self.node,
                )
            # Read inside the write lock: every lease stamped before is already committed, so
            # no observer ever sees a renewal later than its own reading of the clock.
            lease_now = self.lease_clock()
            params = {
                "owner": owner,
                "clock": lease_now.clock,
                "deadline": lease_now.ms + lease_ms,
                "lease_ms": lease_ms,
                "now": now,
                "id": target,
                "node": self.node,
            }
            if tx.dialect == "postgresql":
                # The claim and its event in one statement, sent with the COMMIT: the lease
                # lock taken above is held for one round trip less.
                claimed = tx.last(_CLAIM_PG, {**params, "event": _RUNNING_EVENT})
                return _job(claimed[0]) if claimed else None
            row = tx.one(_CLAIM, params)
            if row is None:
                return None
            _event(tx, target, "status", {"status": "running"}, now)
            return _job(row)

        return await self.database.write(work)

    async def heartbeat(self, job_id: str, *, owner: str, attempt: int, lease_ms: int) -> bool:
        """Extend the lease of ``owner``'s claim ``attempt`` to ``lease_ms`` from now on the
        lease clock.

        Returns ``False``, writing nothing, when that claim no longer holds the job (recovery
        took it): the runner must stop.
        """

        def work(tx: Transaction) -> bool:
            now = self.clock()
            lease_now = self.lease_clock()
            changed = tx.execute(
                _HEARTBEAT,
                {
                    "clock": lease_now.clock,
                    "deadline": lease_now.ms + lease_ms,
                    "lease_ms": lease_ms,
                    "now": now,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            ).rowcount
            return changed == 1

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
        exhausted_rows: list[tuple[sqlite3.Row, int]] = []

        def work(tx: Transaction) -> Recovered:
            exhausted_rows.clear()  # a retried transaction starts over
            now = self.clock()
            lease_now = self.lease_clock()
            params = {
                "now": now,
                "clock": lease_now.clock,
                "lease_now": lease_now.ms,
                "max": max_recoveries,
                "node": self.node,
            }
            if tx.scalar(_ANY_LAPSED, params) is None:
                return Recovered(requeued=(), exhausted=())  # the common case: a cheap read
            requeued = tx.all(_REQUEUE_LAPSED, params)
            for row in requeued:
                _event(
                    tx,
                    row["id"],
                    "status",
                    {"status": "queued", "reason": "lease_expired", "recovery": row["recoveries"]},
                    now,
                )
            exhausted = []
            for row in tx.all(_SPENT_LAPSED, params):
                ended = _exhaust(
                    tx,
                    row["id"],
                    cause="lease_expired",
                    condition=f"{_LAPSED} AND {_OUT_OF_RECOVERIES} AND {_THIS_NODE}",
                    params=params,
                )
                if ended is not None:
                    exhausted.append(row["id"])
                    exhausted_rows.append((ended, now))
            return Recovered(
                requeued=tuple(row["id"] for row in requeued), exhausted=tuple(exhausted)
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
        exhausted_rows: list[tuple[sqlite3.Row, int]] = []

        def work(tx: Transaction) -> JobStatus | None:
            exhausted_rows.clear()
            now = self.clock()
            params = {
                "now": now,
                "id": job_id,
                "owner": owner,
                "max": max_recoveries,
                "node": self.node,
            }
            requeued = tx.scalar(_REQUEUE_FROM, params)
            if requeued is not None:
                _event(
                    tx,
                    job_id,
                    "status",
                    {"status": "queued", "reason": reason, "recovery": requeued},
                    now,
                )
                return JobStatus.QUEUED
            row = _exhaust(
                tx,
                job_id,
                cause=reason,
                condition=f"lease_owner = :owner AND {_OUT_OF_RECOVERIES} AND {_THIS_NODE}",
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
        keep_finished: int | None = None,
    ) -> JobRecord | None:
        """Record a running job's outcome if ``owner``'s claim ``attempt`` still holds it.

        Args:
            job_id: The job.
            owner: Lease owner of the claim.
            attempt: The claim's attempt.
            status: Succeeded, failed, cancelled or parked.
            output_json: The workflow's result (succeeded).
            error: The failure (failed, cancelled, parked).
            keep_finished: When given and the job ended (succeeded, failed, cancelled), the
                oldest finished jobs beyond the newest ``keep_finished`` are deleted in the
                same transaction (:meth:`prune_terminal`: this node's own).

        Returns:
            The job as recorded; ``None``, having written nothing, when the lease was lost
            to recovery.

        Raises:
            ValueError: ``status`` is not one a runner records (queued or running).
        """
        if status not in _FINISHES:
            allowed = ", ".join(sorted(s.value for s in _FINISHES))
            raise ValueError(f"finish records one of {allowed}, not {status.value!r}")
        data: dict[str, Any] = {"status": status.value}
        if error:
            data["error"] = {"code": error.code, "message": error.message}
        prune = keep_finished is not None and status in TERMINAL_JOB_STATUSES

        def parameters() -> dict[str, Any]:
            now = self.clock()
            ended = now if status in TERMINAL_JOB_STATUSES else None
            return {
                "status": status.value,
                "output": output_json,
                "code": error.code if error else None,
                "message": _bounded(error.message) if error else None,
                "now": now,
                "ended": ended,
                "id": job_id,
                "owner": owner,
                "attempt": attempt,
            }

        if self.database.dialect == "postgresql" and (not prune or keep_finished):
            # The outcome, its event (and the pruning) in one statement, one round trip (the
            # statement lane when free).
            params = parameters()
            params.update(event=_event_json(data), node=self.node)
            params["keep_others"] = int(keep_finished or 1) - 1
            statement = _FINISH_AND_PRUNE_PG if prune else _FINISH_PG
            rows = await self.database.write_statement(statement, params)
            if not rows:
                return None
            self._count_outcome(rows[0], status, params["now"])
            return _job(rows[0])

        def work(tx: Transaction) -> tuple[sqlite3.Row, int] | None:
            params = parameters()
            now = params["now"]
            if tx.dialect == "postgresql":
                # keep_finished=0 prunes every finished job: the outcome, then the pruning.
                params["event"] = _event_json(data)
                row = tx.one(_FINISH_PG, params)
                if row is None:
                    return None
            else:
                row = tx.one(_FINISH, params)
                if row is None:
                    return None
                _event(tx, job_id, "status", data, now)
            if prune:
                _prune(tx, keep=int(keep_finished or 0), node=self.node)
            return row, now

        done = await self.database.write(work)
        if done is None:
            return None
        self._count_outcome(done[0], status, done[1])
        return _job(done[0])

    async def request_cancel(self, job_id: str) -> JobRecord | None:
        """Cancel a job: queued and parked jobs at once, running ones cooperatively.

        Returns the job after the request, or ``None`` if it does not exist. Finished jobs
        are returned unchanged.
        """

        cancelled: list[tuple[sqlite3.Row, int]] = []

        def work(tx: Transaction) -> JobRecord | None:
            cancelled.clear()  # a retried transaction starts over
            now = self.clock()
            direct = tx.one(
                "UPDATE jobs SET status = 'cancelled', cancel_requested = 1,"  # noqa: S608 - fixed text
                f" {_NO_LEASE}, updated_at_ms = :now,"
                " ended_at_ms = :now WHERE id = :id AND status IN ('queued', 'parked')"
                " RETURNING kind, started_at_ms",
                {"now": now, "id": job_id},
            )
            if direct is not None:
                cancelled.append((direct, now))
                _event(tx, job_id, "status", {"status": "cancelled"}, now)
            else:
                flagged = tx.execute(
                    "UPDATE jobs SET cancel_requested = 1, updated_at_ms = :now"
                    " WHERE id = :id AND status = 'running' AND cancel_requested = 0",
                    {"now": now, "id": job_id},
                ).rowcount
                if flagged == 1:
                    _event(tx, job_id, "cancel_requested", {}, now)
            row = tx.one(_JOB_BY_ID, {"id": job_id})
            return _job(row) if row else None

        record = await self.database.write(work)
        for row, ended in cancelled:
            self._count_outcome(row, JobStatus.CANCELLED, ended)
        return record

    async def cancel_requested(self, job_id: str) -> bool:
        """Whether cancellation of ``job_id`` was requested (cheap read for long loops)."""
        value = await self.database.read(
            lambda tx: tx.scalar("SELECT cancel_requested FROM jobs WHERE id = :id", {"id": job_id})
        )
        return bool(value)

    async def retry(self, job_id: str) -> JobRecord | None:
        """Re-queue a failed or parked job; it resumes after its last completed step.

        Its recovery count starts again from 0, so a job that ended ``recovery_exhausted``
        gets the full number of recoveries once more. Returns the job after the attempt
        (unchanged if it was not failed or parked), or ``None`` when it does not exist. A
        failed job whose idempotency key was taken by a newer unfinished job stays failed.
        """

        def work(tx: Transaction) -> JobRecord | None:
            now = self.clock()
            # A savepoint around the statement that may meet the key index: PostgreSQL
            # aborts the whole transaction on a violation unless it is rolled back to one.
            tx.execute("SAVEPOINT retry_key")
            try:
                changed = tx.execute(
                    "UPDATE jobs SET status = 'queued', error_code = NULL,"
                    " error_message = NULL, cancel_requested = 0, ended_at_ms = NULL,"
                    " recoveries = 0, updated_at_ms = :now"
                    " WHERE id = :id AND status IN ('failed', 'parked')",
                    {"now": now, "id": job_id},
                ).rowcount
            except sqlite3.IntegrityError:
                tx.execute("ROLLBACK TO retry_key")
                changed = 0
            tx.execute("RELEASE retry_key")
            if changed == 1:
                _event(tx, job_id, "status", {"status": "queued", "reason": "retry"}, now)
            row = tx.one(_JOB_BY_ID, {"id": job_id})
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
        encoded = _event_json(progress)
        data = dict(progress)

        def work(tx: Transaction) -> bool:
            now = self.clock()
            changed = tx.execute(
                _PROGRESS,
                {
                    "progress": encoded,
                    "now": now,
                    "id": job_id,
                    "owner": owner,
                    "attempt": attempt,
                },
            ).rowcount
            if changed != 1:
                return False
            if event:
                _event(tx, job_id, "progress", data, now)
            return True

        return await self.database.write(work)

    async def record_event(self, job_id: str, *, kind: str, data: Mapping[str, Any]) -> None:
        """Append one event of type ``kind`` to ``job_id``'s durable event stream (the
        runtime's deployment transitions, for example); a job that is gone records nothing."""
        payload = dict(data)

        def work(tx: Transaction) -> None:
            if tx.one("SELECT 1 FROM jobs WHERE id = :id", {"id": job_id}) is not None:
                _event(tx, job_id, kind, payload, self.clock())

        await self.database.write(work)

    async def detach_key(self, job_id: str) -> None:
        """Drop ``job_id``'s idempotency key, so that a new submission with that key makes a
        new job instead of joining this one (a superseded job winding down)."""
        await self.database.write(
            lambda tx: tx.execute(
                "UPDATE jobs SET idempotency_key = NULL WHERE id = :id", {"id": job_id}
            )
        )

    # -- the journal -----------------------------------------------------------------------

    async def begin_step(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        seq: int,
        name: str,
        ending: EndedStep | None = None,
    ) -> StepRecord | StepRefusal:
        """Record that step ``seq`` starts (inserting it, or counting a re-run), after
        recording the result of the step before it (``ending``) in the same transaction.

        The insert is fenced: it happens only while ``owner``'s claim ``attempt`` holds the
        job and no cancellation was requested, checked in the same statement. Its commit is
        as durable as any other: a start a reader saw (its ``step`` event and ``seq``)
        survives a crash of the database server. ``ending`` is recorded as :meth:`end_step`
        records a success (fenced the same way) before the start, its event first: one
        commit for one step's end and the next one's start.

        Returns:
            The step as recorded; or, having recorded no start, ``StepRefusal.CANCELLED``
            (cancellation was requested; ``ending`` is recorded) or
            ``StepRefusal.LEASE_LOST`` (the claim no longer holds the job: nothing was
            recorded; stop).
        """
        event = _step_event(seq, name, StepStatus.RUNNING)
        ended = _Ending.success(job_id, owner, attempt, ending) if ending else None

        def parameters() -> dict[str, Any]:
            return {
                "id": job_id,
                "seq": seq,
                "name": name,
                "now": self.clock(),
                "owner": owner,
                "attempt": attempt,
            }

        if self.database.dialect == "postgresql":
            # One statement (the statement lane when free: ``lane.py``).
            sql, values = _begin_step_pg({**parameters(), "event": event}, ended)
            return _began_pg(await self.database.write_statement(sql, values), ended)

        def work(tx: Transaction) -> StepRecord | StepRefusal:
            params = parameters()
            now = params["now"]
            if ended is not None and not ended.write(tx, now):
                return StepRefusal.LEASE_LOST
            row = tx.one(_BEGIN_STEP, params)
            if row is None:
                held = tx.scalar(_HELD, params)
                return StepRefusal.CANCELLED if held else StepRefusal.LEASE_LOST
            tx.execute(_INSERT_EVENT, (job_id, now, "step", event))
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
        ending = _Ending(job_id, owner, attempt, seq, name, output_json, error)
        if self.database.dialect == "postgresql":
            # One statement: the outcome, the recovery reset and the event.
            params = ending.pg_params(self.clock())
            return bool((await self.database.write_statement(_END_STEP_PG, params))[0][0])
        return await self.database.write(lambda tx: ending.write(tx, self.clock()))

    # -- retention -------------------------------------------------------------------------

    async def prune_terminal(self, *, keep: int) -> int:
        """Delete this node's oldest finished jobs beyond its newest ``keep``; never active
        ones, another node's, or one a fleet placement points to.

        Returns how many were deleted (their steps and events go with them).
        """
        return await self.database.write(lambda tx: _prune(tx, keep=keep, node=self.node))


class _Ending:
    """One step's outcome, as :meth:`JobStore.end_step` records it (also inside
    :meth:`JobStore.begin_step`'s transaction)."""

    __slots__ = ("event", "params", "reset")

    def __init__(
        self,
        job_id: str,
        owner: str,
        attempt: int,
        seq: int,
        name: str,
        output_json: str | None,
        error: ErrorInfo | None,
        *,
        reset: bool = True,
    ) -> None:
        status = StepStatus.FAILED if error else StepStatus.SUCCEEDED
        # A success resets the job's recovery count, unless the runner knows it is 0
        # (``EndedStep.reset_recoveries``).
        self.reset = reset and not error
        if error:
            data: dict[str, Any] = {"seq": seq, "name": name, "status": status.value}
            data["error"] = {"code": error.code, "message": error.message}
            self.event = _event_json(data)
        else:
            self.event = _step_event(seq, name, status)
        self.params: dict[str, Any] = {
            "status": status.value,
            "output": output_json,
            "code": error.code if error else None,
            "message": _bounded(error.message) if error else None,
            "id": job_id,
            "seq": seq,
            "owner": owner,
            "attempt": attempt,
        }

    def pg_params(self, now: int) -> dict[str, Any]:
        """The parameters of the end's clauses on PostgreSQL (``_ENDED_PG``)."""
        params = {key: value for key, value in self.params.items() if key != "seq"}
        return {
            **params,
            "now": now,
            "end_seq": self.params["seq"],
            "end_event": self.event,
            "reset": self.reset,
        }

    @classmethod
    def success(cls, job_id: str, owner: str, attempt: int, ended: EndedStep) -> _Ending:
        return cls(
            job_id,
            owner,
            attempt,
            ended.seq,
            ended.name,
            ended.output_json,
            None,
            reset=ended.reset_recoveries,
        )

    def write(self, tx: Transaction, now: int) -> bool:
        """Record it in ``tx`` on SQLite; whether the claim held (``False``: nothing was
        written). PostgreSQL records it in one statement (``_END_STEP_PG``, or with the next
        step's start)."""
        params = {**self.params, "now": now}
        if tx.execute(_END_STEP, params).rowcount != 1:
            return False
        if self.reset:
            tx.execute(_RESET_RECOVERIES, params)
        tx.execute(_INSERT_EVENT, (params["id"], now, "step", self.event))
        return True


# -- statements ------------------------------------------------------------------------------
# Fixed texts, so that each connection prepares them once (the driver's statement cache).

_JOB_BY_ID = "SELECT * FROM jobs WHERE id = :id"
_ACTIVE_BY_KEY = (
    "SELECT * FROM jobs WHERE idempotency_key = :key"  # noqa: S608 - fixed text
    f" AND status IN {_in(ACTIVE_JOB_STATUSES)} AND {_THIS_NODE}"
)
_STEPS_OF_JOB = "SELECT * FROM steps WHERE job_id = :id ORDER BY seq"
_EVENTS_AFTER = (
    "SELECT * FROM job_events WHERE job_id = :id AND seq > :after ORDER BY seq LIMIT :limit"
)
_INSERT_EVENT = "INSERT INTO job_events (job_id, at_ms, type, data_json) VALUES (?, ?, ?, ?)"
_CLAIM = (
    "UPDATE jobs SET status = 'running', lease_owner = :owner,"  # noqa: S608 - fixed text
    f" {_SET_LEASE}, attempt = attempt + 1,"
    " started_at_ms = COALESCE(started_at_ms, :now), updated_at_ms = :now"
    f" WHERE id = :id AND status = 'queued' AND {_THIS_NODE} RETURNING *"
)
_SUBMIT = (
    "INSERT INTO jobs (id, kind, workflow_version, subject, input_json,"
    " idempotency_key, status, trace_context, created_at_ms, updated_at_ms, node)"
    " VALUES (:id, :kind, :version, :subject, :input, :key, 'queued', :trace,"
    " :now, :now, :node) RETURNING *"
)
# PostgreSQL: a write and its event as one statement (data-modifying WITH clauses, which
# SQLite lacks): the same rows as the statement above followed by _INSERT_EVENT.
_QUEUED_EVENT = _event_json({"status": "queued"})
_RUNNING_EVENT = _event_json({"status": "running"})
_SUBMIT_PG = (
    f"WITH created AS ({_SUBMIT}),"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT id, :now, 'status', :event FROM created)"
    " SELECT * FROM created"
)
_CLAIM_PG = (
    f"WITH claimed AS ({_CLAIM}),"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT id, :now, 'status', :event FROM claimed)"
    " SELECT * FROM claimed"
)
# PostgreSQL, on the server's clock (``DatabaseLeaseTime``): the lease lock, the clock read
# under it and the claim in one statement (one round trip). ``locked`` is taken before
# ``clock`` reads (``clock`` reads from it), and held to the commit, as a separate
# ``database_ms()`` would hold it.
_CLAIM_ON_SERVER_CLOCK_PG = (
    "WITH locked AS MATERIALIZED (SELECT pg_advisory_xact_lock(:lock) AS held),"  # noqa: S608 - fixed text
    " clock AS MATERIALIZED (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    " AS ms FROM locked),"
    " claimed AS (UPDATE jobs SET status = 'running', lease_owner = :owner,"
    " lease_clock = :clock, lease_deadline_ms = (SELECT ms FROM clock) + :lease_ms,"
    " lease_ms = :lease_ms, lease_expires_at_ms = NULL, attempt = attempt + 1,"
    " started_at_ms = COALESCE(started_at_ms, :now), updated_at_ms = :now"
    f" WHERE id = :id AND status = 'queued' AND {_THIS_NODE} RETURNING *),"
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT id, :now, 'status', :event FROM claimed)"
    " SELECT claimed.*, (SELECT ms FROM clock) AS lease_now_ms"
    " FROM (SELECT 1) AS one LEFT JOIN claimed ON TRUE"
)
_HEARTBEAT = (
    f"UPDATE jobs SET {_SET_LEASE}, updated_at_ms = :now"  # noqa: S608 - fixed text
    f" WHERE id = :id AND {_FENCE}"
)
_ANY_LAPSED = f"SELECT 1 FROM jobs WHERE status = 'running' AND {_LAPSED} AND {_THIS_NODE} LIMIT 1"  # noqa: S608 - fixed text
_REQUEUE_LAPSED = (
    f"UPDATE jobs SET status = 'queued', {_NO_LEASE},"  # noqa: S608 - fixed text
    " recoveries = recoveries + 1, updated_at_ms = :now"
    f" WHERE status = 'running' AND {_LAPSED} AND {_MAY_RECOVER} AND {_THIS_NODE}"
    " RETURNING id, recoveries"
)
_SPENT_LAPSED = (
    "SELECT id FROM jobs WHERE status = 'running'"  # noqa: S608 - fixed text
    f" AND {_LAPSED} AND {_OUT_OF_RECOVERIES} AND {_THIS_NODE} ORDER BY created_at_ms, id"
)
_REQUEUE_FROM = (
    f"UPDATE jobs SET status = 'queued', {_NO_LEASE},"  # noqa: S608 - fixed text
    " recoveries = recoveries + 1, updated_at_ms = :now"
    " WHERE id = :id AND status = 'running' AND lease_owner = :owner"
    f" AND {_MAY_RECOVER} AND {_THIS_NODE} RETURNING recoveries"
)
# What a runner's finish may record: the table's moves out of running but the re-queue, which
# is recovery's (it counts the recovery and keeps the job's claim history).
_FINISHES = JOB_TRANSITIONS[JobStatus.RUNNING] - {JobStatus.QUEUED}
_FINISH = (
    "UPDATE jobs SET status = :status, output_json = :output,"  # noqa: S608 - fixed text
    f" error_code = :code, error_message = :message, {_NO_LEASE},"
    " updated_at_ms = :now, ended_at_ms = :ended"
    f" WHERE id = :id AND {_FENCE}"
    " RETURNING *"
)
_FINISH_PG = (
    f"WITH finished AS ({_FINISH}),"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT id, :now, 'status', :event FROM finished)"
    " SELECT * FROM finished"
)
_PROGRESS = (
    "UPDATE jobs SET progress_json = :progress, updated_at_ms = :now"  # noqa: S608 - fixed text
    f" WHERE id = :id AND {_FENCE}"
)


# The WHERE clause also keeps SQLite from reading ON CONFLICT as a join constraint.
def _begin_step_sql(condition: str = "") -> str:
    """A step's fenced start (insert, or count a re-run), ``condition`` added to its fence."""
    return (
        "INSERT INTO steps (job_id, seq, name, status, attempts, started_at_ms)"  # noqa: S608 - fixed text
        " SELECT id, :seq, :name, 'running', 1, :now FROM jobs"
        f" WHERE id = :id AND {_FENCE} AND cancel_requested = 0{condition}"
        " ON CONFLICT (job_id, seq) DO UPDATE SET status = 'running',"
        " attempts = steps.attempts + 1, error_code = NULL, error_message = NULL,"
        " ended_at_ms = NULL"
        " RETURNING *"
    )


_BEGIN_STEP = _begin_step_sql()
_HELD = f"SELECT 1 FROM jobs WHERE id = :id AND {_FENCE}"  # noqa: S608 - fixed text
_END_STEP = (
    "UPDATE steps SET status = :status, output_json = :output,"  # noqa: S608 - fixed text
    " error_code = :code, error_message = :message, ended_at_ms = :now"
    " WHERE job_id = :id AND seq = :seq AND status = 'running'"
    f" AND {_STEP_FENCE}"
)
# PostgreSQL runs a step's start, its end, and the end of one with the start of the next,
# as one statement each (data-modifying WITH clauses, which SQLite lacks): the same writes,
# fences and events as the texts above. The end's clauses (``:end_seq``), its event
# written by the statement holding them:
_ENDED_KEPT_PG = (
    "ended AS (UPDATE steps SET status = :status, output_json = :output,"  # noqa: S608 - fixed text
    " error_code = :code, error_message = :message, ended_at_ms = :now"
    " WHERE job_id = :id AND seq = :end_seq AND status = 'running'"
    f" AND {_STEP_FENCE} RETURNING job_id)"
)
# ... with the recovery count's reset (``_KEPT``: without it, for a run whose claim found the
# count at 0 or that reset it already -- nothing else changes it while the claim holds).
_ENDED_PG = (
    f"{_ENDED_KEPT_PG},"  # noqa: S608 - fixed text
    " reset AS (UPDATE jobs SET recoveries = 0"
    f" WHERE id = :id AND :reset AND {_FENCE} AND recoveries != 0"
    " AND EXISTS (SELECT 1 FROM ended))"
)
_BEGIN_STEP_PG = (
    f"WITH started AS ({_BEGIN_STEP}),"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT job_id, :now, 'step', :event FROM started)"
    f" SELECT started.*, EXISTS ({_HELD}) AS held"
    " FROM (SELECT 1) AS one LEFT JOIN started ON TRUE"
)
_END_STEP_PG = (
    f"WITH {_ENDED_PG},"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT job_id, :now, 'step', :end_event FROM ended)"
    " SELECT count(*) FROM ended"
)


def _end_and_begin_step_pg(ended: str) -> str:
    """One step's end (``ended``: its clauses) and the next one's start: the start only if
    the end was recorded, the end's event before the start's (one INSERT, in that order, so
    ``seq`` follows it)."""
    return (
        f"WITH {ended},"  # noqa: S608 - fixed text
        f" started AS ({_begin_step_sql(' AND EXISTS (SELECT 1 FROM ended)')}),"
        " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
        " SELECT job_id, :now, 'step', data FROM ("
        "SELECT 1 AS k, job_id, CAST(:end_event AS TEXT) AS data FROM ended"
        " UNION ALL SELECT 2, job_id, CAST(:event AS TEXT) FROM started) AS both_events"
        " ORDER BY k)"
        f" SELECT started.*, EXISTS ({_HELD}) AS held,"
        " (SELECT count(*) FROM ended) AS ended_count"
        " FROM (SELECT 1) AS one LEFT JOIN started ON TRUE"
    )


_END_AND_BEGIN_STEP_PG = _end_and_begin_step_pg(_ENDED_PG)
_END_AND_BEGIN_STEP_KEPT_PG = _end_and_begin_step_pg(_ENDED_KEPT_PG)
_RESET_RECOVERIES = (
    f"UPDATE jobs SET recoveries = 0 WHERE id = :id AND {_FENCE} AND recoveries != 0"  # noqa: S608 - fixed text
)
# Pruning keeps each node's own newest finished jobs (a busy node never deletes another's
# history from a shared journal), and never a job a placement still points to.
_TERMINALS_NEWEST_FIRST = (
    f"SELECT id FROM jobs WHERE status IN {_in(TERMINAL_JOB_STATUSES)}"  # noqa: S608 - fixed text
    " AND node = :node AND id NOT IN (SELECT job_id FROM fleet_placements)"
    " ORDER BY ended_at_ms DESC, created_at_ms DESC, id DESC"
)
_TERMINAL_BEYOND = f"{_TERMINALS_NEWEST_FIRST} LIMIT 1 OFFSET :keep"
# PostgreSQL: a finish, its event and the pruning in one statement. The statement reads the
# jobs as they were before it, when the finishing job was not yet finished: it keeps the
# newest ``:keep_others`` (``keep_finished - 1``) others, and the finishing job makes
# ``keep_finished``.
_FINISH_AND_PRUNE_PG = (
    f"WITH finished AS ({_FINISH}),"  # noqa: S608 - fixed text
    " announced AS (INSERT INTO job_events (job_id, at_ms, type, data_json)"
    " SELECT id, :now, 'status', :event FROM finished),"
    f" pruned AS (DELETE FROM jobs WHERE id IN ({_TERMINALS_NEWEST_FIRST} OFFSET :keep_others)"
    " AND EXISTS (SELECT 1 FROM finished))"
    " SELECT * FROM finished"
)
_PRUNE_TERMINAL = (
    f"DELETE FROM jobs WHERE status IN {_in(TERMINAL_JOB_STATUSES)} AND node = :node"  # noqa: S608 - fixed text
    " AND id NOT IN (SELECT job_id FROM fleet_placements)"
    f" AND id NOT IN ({_TERMINALS_NEWEST_FIRST} LIMIT :keep)"
)

# What every step and job runs, prepared on a PostgreSQL server (postgres.py).
prepare_on_server(
    _BEGIN_STEP_PG,
    _END_STEP_PG,
    _END_AND_BEGIN_STEP_PG,
    _END_AND_BEGIN_STEP_KEPT_PG,
    _FINISH_AND_PRUNE_PG,
    _SUBMIT_PG,
    _CLAIM_PG,
    _CLAIM_ON_SERVER_CLOCK_PG,
    _FINISH_PG,
    _TERMINAL_BEYOND,
    _HEARTBEAT,
    _PROGRESS,
    _INSERT_EVENT,
    _JOB_BY_ID,
    _STEPS_OF_JOB,
)


def _claim_on_server_clock(
    tx: Transaction,
    clock: DatabaseLeaseTime,
    *,
    owner: str,
    lease_ms: int,
    now: int,
    target: str,
    node: str,
) -> JobRecord | None:
    """:meth:`JobStore.claim` of ``target`` on PostgreSQL with the server's lease clock: one
    statement, sent with the COMMIT; the clock it read is remembered (``clock.observe``)."""
    params = _claim_params(owner=owner, lease_ms=lease_ms, now=now, target=target, node=node)
    [answer] = tx.last(_CLAIM_ON_SERVER_CLOCK_PG, params)
    clock.observe(int(answer["lease_now_ms"]))
    return None if answer["id"] is None else _job(answer)


def _claim_params(*, owner: str, lease_ms: int, now: int, target: str, node: str) -> dict[str, Any]:
    """The parameters of ``_CLAIM_ON_SERVER_CLOCK_PG``."""
    return {
        "lock": LEASE_LOCK_KEY,
        "owner": owner,
        "clock": DB_CLOCK,
        "lease_ms": lease_ms,
        "now": now,
        "id": target,
        "node": node,
        "event": _RUNNING_EVENT,
    }


def _begin_step_pg(params: dict[str, Any], ended: _Ending | None) -> tuple[str, dict[str, Any]]:
    """:meth:`JobStore.begin_step` on PostgreSQL: one statement, one round trip (the start,
    after the end of the step before it when there is one, their events and the fence's
    answer); the statement and its parameters."""
    if ended is None:
        return _BEGIN_STEP_PG, params
    statement = _END_AND_BEGIN_STEP_PG if ended.reset else _END_AND_BEGIN_STEP_KEPT_PG
    return statement, {**ended.pg_params(params["now"]), **params}


def _began_pg(rows: list[sqlite3.Row], ended: _Ending | None) -> StepRecord | StepRefusal:
    """What :func:`_begin_step_pg`'s statement answered, as :meth:`JobStore.begin_step`
    returns it."""
    answer = rows[0]
    if ended is not None and not answer["ended_count"]:
        return StepRefusal.LEASE_LOST  # nothing was written
    if answer["job_id"] is None:
        return StepRefusal.CANCELLED if answer["held"] else StepRefusal.LEASE_LOST
    return _step(answer)


def _prune(tx: Transaction, *, keep: int, node: str) -> int:
    # Nothing to delete (the common case) is found by a read, without writing.
    if tx.scalar(_TERMINAL_BEYOND, {"keep": keep, "node": node}) is None:
        return 0
    return int(tx.execute(_PRUNE_TERMINAL, {"keep": keep, "node": node}).rowcount)


def _event(tx: Transaction, job_id: str, kind: str, data: Mapping[str, Any], now: int) -> None:
    tx.execute(_INSERT_EVENT, (job_id, now, kind, _event_json(data)))


def _exhaust(
    tx: Transaction,
    job_id: str,
    *,
    cause: str,
    condition: str,
    params: Mapping[str, Any],
) -> sqlite3.Row | None:
    """Fail running ``job_id`` with ``recovery_exhausted`` if ``condition`` holds (one
    compare-and-set); its ``(kind, started_at_ms)`` row, or ``None`` when it did not."""
    now = params["now"]
    recoveries = tx.scalar("SELECT recoveries FROM jobs WHERE id = :id", {"id": job_id})
    last_step = tx.one(
        "SELECT * FROM steps WHERE job_id = :id ORDER BY seq DESC LIMIT 1", {"id": job_id}
    )
    message = _bounded(_exhausted_message(job_id, int(recoveries or 0), cause, last_step))
    row = tx.one(
        "UPDATE jobs SET status = 'failed', error_code = :code,"  # noqa: S608 - fixed text
        f" error_message = :message, {_NO_LEASE}, updated_at_ms = :now,"
        " ended_at_ms = :now"
        f" WHERE id = :job AND status = 'running' AND {condition}"
        " RETURNING kind, started_at_ms",
        {**params, "job": job_id, "code": RECOVERY_EXHAUSTED, "message": message},
    )
    if row is None:
        return None
    data: dict[str, Any] = {
        "status": "failed",
        "reason": RECOVERY_EXHAUSTED,
        "error": {"code": RECOVERY_EXHAUSTED, "message": message},
    }
    if last_step is not None:
        data["step"] = last_step["name"]
    _event(tx, job_id, "status", data, now)
    return row
