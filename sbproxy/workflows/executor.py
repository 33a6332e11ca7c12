"""Run one claimed job: heartbeat its lease, replay its journal, record its outcome.

Every journal write of a run is fenced on its claim (lease owner and attempt, see
``sbproxy.store.jobs``). The first write that changes nothing -- the heartbeat, a step's
start, progress or end, the outcome -- means recovery gave the job to another run: this run
raises (or notes) :class:`LeaseLost`, stops, and writes nothing more.

A journal that cannot record -- its server away, its disk full (``journal_fault``) -- is
never the job's outcome: the run stops where it met it and :func:`execute` raises that
error, writing nothing; the job stays ``running`` under this claim, for the engine to resume
once the journal answers (or for recovery, once the lease lapses). A heartbeat that meets it
is skipped: the lease may still hold when the journal is back, and the next fenced write
tells.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
from opentelemetry import trace
from pydantic import ValidationError

from sbproxy.errors import SbproxyError
from sbproxy.store import ErrorInfo, JobJournal, JobRecord, JobStatus
from sbproxy.telemetry import (
    ATTR_JOB_ATTEMPT,
    ATTR_JOB_ID,
    ATTR_JOB_KIND,
    link_from_carrier,
    tracer,
)
from sbproxy.workflows.context import WorkflowContext, _JobState, journal_fault_in
from sbproxy.workflows.declare import Registry, WorkflowDef
from sbproxy.workflows.errors import JobCancelled, LeaseLost, NondeterminismError, StepFailed

__all__ = ["LeaseSettings", "execute"]

logger = logging.getLogger(__name__)


class LeaseSettings:
    """Lease duration and heartbeat period, in seconds.

    The heartbeat runs three times per lease so that one slow commit never loses a lease.
    """

    def __init__(self, *, lease_s: float = 15.0, heartbeat_s: float | None = None) -> None:
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else lease_s / 3

    @property
    def lease_ms(self) -> int:
        """Lease duration in milliseconds."""
        return int(self.lease_s * 1000)


async def _heartbeat(
    store: JobJournal, state: _JobState, lease: LeaseSettings, scope: anyio.CancelScope
) -> None:
    while True:
        await anyio.sleep(lease.heartbeat_s)
        try:
            alive = await store.heartbeat(
                state.job.id, owner=state.owner, attempt=state.attempt, lease_ms=lease.lease_ms
            )
            if alive and not state.cancel_requested:
                state.cancel_requested = await store.cancel_requested(state.job.id)
        except SbproxyError as exc:
            if journal_fault_in(exc) is None:
                raise
            logger.warning(
                "job %s: heartbeat skipped, the journal cannot record it: %s [%s]",
                state.job.id,
                exc,
                exc.code,
            )
            continue
        if not alive:
            state.lose_lease("heartbeat")
            scope.cancel()
            return


async def execute(
    job: JobRecord,
    *,
    store: JobJournal,
    registry: Registry,
    owner: str,
    lease: LeaseSettings,
    resources: Sequence[object] = (),
    keep_finished: int | None = None,
    first_run_of_first_claim: bool = False,
) -> JobRecord:
    """Run ``job`` (already claimed by ``owner``) to an outcome and record it.

    Args:
        job: The claimed job.
        store: The journal.
        registry: The workflows this process can run.
        owner: The claim's lease owner.
        lease: Lease length and heartbeat period.
        resources: Objects steps may ask for.
        keep_finished: When this run ends the job, finished jobs to keep (the oldest beyond
            are pruned with the outcome, in its transaction); ``None`` prunes nothing.
        first_run_of_first_claim: ``job`` is what the job's first claim returned
            (``attempt`` 1) and no run of that claim ran before this one: its journal is
            empty, so it is not read (one round trip less per job). Every step is written
            fenced on the claim's attempt, and a claim only ever raises ``attempt``, so no
            step can be journaled before the first claim's first run.

    Returns:
        The job as stored afterwards. If the lease was lost to recovery the record shows
        the new owner's view; this run wrote nothing after losing it.

    Raises:
        SbproxyError: the journal's own failure (``journal_unavailable``, ``disk_full``,
            ``store_failed``), met by a step, the workflow or the outcome's write: nothing of
            it is recorded and the job stays ``running`` under this claim (module docstring).
    """
    link = link_from_carrier(job.trace_context)
    with tracer().start_as_current_span(
        f"job {job.kind}",
        links=[link] if link else None,
        attributes={ATTR_JOB_ID: job.id, ATTR_JOB_KIND: job.kind, ATTR_JOB_ATTEMPT: job.attempt},
    ) as span:
        status, output, error = await _run(
            job,
            store=store,
            registry=registry,
            owner=owner,
            lease=lease,
            resources=resources,
            journaled=not (first_run_of_first_claim and job.attempt == 1),
        )
        if status is not None:
            if error is not None:
                span.set_status(trace.StatusCode.ERROR, error.code)
            finished = await store.finish(
                job.id,
                owner=owner,
                attempt=job.attempt,
                status=status,
                output_json=output,
                error=error,
                keep_finished=keep_finished,
            )
            if finished is not None:
                return finished
            logger.warning(
                "job %s: outcome %s of attempt %d was fenced off: another run holds the job now",
                job.id,
                status.value,
                job.attempt,
            )
    final = await store.get(job.id)
    assert final is not None  # noqa: S101 - jobs are never deleted while running
    return final


async def _run(
    job: JobRecord,
    *,
    store: JobJournal,
    registry: Registry,
    owner: str,
    lease: LeaseSettings,
    resources: Sequence[object],
    journaled: bool,
) -> tuple[JobStatus | None, str | None, ErrorInfo | None]:
    """The run's outcome (``journaled``: the job may have steps recorded; read them)."""
    definition = registry.get(job.kind)
    if definition is None:
        return JobStatus.FAILED, None, ErrorInfo("unknown_workflow", f"no workflow {job.kind!r}")
    if definition.version != job.workflow_version:
        return (
            JobStatus.PARKED,
            None,
            ErrorInfo(
                "nondeterminism",
                f"job was journaled by {job.kind} v{job.workflow_version}; this worker runs "
                f"v{definition.version}. Finish it with the matching version or cancel it.",
            ),
        )
    try:
        arg = definition.input_type.model_validate(job.input)
    except ValidationError as exc:
        return JobStatus.FAILED, None, ErrorInfo("invalid_input", str(exc))
    journal = {record.seq: record for record in await store.steps(job.id)} if journaled else {}
    state = _JobState(job, owner, resources)
    context = WorkflowContext(store=store, state=state, journal=journal)
    result: Any = None
    outcome: tuple[JobStatus | None, str | None, ErrorInfo | None] = (None, None, None)
    fault: SbproxyError | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(_heartbeat, store, state, lease, group.cancel_scope)
        try:
            result = await _body(definition, context, arg)
            if context.journal_tail() > context.steps_run:
                raise NondeterminismError(
                    f"job {job.id} journaled {context.journal_tail()} steps but the workflow "
                    f"now finishes after {context.steps_run}"
                )
            outcome = (JobStatus.SUCCEEDED, definition.result.dump_json(result).decode(), None)
        except LeaseLost:
            outcome = (None, None, None)
        except Exception as exc:  # noqa: BLE001 - each is an outcome (_failure logs a crash)
            fault = journal_fault_in(exc)
            if fault is None:
                outcome = _failure(job, exc)
        finally:
            group.cancel_scope.cancel()
    if state.lease_lost:
        return None, None, None
    if fault is not None:
        logger.warning(
            "job %s (%s): the journal cannot record this run: %s [%s]; the job keeps its "
            "claim and resumes from its last recorded step",
            job.id,
            job.kind,
            fault,
            fault.code,
        )
        raise fault
    return outcome


