"""The job journal: the only package that touches the database (sqlite3, sqlmodel).

:class:`JobJournal` is what the workflow engine needs of a journal; :func:`open_journal`
opens one. :class:`Database` opens the SQLite file (WAL, ``synchronous=FULL``, one writer
thread with ``BEGIN IMMEDIATE`` transactions and group commit, reader threads,
migrations); :class:`JobStore` is the SQLite repository of jobs, steps and events, returning
frozen records.
"""

from __future__ import annotations

from sbproxy.store.database import Database, StoreError, Synchronous, Transaction
from sbproxy.store.jobs import (
    RECOVERY_EXHAUSTED,
    ErrorInfo,
    EventRecord,
    JobRecord,
    JobStore,
    Recovered,
    StepRecord,
    StepRefusal,
    SubmitOutcome,
    wall_clock_ms,
)
from sbproxy.store.journal import JobJournal, open_journal
from sbproxy.store.leaseclock import (
    UNKNOWN_BOOT,
    LeaseClock,
    LeaseStamp,
    LeaseTime,
    boot_id,
    system_lease_time,
)
from sbproxy.store.lifecycle import (
    ACTIVE_JOB_STATUSES,
    JOB_TRANSITIONS,
    TERMINAL_JOB_STATUSES,
    JobStatus,
    StepStatus,
)
from sbproxy.store.outcomes import DURATION_BUCKETS_S, DurationHistogram, JobOutcomes
from sbproxy.store.runtime import CommittedRevision, RuntimeStore
from sbproxy.store.usage import HOUR_MS, UsageDelta, UsageStore, UsageTotals

__all__ = [
    "ACTIVE_JOB_STATUSES",
    "DURATION_BUCKETS_S",
    "HOUR_MS",
    "JOB_TRANSITIONS",
    "RECOVERY_EXHAUSTED",
    "TERMINAL_JOB_STATUSES",
    "UNKNOWN_BOOT",
    "CommittedRevision",
    "Database",
    "DurationHistogram",
    "ErrorInfo",
    "EventRecord",
    "JobJournal",
    "JobOutcomes",
    "JobRecord",
    "JobStatus",
    "JobStore",
    "LeaseClock",
    "LeaseStamp",
    "LeaseTime",
    "Recovered",
    "RuntimeStore",
    "StepRecord",
    "StepRefusal",
    "StepStatus",
    "StoreError",
    "SubmitOutcome",
    "Synchronous",
    "Transaction",
    "UsageDelta",
    "UsageStore",
    "UsageTotals",
    "boot_id",
    "open_journal",
    "system_lease_time",
    "wall_clock_ms",
]
