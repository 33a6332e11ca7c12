"""Errors of the workflow engine (reason codes in parentheses)."""

from __future__ import annotations

from sbproxy.errors import SbproxyError

__all__ = [
    "JobCancelled",
    "JobNotFound",
    "LeaseLost",
    "NondeterminismError",
    "StepFailed",
    "WorkflowError",
]


class WorkflowError(SbproxyError):
    """Base of the engine's own errors (``workflow_error``)."""

    default_code = "workflow_error"


class NondeterminismError(WorkflowError):
    """The journal no longer matches the workflow code (``nondeterminism``); the job is
    parked instead of being re-run with different steps."""

    default_code = "nondeterminism"


class JobCancelled(WorkflowError):
    """Cancellation was requested and observed (``cancelled``)."""

    default_code = "cancelled"


class LeaseLost(WorkflowError):
    """Another worker took the job over (``lease_lost``); this worker stops writing."""

    default_code = "lease_lost"
    default_retryable = True


class JobNotFound(WorkflowError):
    """No job has this id (``job_not_found``)."""

    default_code = "job_not_found"


class StepFailed(WorkflowError):
    """A step failed permanently or ran out of retries; carries the step error's code."""