async def _body(definition: WorkflowDef[Any, Any], context: WorkflowContext, arg: Any) -> Any:
    """The workflow body's result, the last step's result journaled first -- also when the
    body then raised (its error is the outcome, the completed step stays completed)."""
    try:
        result = await definition.fn(context, arg)
    except LeaseLost:
        raise
    except Exception as exc:
        if journal_fault_in(exc) is None:
            await context.settle()
        raise
    await context.settle()
    return result


def _failure(job: JobRecord, exc: Exception) -> tuple[JobStatus, str | None, ErrorInfo]:
    """The outcome of a workflow body that raised ``exc`` (not the journal's fault)."""
    if isinstance(exc, NondeterminismError):
        return JobStatus.PARKED, None, ErrorInfo(exc.code, str(exc))
    if isinstance(exc, JobCancelled):
        return JobStatus.CANCELLED, None, ErrorInfo(exc.code, exc.message)
    if isinstance(exc, StepFailed):
        return JobStatus.FAILED, None, ErrorInfo(exc.code, exc.message)
    if isinstance(exc, SbproxyError):
        return JobStatus.FAILED, None, ErrorInfo(exc.code, str(exc))
    logger.error("job %s: workflow %s crashed", job.id, job.kind, exc_info=exc)
    return JobStatus.FAILED, None, ErrorInfo("internal", f"{type(exc).__name__}: {exc}")
