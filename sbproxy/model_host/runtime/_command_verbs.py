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
from sbproxy.workflows.errors import JobCancelled

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

logger = logging.getLogger("sbproxy.model_host.runtime.manager")

__all__ = ["CommandsMixin"]

_COMMAND_OF_KIND = {
    "load": CommandKind.LOAD,
    "drain": CommandKind.STOP,
    "reset": CommandKind.RESET,
}


class CommandsMixin:
    """Command verbs of the runtime manager (see the module docstring)."""

    async def _adopt_unfinished_jobs(self: RuntimeManager) -> None:
        active = (JobStatus.QUEUED, JobStatus.RUNNING)
        jobs = await self.engine.store.list_jobs(statuses=active, limit=-1)
        for job in sorted(jobs, key=lambda j: (j.created_at_ms, j.id)):
            kind = _COMMAND_OF_KIND.get(job.kind)
            subject = job.subject or ""
            if kind is None or not subject.startswith("deployment:"):
                continue
            deployment = subject.removeprefix("deployment:")
            queue = self.queue(deployment)
            command, _ = queue.submit(kind, reason="recovered", join=False)
            if job.cancel_requested:
                command.superseded_by = command.seq  # ends cancelled; nothing joins it
            command.assign(job.id)
            logger.info("adopted unfinished %s job %s of %s", job.kind, job.id, deployment)
            self._spawn_command(queue, command, None)

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
                command.assign((await submit()).id)
            async with queue.turn(command):
                if command.job_id is None:
                    return
                if command.superseded_by is not None:
                    await self._cancel_job(command.job_id)
                final = await self.engine.join(command.job_id)
                await self._settle(queue.deployment, command, final)
        except SbproxyError as exc:  # the journal refused (a full disk): no traceback
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
