"""Job and step lifecycles as data: states, allowed transitions and terminal sets.

Every persisted transition is a single compare-and-set ``UPDATE ... WHERE id = ? AND status
IN (...)`` whose row count says whether it happened; nothing reads a status and then writes.
``tests/store/test_job_transitions.py`` holds :data:`JOB_TRANSITIONS` equal to those fences:
it applies every store operation to a job in every status and reads back what changed.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "ACTIVE_JOB_STATUSES",
    "JOB_TRANSITIONS",
    "TERMINAL_JOB_STATUSES",
    "JobStatus",
    "StepStatus",
]


class JobStatus(StrEnum):
    """Where a job is in its life.

    ``parked`` is a job stopped by a nondeterminism error (its recorded steps no longer match
    the workflow code): it keeps its idempotency key and its journal, and waits for an
    operator's ``jobs retry`` or ``jobs cancel``.
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PARKED = "parked"


class StepStatus(StrEnum):
    """A journal row: running (started, outcome not recorded), succeeded or failed."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# status -> statuses it may move to.
JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
            JobStatus.PARKED,
            JobStatus.QUEUED,  # lease expired or owner died: recovery re-queues it
        }
    ),
    JobStatus.PARKED: frozenset({JobStatus.QUEUED, JobStatus.CANCELLED}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED}),  # an operator's retry
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}

TERMINAL_JOB_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
# Unfinished jobs: they hold their idempotency key and are never pruned.
ACTIVE_JOB_STATUSES = frozenset({JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.PARKED})
