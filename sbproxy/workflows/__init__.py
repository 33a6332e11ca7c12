"""The generic durable-workflow engine: workflows of journaled steps, replay, leases,
recovery, retries, cancellation, events and fault points.

It knows nothing of models, HTTP or processes (ARCHITECTURE.md, "The durable engine").

Typical use::

    registry = Registry()

    @step("fetch", retry=RetryPolicy(max_attempts=5))
    async def fetch(ctx: StepContext, arg: FetchInput) -> FetchOutput: ...

    @registry.workflow("pull", version=1)
    async def pull(ctx: WorkflowContext, req: PullInput) -> PullOutput:
        fetched = await ctx.step(fetch, FetchInput(...))
        ...

    engine = await WorkflowEngine.open(cache_root / "jobs" / "journal.db", registry)
    submitted = await engine.submit(pull, PullInput(...), idempotency_key=digest)
    job = await engine.join(submitted.job.id)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbproxy._lazy_exports import lazy_exports
from sbproxy.workflows.errors import (
    JobCancelled,
    JobNotFound,
    LeaseLost,
    NondeterminismError,
    StepFailed,
    WorkflowError,
)
from sbproxy.workflows.faults import arm, disarm_all, fault_point
from sbproxy.workflows.identity import WorkerIdentity, owner_is_gone, process_start_ticks
from sbproxy.workflows.stale import Staleness, StaleReason, stale_reason, staleness

# The engine and what runs steps import the journal's database layer, pydantic, anyio and
# OpenTelemetry: they load when first used, so judging a job's staleness (``jobs list``) or
# arming a fault point costs none of them.
_LAZY = {
    "sbproxy.workflows.context": ("StepContext", "WorkflowContext"),
    "sbproxy.workflows.declare": ("Registry", "RetryPolicy", "StepDef", "WorkflowDef", "step"),
    "sbproxy.workflows.engine": ("DEFAULT_MAX_RECOVERIES", "WorkflowEngine"),
    "sbproxy.workflows.executor": ("LeaseSettings",),
}
if TYPE_CHECKING:
    from sbproxy.workflows.context import StepContext, WorkflowContext
    from sbproxy.workflows.declare import Registry, RetryPolicy, StepDef, WorkflowDef, step
    from sbproxy.workflows.engine import DEFAULT_MAX_RECOVERIES, WorkflowEngine
    from sbproxy.workflows.executor import LeaseSettings
else:
    __getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "DEFAULT_MAX_RECOVERIES",
    "JobCancelled",
    "JobNotFound",
    "LeaseLost",
    "LeaseSettings",
    "NondeterminismError",
    "Registry",
    "RetryPolicy",
    "StaleReason",
    "Staleness",
    "StepContext",
    "StepDef",
    "StepFailed",
    "WorkerIdentity",
    "WorkflowContext",
    "WorkflowDef",
    "WorkflowEngine",
    "WorkflowError",
    "arm",
    "disarm_all",
    "fault_point",
    "owner_is_gone",
    "process_start_ticks",
    "stale_reason",
    "staleness",
    "step",
]
