"""Commands and their jobs: :class:`CommandRunner` enters ``load``, ``stop`` and ``reset``
commands in their deployment's lane (``commands.py``, ``lanes.py``), journals each as a
durable job (``jobs.py``) and runs it in the command's turn, so that commands on one
deployment run in arrival order and the last one wins; it also adopts the runtime jobs a
crashed host (or ``sbproxy jobs retry``) left queued."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.commands import Command, CommandKind, CommandQueue
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.definitions import deployment_digest
from sbproxy.model_host.runtime.jobs import submit_drain, submit_load, submit_reset
from sbproxy.model_host.runtime.port import RuntimePort
from sbproxy.model_host.runtime.refusals import exhausted_refusal
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobRecord, JobStatus, journal_fault
from sbproxy.workflows import owner_is_gone

__all__ = ["ADOPT_POLL_S", "RUNTIME_JOB_KINDS", "CommandRunner"]

logger = logging.getLogger(__name__)

S = DeploymentState

# Job kinds the manager runs itself, in its deployments' command order; the worker loop
# leaves them alone (``run_worker(exclude=...)``).
RUNTIME_JOB_KINDS = ("load", "drain", "reset")

# How often a running host looks for runtime jobs it does not hold yet, seconds.
ADOPT_POLL_S = 0.5

_COMMAND_OF_KIND = {
    "load": CommandKind.LOAD,
    "drain": CommandKind.STOP,
    "reset": CommandKind.RESET,
}


class CommandRunner:
    """Ordered commands; their order and joins live in the context's command lanes.

    Args:
        context: The runtime's shared state.
        port: The runtime port the commands' jobs are submitted through.
    """

    def __init__(self, context: RuntimeContext, *, port: RuntimePort) -> None:
        self._context = context
        self._port = port

    async def adopt_runtime_jobs(self) -> list[str]:
        """Run every unfinished ``load``, ``drain`` and ``reset`` job that no command lane
        of this host holds, in its deployment's command order, oldest first; the ids taken.

        Called at start (the jobs of a host that died) and every :data:`ADOPT_POLL_S`
        seconds after (a job ``sbproxy jobs retry`` queued, or one the journal's recovery
        returned to the queue), so a queued runtime job never waits for a restart.

        Never taken: another node's job (hosts sharing a journal); a job running under
        another live process (pid and start time: only a dead owner's work is adopted).
        Never run: a job of a deployment this host's configuration does not declare, or
        whose definition changed since the job was submitted (``config_digest`` of its
        input) -- those are ended ``cancelled`` with a
        ``superseded`` event that says why, since running them would start an engine no
        configuration asks for.
        """
        context = self._context
        lanes = context.lanes
        mark = lanes.mark()
        active = (JobStatus.QUEUED, JobStatus.RUNNING)
        jobs = await context.engine.store.list_jobs(statuses=active, limit=-1)
        if not lanes.quiet_since(mark):
            return []  # a command was submitting: its job may not be in its lane yet
        taken = []
        for job in sorted(jobs, key=lambda j: (j.created_at_ms, j.id)):
            if job.node not in (None, context.engine.store.node):
                continue  # another host's job on a shared journal: never adopted or ended here
            kind = _COMMAND_OF_KIND.get(job.kind)
            subject = job.subject or ""
            if kind is None or not subject.startswith("deployment:") or lanes.holds(job.id):
                continue
            if job.status == JobStatus.RUNNING and self._owned_by_a_live_other(job):
                continue  # a live process runs it: never taken from a live owner
            deployment = subject.removeprefix("deployment:")
            why = self._not_runnable_here(job, deployment)
            if why is not None:
                await self._end_unrunnable(job, why)
                continue
            queue = lanes.queue(deployment)
            command, _ = queue.submit(kind, reason="recovered", join=False)
            if job.cancel_requested:
                command.superseded_by = command.seq  # ends cancelled; nothing joins it
            command.assign(job.id)
            logger.info("adopted unfinished %s job %s of %s", job.kind, job.id, deployment)
            self._spawn_command(queue, command, None)
            taken.append(job.id)
        return taken

    def _owned_by_a_live_other(self, job: JobRecord) -> bool:
        owner = job.lease_owner
        mine = self._context.identity.owner
        return owner is not None and owner != mine and not owner_is_gone(owner)

    def _not_runnable_here(self, job: JobRecord, deployment: str) -> str | None:
        """Why this host must not run ``job`` (``None``: it may)."""
        found = self._context.live.get(deployment)
        if found is None:
            return (
                f"deployment {deployment!r} is not declared in this host's configuration; "
                f"the {job.kind} job came from another configuration"
            )
        recorded = job.input.get("config_digest")
        if recorded is not None and recorded != deployment_digest(found.config):
            return (
                f"the definition of {deployment} changed since this {job.kind} job was "
                "submitted; the current configuration decides what runs"
            )
        return None

    async def _end_unrunnable(self, job: JobRecord, why: str) -> None:
        """End a job this host will not run: a ``superseded`` event saying why, then a
        durable cancellation (immediate for a queued job; a dead owner's running job is
        returned to the queue by recovery first and ends at the next pass)."""
        if job.cancel_requested and job.status == JobStatus.RUNNING:
            return  # already asked; recovery re-queues it and the cancellation ends it
        logger.warning("not running %s job %s: %s", job.kind, job.id, why)
        await self._context.engine.store.record_event(
            job.id, kind="superseded", data={"reason": "not_declared", "message": why}
        )
        await self._cancel_job(job.id)

    def request_load(self, deployment: str, *, reason: str = "request") -> Command:
        """Enter a ``load`` command now (joining the newest load) and run it in the
        background; the command (``assigned`` is set once its job exists).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            AdmissionRejected: ``crash_loop`` while an exhausted load holds it failed.
        """
        found = self._context.deployment(deployment)
        if found.exhausted_job is not None:
            raise exhausted_refusal(found)
        queue = self._context.lanes.queue(deployment)
        fresh_queue = not queue.pending
        command, created = queue.submit(CommandKind.LOAD, reason=reason)
        if created:
            found.clear_load_refusal()
            # The stable key joins a load a crashed host left unfinished; behind other
            # commands the key is the command's own, so it never joins a superseded load.
            key = f"load:{deployment}" if fresh_queue else f"load:{deployment}:{command.seq}"
            self._spawn_command(
                queue, command, lambda: submit_load(self._port, deployment, idempotency_key=key)
            )
        return command

    async def load(self, deployment: str, *, reason: str = "admin") -> JobRecord:
        """Command: make ``deployment`` ready (a ``load`` job, joined when one is newest).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        # An operator's load is the explicit retry an exhausted load waits for.
        self._context.deployment(deployment).clear_exhausted()
        command = self.request_load(deployment, reason=reason)
        return await self._job_of(command)

    async def stop(self, deployment: str, *, reason: str = "stop") -> JobRecord:
        """Command: drain and stop ``deployment`` (a ``drain`` job). Supersedes every
        earlier load of it: a waiting one never runs, a running one is cancelled.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self._context.deployment(deployment)
        queue = self._context.lanes.queue(deployment)
        command, _ = queue.submit(CommandKind.STOP, reason=reason)
        for earlier in queue.pending:
            if earlier.superseded_by == command.seq and earlier.job_id is not None:
                await self._cancel_job(earlier.job_id)
        self._spawn_command(
            queue, command, lambda: submit_drain(self._port, deployment, reason=reason)
        )
        return await self._job_of(command)

    async def reset(self, deployment: str) -> JobRecord:
        """Command: clear a retained failure (a ``reset`` job), in arrival order.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self._context.deployment(deployment)
        queue = self._context.lanes.queue(deployment)
        command, _ = queue.submit(CommandKind.RESET, reason="admin")
        self._spawn_command(queue, command, lambda: submit_reset(self._port, deployment))
        return await self._job_of(command)

    async def _job_of(self, command: Command) -> JobRecord:
        await command.assigned.wait()
        if command.job_id is None and command.refused is not None:
            raise command.refused
        if command.job_id is None:
            raise SbproxyError(
                f"the {command.kind.value} command could not be submitted",
                code="prepare_failed",
                remediation="See the host log for the cause, then try again.",
            )
        return await self._context.engine.get(command.job_id)

    async def _cancel_job(self, job_id: str) -> None:
        """Cancel a superseded job durably, and free its idempotency key so that nothing
        joins it while it winds down."""
        engine = self._context.engine
        try:
            await engine.cancel(job_id)
            await engine.store.detach_key(job_id)
        except SbproxyError as exc:  # already finished: nothing to cancel
            logger.debug("cancel of superseded job %s: %s", job_id, exc)

    def _spawn_command(
        self,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        tasks = self._context.tasks
        if not tasks.started:  # not started: the command is not run (unit tests)
            queue.finish(command)
            return
        tasks.background(lambda: self._run_command(queue, command, submit))

    async def _run_command(
        self,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        """Submit the command's job now, run it in the command's turn, settle the state."""
        try:
            if command.job_id is None and submit is not None:
                with self._context.lanes.submitting():
                    command.assign((await submit()).id)
            async with queue.turn(command):
                if command.job_id is None:
                    return
                if command.superseded_by is not None:
                    await self._cancel_job(command.job_id)
                final = await self._context.engine.join(command.job_id)
                await self._settle(queue.deployment, command, final)
        except SbproxyError as exc:  # the journal refused (a full disk): no traceback
            if command.job_id is None:
                command.refused = exc  # the caller gets this error (journal_unavailable: 503)
            # An outage the caller was told of (journal_unavailable, retryable: 503) is a
            # warning; a refusal that will not pass by itself (disk_full) an error.
            logger.log(
                logging.WARNING if exc.retryable else logging.ERROR,
                "%s command of %s failed: %s [%s]",
                command.kind.value,
                queue.deployment,
                exc,
                exc.code,
            )
            if command.kind is CommandKind.LOAD:
                await self._settle(queue.deployment, command, None, cause=exc)
        except Exception:
            logger.exception("%s command of %s failed", command.kind.value, queue.deployment)
            if command.kind is CommandKind.LOAD:
                await self._settle(queue.deployment, command, None)
        finally:
            queue.finish(command)
            found = self._context.live.get(queue.deployment)
            if found is not None:
                found.pulse()

    async def _settle(
        self,
        deployment: str,
        command: Command,
        final: JobRecord | None,
        *,
        cause: SbproxyError | None = None,
    ) -> None:
        """After a load job ended without a ready engine (or could not even be journaled:
        ``cause``), make the deployment say why."""
        found = self._context.live.get(deployment)
        if found is None or command.kind is not CommandKind.LOAD or found.routable():
            return
        if final is not None and final.status == JobStatus.CANCELLED:
            return  # superseded: the stop that won sets the state
        if found.state in (S.FAILED, S.DRAINING):
            return  # the launch already said why (or a drain decides)
        if cause is not None and journal_fault(cause):
            # The journal, not the load, failed: the load was refused before its job existed
            # (the caller was told: 503), or its job waits for the journal and resumes. No
            # state changes; the requests waiting for it are refused with the cause.
            found.refuse_load(cause)
            return
        error = final.error if final is not None else None
        if cause is not None:
            code, message = cause.code, cause.message
        else:
            code = error.code if error else "prepare_failed"
            message = error.message if error else "the load did not finish"
        found.failed_before_launch(code, message, job_id=command.job_id)
        await self._context.publish()
