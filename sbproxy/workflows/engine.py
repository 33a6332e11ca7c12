"""The workflow engine: submit jobs, run them (inline or in a worker loop), recover them.

One :class:`WorkflowEngine` per process and journal. Jobs are submitted, then joined
(:meth:`join`); only a worker runs them: the server's worker loop (:meth:`run_worker`), or,
in a process without one for the job's kind (a CLI process, the runtime's ordered command
lanes), the process's own worker, which holds the lease itself. After a
crash, either of them finds the job again (``running`` under a dead owner, or with a lapsed
lease), returns it to the queue and finishes it from its last completed step.

Recovery is bounded: a job taken from a dead or lapsed runner ``max_recoveries`` times in a
row without completing a step (one that crashes its process every time it runs) is not
re-queued again but ends ``failed`` with ``recovery_exhausted``; ``retry`` revives it.

A journal that cannot record (its PostgreSQL server away, its disk full: ``journal_fault``)
stops a run without an outcome (``executor.py``). A serving host's engine
(``wait_out_journal_faults``) then waits for the journal with jittered backoff (tenacity),
takes its claim up again (a fenced heartbeat) and resumes the job under the same id from its
last recorded step; its worker loop and its joins wait through the outage too. Any other
engine (a CLI process) raises the error at once: its job stays resumable.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_never,
    wait_random_exponential,
)

from sbproxy.errors import SbproxyError
from sbproxy.store import (
    EventRecord,
    JobJournal,
    JobRecord,
    JobStatus,
    StepRecord,
    SubmitOutcome,
    Synchronous,
    open_journal,
)
from sbproxy.telemetry import current_carrier
from sbproxy.workflows.context import journal_fault_in
from sbproxy.workflows.declare import Registry, WorkflowDef
from sbproxy.workflows.errors import JobNotFound, WorkflowError
from sbproxy.workflows.executor import LeaseSettings, execute
from sbproxy.workflows.identity import WorkerIdentity, owner_is_gone
from sbproxy.workflows.stale import Staleness, stale_reason
from sbproxy.workflows.stale import staleness as judge_staleness

__all__ = ["DEFAULT_MAX_RECOVERIES", "WorkflowEngine"]


def _found(job: JobRecord | None, job_id: str) -> JobRecord:
    if job is None:
        raise JobNotFound(f"no job {job_id}", details={"job_id": job_id})
    return job


logger = logging.getLogger(__name__)
T = TypeVar("T")

# Finished jobs kept for inspection; active jobs are never pruned. The reference keeps 256.
DEFAULT_HISTORY_LIMIT = 256
# Recoveries in a row without a completed step before a job fails ``recovery_exhausted``: a
# crash that a rerun survives (a killed process, a reboot) needs one; three in a row that die
# before finishing a single step point at the job, not at bad luck.
DEFAULT_MAX_RECOVERIES = 3
# Waiting out a journal that cannot record: jittered exponential backoff from a quarter
# second, at most this long between tries (each try: one heartbeat or one read).
OUTAGE_WAIT_MAX_S = 5.0


def _journal_fault(exc: BaseException) -> bool:
    return journal_fault_in(exc) is not None


def _log_outage(state: RetryCallState) -> None:
    failure = state.outcome.exception() if state.outcome is not None else None
    fault = journal_fault_in(failure) if failure is not None else None
    logger.warning(
        "the journal cannot be used (%s); trying again in %.1f s",
        f"{fault} [{fault.code}]" if fault is not None else failure,
        state.upcoming_sleep,
    )


def _outlasting() -> AsyncRetrying:
    """Tries of one journal operation until the journal answers (no bound; a fault is
    logged before each wait, anything else is raised at once)."""
    return AsyncRetrying(
        retry=retry_if_exception(_journal_fault),
        wait=wait_random_exponential(multiplier=0.25, max=OUTAGE_WAIT_MAX_S),
        stop=stop_never,
        before_sleep=_log_outage,
        reraise=True,
    )


class WorkflowEngine:
    """Submit, run, watch, cancel and retry jobs of the workflows in ``registry``.

    Args:
        store: The job repository.
        registry: Workflow kinds this process can run.
        lease: Lease duration and heartbeat period.
        history_limit: Finished jobs to keep (oldest pruned first; active jobs never).
        resources: Objects steps may ask for with ``ctx.resource(Type)`` (a cache, ...).
        max_recoveries: How many times in a row recovery may take a job from a dead or
            lapsed runner without a step completing in between; the next time it ends
            ``failed`` with ``recovery_exhausted``. ``None``: no bound.
        wait_out_journal_faults: Whether a journal that cannot record is waited out (a
            serving host: runs resume, joins and the worker loop wait) instead of raised
            (module docstring).

    Raises:
        ValueError: ``max_recoveries`` is negative.
    """

    def __init__(
        self,
        store: JobJournal,
        registry: Registry,
        *,
        lease: LeaseSettings | None = None,
        history_limit: int = DEFAULT_HISTORY_LIMIT,
        resources: Sequence[object] = (),
        max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
        wait_out_journal_faults: bool = False,
    ) -> None:
        if max_recoveries is not None and max_recoveries < 0:
            raise ValueError(f"max_recoveries must be at least 0, not {max_recoveries}")
        self.max_recoveries = max_recoveries
        self.wait_out_journal_faults = wait_out_journal_faults
        # Kinds a worker loop of this process takes while it runs (None: no loop); jobs of
        # those kinds are joined, never run by the caller (see join()).
        self._worker_kinds: frozenset[str] | None = None
        # How this process's jobs were run: by its worker loop, by its own worker for a
        # caller (a CLI process, a runtime lane), or only joined.
        self.executions: Counter[str] = Counter()
        # Steps may ask for the journal itself too (e.g. to see other jobs of a subject).
        self.resources = (*resources, store)
        self.store = store
        self.registry = registry
        self.lease = lease or LeaseSettings()
        self.history_limit = history_limit
        self.identity = WorkerIdentity.current()

    def add_resource(self, resource: object) -> None:
        """Make ``resource`` available to steps (for objects built after the engine)."""
        self.resources = (*self.resources, resource)

    @classmethod
    async def open(
        cls,
        path: Path | str,
        registry: Registry,
        *,
        synchronous: Synchronous = "FULL",
        lease: LeaseSettings | None = None,
        history_limit: int = DEFAULT_HISTORY_LIMIT,
        resources: Sequence[object] = (),
        max_recoveries: int | None = DEFAULT_MAX_RECOVERIES,
        wait_out_journal_faults: bool = False,
        node: str | None = None,
    ) -> WorkflowEngine:
        """Open the journal at ``path`` (creating it) and return an engine over it (the
        arguments as for the constructor); ``path`` is the SQLite file or a
        ``postgresql://`` URL (:func:`~sbproxy.store.open_journal`); ``node``: the node its
        jobs record (``None``: the default)."""
        return cls(
            await open_journal(path, synchronous=synchronous, node=node),
            registry,
            lease=lease,
            history_limit=history_limit,
            resources=resources,
            max_recoveries=max_recoveries,
            wait_out_journal_faults=wait_out_journal_faults,
        )

    async def close(self) -> None:
        """Close the journal."""
        await self.store.close()

    # -- submission and inspection ---------------------------------------------------------

    async def submit(
        self,
        workflow: WorkflowDef[Any, Any],
        arg: BaseModel,
        *,
        idempotency_key: str | None = None,
        subject: str | None = None,
    ) -> SubmitOutcome:
        """Queue a job, or join the unfinished job that holds ``idempotency_key``.

        The current trace context is stored with a new job so every later run links to it.
        """
        if not isinstance(arg, workflow.input_type):
            raise TypeError(f"{workflow.kind} takes {workflow.input_type.__name__}")
        return await self.store.submit(
            kind=workflow.kind,
            workflow_version=workflow.version,
            input_json=arg.model_dump_json(),
            idempotency_key=idempotency_key,
            subject=subject,
            trace_context=current_carrier() or None,
        )

    async def get(self, job_id: str) -> JobRecord:
        """The job ``job_id``.

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return _found(await self.store.get(job_id), job_id)

    async def steps(self, job_id: str) -> list[StepRecord]:
        """The journal of ``job_id``."""
        return await self.store.steps(job_id)

    async def cancel(self, job_id: str) -> JobRecord:
        """Request cancellation (immediate for queued or parked jobs, cooperative when running).

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return _found(await self.store.request_cancel(job_id), job_id)

    async def retry(self, job_id: str) -> JobRecord:
        """Re-queue a failed or parked job; it resumes after its last completed step.

        Raises:
            JobNotFound: ``job_not_found``.
        """
        return _found(await self.store.retry(job_id), job_id)

    async def follow(
        self,
        job_id: str,
        *,
        after_seq: int = 0,
        poll_s: float = 0.2,
        on_idle: Callable[[JobRecord], Awaitable[None]] | None = None,
    ) -> AsyncIterator[EventRecord]:
        """Yield the events of ``job_id`` as they are written, until the job is finished.

        Works across processes and restarts: it polls the journal from ``after_seq``.
        ``on_idle`` is awaited with the job each time a poll found no new event and the job
        is still unfinished (``jobs watch`` checks there whether it went stale).

        Raises:
            JobNotFound: ``job_not_found``.
        """
        await self.get(job_id)
        last = after_seq
        while True:
            events = await self.store.events(job_id, after_seq=last)
            for event in events:
                last = event.seq
                yield event
            if not events:
                job = await self.get(job_id)
                if job.terminal or job.status == JobStatus.PARKED:
                    # Drain anything written between the read and the status check.
                    for event in await self.store.events(job_id, after_seq=last):
                        last = event.seq
                        yield event
                    return
                if on_idle is not None:
                    await on_idle(job)
                await anyio.sleep(poll_s)

    # -- running ---------------------------------------------------------------------------

    async def recover(self) -> list[str]:
        """Return jobs of dead or lapsed workers to the queue; their ids.

        Two compare-and-set passes: leases past their expiry, then running jobs whose owner
        process is certainly gone (same boot, pid dead or reused) even if the lease is fresh.
        Neither reads the wall clock: leases are judged on the store's lease clock, so a
        wall-clock step neither takes a live owner's job nor keeps a dead owner's. A job out
        of recoveries (``max_recoveries``) ends ``failed`` with ``recovery_exhausted``
        instead and is not among the ids returned.
        """
        lapsed = await self.store.recover_lapsed(max_recoveries=self.max_recoveries)
        recovered = list(lapsed.requeued)
        exhausted = list(lapsed.exhausted)
        for job in await self.store.list_jobs(statuses=(JobStatus.RUNNING,), limit=10_000):
            owner = job.lease_owner
            if owner is None or not owner_is_gone(owner):
                continue
            moved = await self._take_from_dead(job.id, owner)
            if moved == JobStatus.QUEUED:
                recovered.append(job.id)
            elif moved == JobStatus.FAILED:
                exhausted.append(job.id)
        if recovered:
            logger.info("recovered %d job(s): %s", len(recovered), ", ".join(recovered))
        if exhausted:
            logger.warning(
                "%d job(s) failed with recovery_exhausted (recovered %s times in a row without "
                "completing a step): %s",
                len(exhausted),
                self.max_recoveries,
                ", ".join(exhausted),
            )
        return recovered

    async def _take_from_dead(self, job_id: str, owner: str) -> JobStatus | None:
        """Re-queue ``job_id`` from its dead ``owner``, or fail it when out of recoveries."""
        return await self.store.recover_from(
            job_id, owner=owner, reason="owner_gone", max_recoveries=self.max_recoveries
        )

    async def staleness(self, job: JobRecord) -> Staleness | None:
        """Whether ``job`` is stale (running, but its lease lapsed or its owner is gone),
        and since when; ``None`` when it is not. Reads its journal only when it is."""
        lease_now = self.store.lease_clock()
        if stale_reason(job, lease_now=lease_now) is None:
            return None
        steps = await self.store.steps(job.id)
        return judge_staleness(job, steps, lease_now=lease_now, now_ms=self.store.clock())

    async def stale_jobs(
        self, *, kind: str | None = None, subject: str | None = None
    ) -> list[tuple[JobRecord, Staleness]]:
        """Every stale job (of ``kind`` and ``subject`` when given), oldest first."""
        running = await self.store.list_jobs(
            statuses=(JobStatus.RUNNING,), kind=kind, subject=subject, limit=-1
        )
        found = []
        for job in reversed(running):
            stale = await self.staleness(job)
            if stale is not None:
                found.append((job, stale))
        return found

    async def resume_stale(
        self, kind: str, *, subject: str | None = None, joining: str | None = None
    ) -> list[JobRecord]:
        """Run every stale job of ``kind`` (and ``subject``) to its end here, oldest first.

        What a verb that submits ``kind`` does before it decides there is nothing to do:
        each stale job is recovered and resumed under its own id (or, out of recoveries,
        ends ``failed`` with ``recovery_exhausted``), instead of staying ``running`` for
        good. A stale job whose idempotency key is ``joining`` is left alone: the caller's
        submission joins it and runs it.

        Returns:
            The resumed jobs as they ended (succeeded, failed, cancelled or parked).

        Raises:
            WorkflowError: ``unknown_workflow`` when this process cannot run ``kind``.
        """
        finished = []
        for job, stale in await self.stale_jobs(kind=kind, subject=subject):
            if joining is not None and job.idempotency_key == joining:
                continue
            logger.info(
                "job %s (%s) is stale (%s, owner %s); resuming it",
                job.id,
                job.kind,
                stale.reason,
                stale.owner,
            )
            finished.append(await self.join(job.id))
        return finished

    async def join(self, job_id: str, *, poll_s: float = 0.2) -> JobRecord:
        """Wait until ``job_id`` finishes, and return it. The one way to wait for a job.

        Who runs it: while this process runs a worker loop (:meth:`run_worker`, the server)
        that takes the job's kind, that loop does -- the caller only waits, and a job whose
        owner died is recovered by the loop's recovery pass. Otherwise (a CLI process, or a
        kind the loop leaves to the runtime's ordered command lanes) this process's own
        worker runs it for the caller: :meth:`_run_here`.

        Raises:
            JobNotFound: ``job_not_found``.
            WorkflowError: ``unknown_workflow`` when this process cannot run the job's kind.
            SbproxyError: the journal's own failure (``journal_unavailable``, ``disk_full``)
                -- unless the engine waits those out (``wait_out_journal_faults``).
        """
        return await self._outlast(lambda: self._join(job_id, poll_s=poll_s))

    async def _join(self, job_id: str, *, poll_s: float) -> JobRecord:
        if self._worker_kinds is None:  # no worker loop: this process runs it (or waits)
            return await self._run_here(job_id, poll_s=poll_s)
        job = await self.get(job_id)
        if job.kind in self._worker_kinds:
            self.executions["joined"] += 1
            while not (job.terminal or job.status == JobStatus.PARKED):
                await anyio.sleep(poll_s)
                job = await self.get(job_id)
            return job
        return await self._run_here(job_id, poll_s=poll_s)

    async def _run_here(self, job_id: str, *, poll_s: float = 0.2) -> JobRecord:
        """Run ``job_id`` in this process until it finishes, and return it (the worker of a
        process that has no worker loop for the job's kind; see :meth:`join`).

        A queued job is claimed and executed here. A job running under a live owner is
        waited for; one whose owner died or whose lease lapsed is recovered and then run
        here -- or, recovered ``max_recoveries`` times in a row without completing a step,
        ends ``failed`` with ``recovery_exhausted`` and is returned so. A run here that loses
        its lease stops writing and waits for the run that took the job over.

        Raises:
            JobNotFound: ``job_not_found``.
            WorkflowError: ``unknown_workflow`` when the job's kind is not registered here
                (checked before claiming, so the job stays queued for a worker that knows it).
        """
        # The common case first: a queued job of a kind this process runs is claimed at
        # once; anything else (and a claim someone else won) takes the loop below.
        claimed = await self.store.claim(
            owner=self.identity.owner,
            lease_ms=self.lease.lease_ms,
            job_id=job_id,
            kinds=self.registry.kinds(),
        )
        if claimed is not None:
            self.executions["own"] += 1
            finished = await self._execute(claimed)
            if finished.terminal or finished.status == JobStatus.PARKED:
                return finished
        while True:
            job = await self.get(job_id)
            if job.terminal or job.status == JobStatus.PARKED:
                return job
            if self.registry.get(job.kind) is None:
                raise WorkflowError(
                    f"job {job_id} is a {job.kind!r} job, which this process cannot run",
                    code="unknown_workflow",
                    remediation="Let a process that knows this workflow (`sbproxy serve`) run it.",
                    details={"job_id": job_id, "kind": job.kind},
                )
            if job.status == JobStatus.RUNNING:
                if job.lease_owner and owner_is_gone(job.lease_owner):
                    await self._take_from_dead(job.id, job.lease_owner)
                else:
                    lapsed = await self.store.recover_lapsed(max_recoveries=self.max_recoveries)
                    if job.id not in lapsed.requeued and job.id not in lapsed.exhausted:
                        await anyio.sleep(poll_s)
                continue
            claimed = await self.store.claim(
                owner=self.identity.owner, lease_ms=self.lease.lease_ms, job_id=job_id
            )
            if claimed is None:
                continue  # another worker claimed it first: wait for that run
            self.executions["own"] += 1
            finished = await self._execute(claimed)
            if finished.terminal or finished.status == JobStatus.PARKED:
                return finished

    async def _execute(self, job: JobRecord) -> JobRecord:
        """Run a job this worker claimed; the outcome's transaction also prunes finished
        history (only when this run ended it: a run that lost its lease writes nothing).

        A run stopped by the journal's own failure is resumed here when the engine waits
        those out: once the journal answers, a fenced heartbeat takes the same claim up
        again and the job runs on from its last recorded step; when the claim is gone
        (recovery re-queued the job after its lease lapsed) the job as stored is returned.
        """
        resumed = False

        async def run() -> JobRecord:
            nonlocal resumed
            if resumed and not await self._take_up(job):
                return await self.get(job.id)
            first, resumed = not resumed, True
            return await self._run_claimed(job, first_run=first)

        return await self._outlast(run)

    async def _outlast(self, operation: Callable[[], Awaitable[T]]) -> T:
        """``operation()``, tried again through a journal's outage when the engine waits
        those out (raised at once otherwise)."""
        if not self.wait_out_journal_faults:
            return await operation()
        async for attempt in _outlasting():
            with attempt:
                return await operation()
        raise AssertionError("unreachable")  # pragma: no cover - tenacity reraises

    async def _take_up(self, job: JobRecord) -> bool:
        """Renew this worker's claim on ``job`` after its run stopped; whether it still
        holds it (``False``: recovery gave the job to another claim)."""
        held = await self.store.heartbeat(
            job.id, owner=self.identity.owner, attempt=job.attempt, lease_ms=self.lease.lease_ms
        )
        if held:
            logger.info("job %s (%s): the journal answers again; resuming it", job.id, job.kind)
        return held

    async def _run_claimed(self, job: JobRecord, *, first_run: bool) -> JobRecord:
        """Run ``job`` as this worker's claim returned it (``first_run``: no run of this
        claim ran before, so a first claim's journal is known empty)."""
        return await execute(
            job,
            store=self.store,
            registry=self.registry,
            owner=self.identity.owner,
            lease=self.lease,
            resources=self.resources,
            keep_finished=self.history_limit,
            first_run_of_first_claim=first_run,
        )

    async def run_worker(
        self,
        *,
        concurrency: int = 4,
        poll_s: float = 0.2,
        recovery_s: float = 5.0,
        until_idle: bool = False,
        exclude: Sequence[str] = (),
    ) -> None:
        """Claim and run queued jobs, at most ``concurrency`` at once.

        Recovers dead workers' jobs at start and every ``recovery_s``. With ``until_idle``
        it returns once nothing is queued or running here; otherwise it runs until
        cancelled. Kinds in ``exclude`` are left to whoever runs them in order (the runtime
        manager runs its deployments' jobs itself).

        Raises:
            SbproxyError: the journal's own failure met by a recovery pass or a claim
                (``disk_full``, ``journal_unavailable``): the loop and the runs it holds
                end -- unless the engine waits those out (``wait_out_journal_faults``):
                then the loop waits for the journal and its runs go on.
        """
        limiter = anyio.Semaphore(concurrency)
        kinds = tuple(kind for kind in self.registry.kinds() if kind not in exclude)
        self._worker_kinds = frozenset(kinds)
        running = 0
        last_recovery = -recovery_s

        async def run_one(job: JobRecord) -> None:
            nonlocal running
            try:
                self.executions["worker"] += 1
                await self._execute(job)
            except SbproxyError as exc:
                # One job's journal failure (a full disk) must not end the loop: the job
                # stays in the journal and a later pass resumes it.
                logger.error("job %s (%s) stopped: %s [%s]", job.id, job.kind, exc, exc.code)
            finally:
                running -= 1
                limiter.release()

        async def next_job() -> JobRecord | None:
            nonlocal last_recovery
            now = anyio.current_time()
            if now - last_recovery >= recovery_s:
                last_recovery = now
                await self.recover()
            return await self.store.claim(
                owner=self.identity.owner, lease_ms=self.lease.lease_ms, kinds=kinds
            )

        try:
            async with anyio.create_task_group() as group:
                while True:
                    await limiter.acquire()
                    try:
                        job = await self._outlast(next_job)
                    except BaseException:
                        limiter.release()
                        raise
                    if job is None:
                        limiter.release()
                        if until_idle and running == 0:
                            return
                        await anyio.sleep(poll_s)
                        continue
                    running += 1
                    group.start_soon(run_one, job)
        finally:
            self._worker_kinds = None
