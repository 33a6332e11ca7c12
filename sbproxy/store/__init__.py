"""The job journal: the only package that touches the database (sqlite3, psycopg, sqlmodel).

``JobJournal`` is what the workflow engine needs of a journal; ``open_journal`` opens one.
:class:`Database` opens the SQLite file (WAL, ``synchronous=FULL``, one writer thread with
``BEGIN IMMEDIATE`` transactions and group commit, reader threads, migrations);
:class:`JobStore` is the SQLite repository of jobs, steps and events, returning frozen
records. :class:`JournalReader` reads jobs and steps through the stdlib ``sqlite3`` alone, for
the CLI's listings. A ``postgresql://`` location opens the same :class:`Database` and
:class:`JobStore` on PostgreSQL (``postgres.py``), for several hosts sharing one journal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbproxy._lazy_exports import lazy_exports
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
from sbproxy.store.location import (
    CONFIG_JOURNAL_URL,
    ENV_JOURNAL_URL,
    check_journal_url,
    journal_display,
    journal_location,
)
from sbproxy.store.outcomes import DURATION_BUCKETS_S, DurationHistogram, JobOutcomes
from sbproxy.store.readonly import JournalReader, ReaderDeclined
from sbproxy.store.records import (
    EndedStep,
    ErrorInfo,
    EventRecord,
    JobRecord,
    StepRecord,
    wall_clock_ms,
)

# The repositories and the database behind them (the write path: the writer thread,
# migrations, tenacity) load when first used, so a process that only reads records
# (``store.readonly``) never pays for them.
_LAZY = {
    "sbproxy.store.database": (
        "Database",
        "StoreError",
        "Synchronous",
        "Transaction",
        "journal_fault",
    ),
    "sbproxy.store.journal": ("JobJournal", "open_journal"),
    "sbproxy.store.node": ("journal_node_id",),
    "sbproxy.store.jobs": (
        "RECOVERY_EXHAUSTED",
        "JobStore",
        "Recovered",
        "StepRefusal",
        "SubmitOutcome",
    ),
    "sbproxy.store.runtime": ("CommittedRevision", "RuntimeStore"),
    "sbproxy.store.usage": ("HOUR_MS", "UsageDelta", "UsageStore", "UsageTotals"),
}
if TYPE_CHECKING:
    from sbproxy.store.database import (
        Database,
        StoreError,
        Synchronous,
        Transaction,
        journal_fault,
    )
    from sbproxy.store.jobs import (
        RECOVERY_EXHAUSTED,
        JobStore,
        Recovered,
        StepRefusal,
        SubmitOutcome,
    )
    from sbproxy.store.journal import JobJournal, open_journal
    from sbproxy.store.node import journal_node_id
    from sbproxy.store.runtime import CommittedRevision, RuntimeStore
    from sbproxy.store.usage import HOUR_MS, UsageDelta, UsageStore, UsageTotals
else:
    __getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "ACTIVE_JOB_STATUSES",
    "CONFIG_JOURNAL_URL",
    "DURATION_BUCKETS_S",
    "ENV_JOURNAL_URL",
    "HOUR_MS",
    "JOB_TRANSITIONS",
    "RECOVERY_EXHAUSTED",
    "TERMINAL_JOB_STATUSES",
    "UNKNOWN_BOOT",
    "CommittedRevision",
    "Database",
    "DurationHistogram",
    "EndedStep",
    "ErrorInfo",
    "EventRecord",
    "JobJournal",
    "JobOutcomes",
    "JobRecord",
    "JobStatus",
    "JobStore",
    "JournalReader",
    "LeaseClock",
    "LeaseStamp",
    "LeaseTime",
    "ReaderDeclined",
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
    "check_journal_url",
    "journal_display",
    "journal_fault",
    "journal_location",
    "journal_node_id",
    "open_journal",
    "system_lease_time",
    "wall_clock_ms",
]
