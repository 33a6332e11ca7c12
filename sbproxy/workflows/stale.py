"""Stale jobs: ``running`` in the journal, but nobody is running them any more.

A job is stale when its runner can no longer finish it: the lease lapsed on the lease clock
(the runner stopped renewing it, or renewed it on another boot), or the owner process is
certainly gone (``owner_is_gone``: same boot, pid dead or reused). Nothing resumes such a job
by itself until some process recovers it (a server's worker loop, or the next CLI verb of its
kind, see ``WorkflowEngine.resume_stale``); until then people should see it for what it is.

This module only judges; it writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sbproxy.store import JobRecord, JobStatus, LeaseTime, StepRecord
from sbproxy.workflows.identity import owner_is_gone

__all__ = ["StaleReason", "Staleness", "stale_reason", "staleness"]

StaleReason = Literal["owner_gone", "lease_expired"]
"""``owner_gone``: the owner process is dead; ``lease_expired``: its lease lapsed (the same
words as the re-queue events recovery writes)."""


@dataclass(frozen=True)
class Staleness:
    """Why a running job is stale, for people (``jobs list``, ``jobs show``, ``jobs watch``).

    Attributes:
        reason: ``owner_gone`` or ``lease_expired``.
        owner: The lease owner that stopped (``<boot id>/<pid>/<start ticks>/<nonce>``).
        age_ms: How long the job has shown no sign of life, in ms: since the owner last
            renewed its lease on the lease clock when this clock can measure it, else since
            the job's last update on the wall clock (display only; it decides nothing).
        last_step: The highest journaled step (the one it was in, or the last it finished),
            ``None`` when it died before its first step.
    """

    reason: StaleReason
    owner: str | None
    age_ms: int
    last_step: StepRecord | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view: ``{"reason", "owner", "age_ms", "last_step"}``, ``last_step``
        being ``{"seq", "name", "status", "attempts"}`` or ``None``."""
        step = self.last_step
        return {
            "reason": self.reason,
            "owner": self.owner,
            "age_ms": self.age_ms,
            "last_step": {
                "seq": step.seq,
                "name": step.name,
                "status": step.status.value,
                "attempts": step.attempts,
            }
            if step is not None
            else None,
        }


def stale_reason(job: JobRecord, *, lease_now: LeaseTime) -> StaleReason | None:
    """Why ``job`` is stale at ``lease_now``, or ``None`` when it is not (not running, or
    running under a live lease of an owner that may be alive)."""
    if job.status != JobStatus.RUNNING:
        return None
    if job.lease_owner is not None and owner_is_gone(job.lease_owner):
        return "owner_gone"
    if job.lease is None or job.lease.lapsed(lease_now):
        return "lease_expired"
    return None


def staleness(
    job: JobRecord, steps: Sequence[StepRecord], *, lease_now: LeaseTime, now_ms: int
) -> Staleness | None:
    """Judge ``job`` (with its journal ``steps``) at ``lease_now``.

    Args:
        job: The job, read before ``lease_now``.
        steps: Its journal, in step order.
        lease_now: Lease-clock now.
        now_ms: Wall-clock now (epoch ms), for the age when the lease clock cannot measure it.

    Returns:
        ``None`` when the job is not stale.
    """
    reason = stale_reason(job, lease_now=lease_now)
    if reason is None:
        return None
    lease = job.lease
    measurable = lease is not None and lease.remaining_ms(lease_now) is not None
    if lease is not None and measurable:
        age_ms = lease_now.ms - (lease.deadline_ms - lease.duration_ms)
    else:
        age_ms = now_ms - job.updated_at_ms
    return Staleness(
        reason=reason,
        owner=job.lease_owner,
        age_ms=max(0, age_ms),
        last_step=steps[-1] if steps else None,
    )
