"""What the workflow engine needs of a job journal: the interface a backend implements.

:class:`~sbproxy.store.JobStore` implements it over a :class:`~sbproxy.store.Database`:
SQLite (one writer thread, group commit, ``BEGIN IMMEDIATE``), or PostgreSQL through the
same threads and statements (``postgres.py``: psycopg 3, ``SKIP LOCKED`` claims, leases on
the server's clock). ``sbproxy.workflows`` depends on this protocol only. What any backend
must keep (``docs/durable-jobs.md``):

* **One transaction per method**, and a returned write durable before the method returns
  (SQLite: ``synchronous=FULL``; PostgreSQL: ``synchronous_commit=on``).
* **Compare-and-set transitions** checked by row count, never read-then-write.
* **Fencing in the writing statement**: ``begin_step``, ``end_step``, ``report_progress``,
  ``heartbeat`` and ``finish`` change the journal only while the caller's claim (lease owner
  *and* attempt) still holds the job, checked by the statement that writes.
* **Claims** move one queued job to running and bump ``attempt``; several workers claim
  concurrently without taking one job twice (SQLite serialises writers; PostgreSQL picks
  the oldest queued row with ``FOR UPDATE SKIP LOCKED``). A job is claimed and recovered
  only by the node that recorded it (``node.py``).
* **Leases on the store's lease clock**: the store stamps them (inside the write) from
  :attr:`JobJournal.lease_clock` and judges lapses by it; the engine reads that clock only to
  show how stale a job is. SQLite: this boot's monotonic clock (``leaseclock.py``, one
  machine). PostgreSQL: the server's ``clock_timestamp()``, read under an advisory lock,
  one clock for every host; a dead owner on another machine is never concluded from its
  owner id there, since recovery only touches this node's jobs.
* **Events** get a durable, strictly increasing ``seq``; idempotency keys are unique among
  unfinished jobs (a partial unique index).
* **Errors**: a driver error leaves as :class:`~sbproxy.store.StoreError` (``disk_full`` or
  ``store_failed``), never as the driver's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sbproxy.store.database import Database, Synchronous
from sbproxy.store.jobs import (
    EndedStep,
    ErrorInfo,
    EventRecord,
    JobRecord,
    JobStore,
    Recovered,
    StepRecord,
    StepRefusal,
    SubmitOutcome,
)
from sbproxy.store.leaseclock import LeaseClock
from sbproxy.store.lifecycle import JobStatus
from sbproxy.store.location import check_journal_url
from sbproxy.store.outcomes import JobOutcomes, WriteTallies

__all__ = ["JobJournal", "open_journal"]


class JobJournal(Protocol):
    """Jobs, their step journal and their events, as the engine uses them.

    The methods' contracts are those of :class:`~sbproxy.store.JobStore`, which documents
    each one (arguments, returns, errors).

    Attributes:
        clock: "Now" in epoch milliseconds, for the timestamps people read.
        lease_clock: The clock leases are stamped on and judged by.
        outcomes: Tallies of the jobs this process finished (metrics).
        node: The node whose jobs this journal claims, recovers and joins (``node.py``).
        write_tallies: How this process's journal writes waited, committed and grouped
            (metrics).
    """

    clock: Callable[[], int]
    lease_clock: LeaseClock
    outcomes: JobOutcomes
    node: str

    @property
    def write_tallies(self) -> WriteTallies:
        """How this process's journal writes waited, committed and grouped (metrics)."""
        ...

    async def close(self) -> None:
        """Release the backend's connections; the journal is unusable afterwards."""
        ...

    # -- reads -----------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRecord | None: ...

    async def find_active(self, idempotency_key: str) -> JobRecord | None: ...

    async def list_jobs(
        self,
        *,
        statuses: Sequence[JobStatus] = (),
        kind: str | None = None,
        subject: str | None = None,
        limit: int = 100,
        node: str | None = None,
    ) -> list[JobRecord]: ...

    async def steps(self, job_id: str) -> list[StepRecord]: ...

    async def events(
        self, job_id: str, *, after_seq: int = 0, limit: int = 500
    ) -> list[EventRecord]: ...

    async def last_event_seq(self, job_id: str) -> int: ...

    async def cancel_requested(self, job_id: str) -> bool: ...

    # -- submission, leases and outcomes ---------------------------------------------------

    async def submit(
        self,
        *,
        kind: str,
        workflow_version: int,
        input_json: str,
        idempotency_key: str | None = None,
        subject: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> SubmitOutcome: ...

    async def claim(
        self, *, owner: str, lease_ms: int, job_id: str | None = None, kinds: Sequence[str] = ()
    ) -> JobRecord | None: ...

    async def heartbeat(self, job_id: str, *, owner: str, attempt: int, lease_ms: int) -> bool: ...

    async def recover_lapsed(self, *, max_recoveries: int | None) -> Recovered: ...

    async def recover_from(
        self, job_id: str, *, owner: str, reason: str, max_recoveries: int | None
    ) -> JobStatus | None: ...

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
    ) -> JobRecord | None: ...

    async def request_cancel(self, job_id: str) -> JobRecord | None: ...

    async def retry(self, job_id: str) -> JobRecord | None: ...

    async def prune_terminal(self, *, keep: int) -> int: ...

    # -- a runner's writes (fenced) --------------------------------------------------------

    async def begin_step(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        seq: int,
        name: str,
        ending: EndedStep | None = None,
    ) -> StepRecord | StepRefusal: ...

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
    ) -> bool: ...

    async def report_progress(
        self,
        job_id: str,
        *,
        owner: str,
        attempt: int,
        progress: Mapping[str, Any],
        event: bool,
    ) -> bool: ...

    async def record_event(self, job_id: str, *, kind: str, data: Mapping[str, Any]) -> None: ...

    async def detach_key(self, job_id: str) -> None: ...


async def open_journal(
    path: Path | str, *, synchronous: Synchronous = "FULL", node: str | None = None
) -> JobStore:
    """Open the journal at ``path`` (creating it and migrating its schema).

    Args:
        path: The SQLite journal file (``<cache root>/jobs/journal.db``), or a
            ``postgresql://`` URL (``proxy.model_host.journal.url``): the same store over
            PostgreSQL (``postgres.py``).
        synchronous: ``FULL`` (every commit durable on power loss) or ``NORMAL`` (for
            benchmarks).
        node: The node this process's jobs record (:func:`~sbproxy.store.node.
            journal_node_id`); ``None``: :func:`~sbproxy.store.node.node_id`.

    Raises:
        StoreError: as :meth:`Database.open` (``store_failed``, ``disk_full``,
            ``invalid_cache_dir``, ``store_version_mismatch``; on PostgreSQL
            ``journal_unavailable`` and ``journal_schema_newer``).
        SbproxyError: ``invalid_journal_url`` when ``path`` is a URL that names no
            PostgreSQL server (``location.check_journal_url``): a caller that passes a URL
            without :func:`~sbproxy.store.location.journal_location` gets the same check.
    """
    if isinstance(path, str) and "://" in path:
        path = check_journal_url(path, source="the journal URL")
    return JobStore(await Database.open(path, synchronous=synchronous), node=node)
