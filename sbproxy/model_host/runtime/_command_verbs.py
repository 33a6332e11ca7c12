# mypy: disable-error-code="misc"
# (mixin methods take the manager as an explicit `self: RuntimeManager`; mypy files that
# under "misc" because the manager is a subclass, not a supertype, of the mixin)
"""The runtime manager's command side: load, stop and reset enter their deployment's
:class:`~sbproxy.model_host.runtime.commands.CommandQueue` and run their durable job in the
command's turn; unfinished jobs of a crashed host are adopted in their original order.

A mixin of :class:`~sbproxy.model_host.runtime.manager.RuntimeManager` (one owner, split by
verb group); every method takes the manager as ``self``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.commands import Command, CommandKind, CommandQueue
from sbproxy.model_host.runtime.slot import pulse
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobRecord, JobStatus
from sbproxy.workflows import owner_is_gone
from sbproxy.workflows.errors import JobCancelled

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

# How often a running host looks for runtime jobs it does not hold yet, seconds.
ADOPT_POLL_S = 0.5

logger = logging.getLogger(__name__)

__all__ = ["CommandsMixin"]

_COMMAND_OF_KIND = {
    "load": CommandKind.LOAD,
    "drain": CommandKind.STOP,
    "reset": CommandKind.RESET,
}


class CommandsMixin:
    """Command verbs of the runtime manager (see the module docstring)."""

    async def adopt_runtime_jobs(self: RuntimeManager) -> list[str]:
        """Run every unfinished ``load``, ``drain`` and ``reset`` job that no command lane
        of this host holds, in its deployment's command order, oldest first; the ids taken.

        Called at start (the jobs of a host that died) and every :data:`ADOPT_POLL_S`
        seconds after (a job ``sbproxy jobs retry`` queued, or one the journal's recovery
        returned to the queue), so a queued runtime job never waits for a restart.

        Never taken: another node's job (hosts sharing a journal); a job running under
        another live process (pid and start time: only a dead owner's work is adopted).
        Never run: a job of a deployment this host's
        configuration does not declare, or whose definition changed since the job was
        submitted (``config_digest`` of its input) -- those are ended ``cancelled`` with a
        ``superseded`` event that says why, since running them would start an engine no
        configuration asks for.
        """
        started, in_flight = self._submits_started, self._submits_in_flight
        active = (JobStatus.QUEUED, JobStatus.RUNNING)
        jobs = await self.engine.store.list_jobs(statuses=active, limit=-1)
        if in_flight or self._submits_in_flight or started != self._submits_started:
            return []  # a command was submitting: its job may not be in its lane yet
        taken = []
        for job in sorted(jobs, key=lambda j: (j.created_at_ms, j.id)):
            if job.node not in (None, self.engine.store.node):
                continue  # another host's job on a shared journal: never adopted or ended here
            kind = _COMMAND_OF_KIND.get(job.kind)
            subject = job.subject or ""
            if kind is None or not subject.startswith("deployment:") or self._in_a_lane(job.id):
                continue
            owner = job.lease_owner
            if (
                job.status == JobStatus.RUNNING
                and owner is not None
                and owner != self.identity.owner
                and not owner_is_gone(owner)
            ):
                continue  # a live process runs it: never taken from a live owner
            deployment = subject.removeprefix("deployment:")
            why = self._not_runnable_here(job, deployment)
            if why is not None:
                await self._end_unrunnable(job, why)
                continue
            queue = self.queue(deployment)
            command, _ = queue.submit(kind, reason="recovered", join=False)
            if job.cancel_requested:
                command.superseded_by = command.seq  # ends cancelled; nothing joins it
            command.assign(job.id)
            logger.info("adopted unfinished %s job %s of %s", job.kind, job.id, deployment)
            self._spawn_command(queue, command, None)
            taken.append(job.id)
        return taken

    def _in_a_lane(self: RuntimeManager, job_id: str) -> bool:
        return any(queue.find(job_id) is not None for queue in self.commands.values())

    def _not_runnable_here(self: RuntimeManager, job: JobRecord, deployment: str) -> str | None:
        """Why this host must not run ``job`` (``None``: it may)."""
        from sbproxy.model_host.runtime.manager import deployment_digest

        slot = self.slots.get(deployment)
        if slot is None:
            return (
                f"deployment {deployment!r} is not declared in this host's configuration; "
                f"the {job.kind} job came from another configuration"
            )
        recorded = job.input.get("config_digest")
        if recorded is not None and recorded != deployment_digest(slot.config):
            return (
                f"the definition of {deployment} changed since this {job.kind} job was "
                "submitted; the current configuration decides what runs"
            )
        return None

    async def _end_unrunnable(self: RuntimeManager, job: JobRecord, why: str) -> None:
        """End a job this host will not run: a ``superseded`` event saying why, then a
        durable cancellation (immediate for a queued job; a dead owner's running job is
        returned to the queue by recovery first and ends at the next pass)."""
        if job.cancel_requested and job.status == JobStatus.RUNNING:
            return  # already asked; recovery re-queues it and the cancellation ends it
        logger.warning("not running %s job %s: %s", job.kind, job.id, why)
        await self.engine.store.record_event(
            job.id, kind="superseded", data={"reason": "not_declared", "message": why}
        )
        await self._cancel_job(job.id)

    # -- commands --------------------------------------------------------------------------

    def request_load(self: RuntimeManager, deployment: str, *, reason: str = "request") -> Command:
        """Enter a ``load`` command now (joining the newest load) and run it in the
        background; the command (``assigned`` is set once its job exists).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        fresh_queue = not queue.pending
        command, created = queue.submit(CommandKind.LOAD, reason=reason)
        if created:
            # The stable key joins a load a crashed host left unfinished; behind other
            # commands the key is the command's own, so it never joins a superseded load.
            key = f"load:{deployment}" if fresh_queue else f"load:{deployment}:{command.seq}"

            async def submit() -> JobRecord:
                from sbproxy.model_host.runtime.jobs import submit_load

                return await submit_load(self, deployment, idempotency_key=key)

            self._spawn_command(queue, command, submit)
        return command

    async def load(self: RuntimeManager, deployment: str, *, reason: str = "admin") -> JobRecord:
        """Command: make ``deployment`` ready (a ``load`` job, joined when one is newest).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        command = self.request_load(deployment, reason=reason)
        return await self._job_of(command)

    async def stop(self: RuntimeManager, deployment: str, *, reason: str = "stop") -> JobRecord:
        """Command: drain and stop ``deployment`` (a ``drain`` job). Supersedes every
        earlier load of it: a waiting one never runs, a running one is cancelled.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.STOP, reason=reason)
        for earlier in queue.pending:
            if earlier.superseded_by == command.seq and earlier.job_id is not None:
                await self._cancel_job(earlier.job_id)

        async def submit() -> JobRecord:
            from sbproxy.model_host.runtime.jobs import submit_drain

            return await submit_drain(self, deployment, reason=reason)

        self._spawn_command(queue, command, submit)
        return await self._job_of(command)

    async def reset(self: RuntimeManager, deployment: str) -> JobRecord:
        """Command: clear a retained failure (a ``reset`` job), in arrival order.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.RESET, reason="admin")

        async def submit() -> JobRecord:
            from sbproxy.model_host.runtime.jobs import submit_reset

            return await submit_reset(self, deployment)

        self._spawn_command(queue, command, submit)
        return await self._job_of(command)

    async def _job_of(self: RuntimeManager, command: Command) -> JobRecord:
        await command.assigned.wait()
        if command.job_id is None and command.refused is not None:
            raise command.refused
        if command.job_id is None:
            raise SbproxyError(
                f"the {command.kind.value} command could not be submitted",
                code="prepare_failed",
                remediation="See the host log for the cause, then try again.",
            )
        return await self.engine.get(command.job_id)

    async def _cancel_job(self: RuntimeManager, job_id: str) -> None:
        """Cancel a superseded job durably, and free its idempotency key so that nothing
        joins it while it winds down."""
        try:
            await self.engine.cancel(job_id)
            await self.engine.store.detach_key(job_id)
        except SbproxyError as exc:  # already finished: nothing to cancel
            logger.debug("cancel of superseded job %s: %s", job_id, exc)

    def _spawn_command(
        self: RuntimeManager,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        if self._group is None:  # not started: the command is not run (unit tests)
            queue.finish(command)
            return
        self.background(lambda: self._run_command(queue, command, submit))

    async def _run_command(
        self: RuntimeManager,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        """Submit the command's job now, run it in the command's turn, settle the slot."""
        try:
            if command.job_id is None and submit is not None:
                self._submits_started += 1
                self._submits_in_flight += 1
                try:
                    command.assign((await submit()).id)
                finally:
                    self._submits_in_flight -= 1
            async with queue.turn(command):
                if command.job_id is None:
                    return
                if command.superseded_by is not None:
                    await self._cancel_job(command.job_id)
                final = await self.engine.join(command.job_id)
                await self._settle(queue.deployment, command, final)
        except SbproxyError as exc:  # the journal refused (a full disk): no traceback
            if command.job_id is None:
                command.refused = exc  # the caller gets this error (journal_unavailable: 503)
            logger.error(
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
            slot = self.slots.get(queue.deployment)
            if slot is not None:
                pulse(slot)

    async def _settle(
        self: RuntimeManager,
        deployment: str,
        command: Command,
        final: JobRecord | None,
        *,
        cause: SbproxyError | None = None,
    ) -> None:
        """After a load job ended without a ready engine (or could not even be journaled:
        ``cause``), make the slot say why."""
        slot = self.slots.get(deployment)
        if slot is None or command.kind is not CommandKind.LOAD or slot.routable():
            return
        if final is not None and final.status == JobStatus.CANCELLED:
            return  # superseded: the stop that won sets the state
        if slot.state == DeploymentState.FAILED:
            return  # the launch already said why
        error = final.error if final is not None else None
        if cause is not None:
            code, message = cause.code, cause.message
        else:
            code = error.code if error else "prepare_failed"
            message = error.message if error else "the load did not finish"
        if slot.state == DeploymentState.PREPARING:
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)
        elif slot.state in (DeploymentState.CONFIGURED, DeploymentState.STOPPED):
            await self._set_state(slot, DeploymentState.PREPARING, job_id=command.job_id)
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)
        elif slot.state == DeploymentState.READY:  # its engine died meanwhile
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)

    @asynccontextmanager
    async def step_scope(
        self: RuntimeManager, job_id: str, deployment: str, kind: CommandKind
    ) -> AsyncIterator[None]:
        """The frame a runtime job's step runs in: the command's cancellable scope (a later
        stop cancels a load's steps), or -- for a job run outside a command, e.g. straight
        from ``join`` in a test -- a turn of its own in the deployment's queue.

        Raises:
            JobCancelled: ``cancelled`` when a later command superseded this one.
        """
        queue = self.queue(deployment)
        command = queue.find(job_id)
        async with AsyncExitStack() as stack:
            if command is None:
                command, _ = queue.submit(kind, reason="job", join=False)
                command.assign(job_id)
                await stack.enter_async_context(queue.turn(command))
            scope = await stack.enter_async_context(command.live())
            yield
        if scope.cancelled_caught or command.superseded_by is not None:
            raise JobCancelled(f"job {job_id} was superseded by a later command on {deployment}")

    @asynccontextmanager
    async def exclusive(
        self: RuntimeManager, deployments: Iterable[str], *, job_id: str
    ) -> AsyncIterator[None]:
        """Hold a turn on each of ``deployments`` (a reload's rollout or commit): every
        earlier command on them finishes first, later ones wait until the body ends."""
        async with AsyncExitStack() as stack:
            entered = []
            for deployment in sorted(set(deployments)):
                queue = self.queue(deployment)
                command, _ = queue.submit(CommandKind.RELOAD, reason="reload", join=False)
                command.assign(job_id)
                entered.append((queue, command))
            for queue, command in entered:
                await stack.enter_async_context(queue.turn(command))
            yield
