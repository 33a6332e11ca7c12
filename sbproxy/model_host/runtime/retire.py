"""How a generation ends: :class:`Retirement` drains, evicts, and notices a lost engine,
and frees what a generation held (its engine, reservation, artifact lease and port)."""

from __future__ import annotations

import logging

import anyio

from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.launcher import Engine
from sbproxy.model_host.runtime.policy import restart_delay
from sbproxy.model_host.runtime.state import DeploymentState

__all__ = ["Retirement"]

logger = logging.getLogger(__name__)

S = DeploymentState


class Retirement:
    """The end of generations: drains, evictions, exits; it owns no state of its own."""

    def __init__(self, context: RuntimeContext) -> None:
        self._context = context

    async def release_generation(self, found: Deployment) -> None:
        """Stop the deployment's engine (if any) and free its reservation, lease and port."""
        context = self._context
        tasks = context.tasks
        process, lease = found.detach()
        if process is not None:
            with anyio.CancelScope(shield=True):
                await context.launcher.stop(
                    process,
                    grace_s=tasks.remaining_s(min(context.shutdown_deadline_s, 10.0)),
                    kill_wait_s=2.0 if tasks.closing_at is not None else 5.0,
                )
        if found.generation:
            context.residency.release(found.key)
            context.capacity_changed()
        if lease is not None:
            lease.release()

    async def evict(self, found: Deployment, *, job_id: str | None) -> None:
        """Stop an idle generation to make room; its gate (and any held queue) stays."""
        if found.state not in (S.READY, S.FAILED):
            await self.release_generation(found)
            return
        retained = found.begin_evict(job_id=job_id)
        await self._context.publish()
        await self.release_generation(found)
        found.drained(retained, job_id=job_id, reason="evicted")
        await self._context.publish()

    async def drain_deployment(
        self, found: Deployment, *, job_id: str | None = None, reason: str | None = None
    ) -> dict[str, object]:
        """Refuse new work, cancel the queue, wait for active requests (up to the shutdown
        deadline), stop the engine. A failed deployment stays failed.

        Idempotency: draining a stopped deployment only settles its state.
        """
        context = self._context
        retained = found.begin_drain(job_id=job_id, reason=reason)
        await context.publish()
        deadline_s = context.tasks.remaining_s(context.shutdown_deadline_s)
        report = await found.gate.drain(deadline_s=deadline_s)
        await self.release_generation(found)
        found.drained(retained, job_id=job_id, reason=reason)
        await context.publish()
        return {
            "active_at_start": report.active_at_start,
            "cancelled_queued": report.cancelled_queued,
            "remaining_active": report.remaining_active,
            "timed_out": report.timed_out,
        }

    async def engine_lost(self, found: Deployment, generation: int, message: str) -> None:
        """A ready generation died or stopped answering: fail it, free what it held, and
        set the restart backoff (the next request relaunches it after that) -- unless the
        host is stopping now (a second stop signal killed it): then the shutdown settles it
        ``stopped``, whoever noticed the exit (its exit watcher, a health probe)."""
        context = self._context
        if context.tasks.stopping_now:
            logger.info("deployment %s: its engine ended with the host's stop", found.deployment)
            return
        delay = restart_delay(context.backoff(found), found.failures + 1, context.jitter())
        if not found.lost(generation, message, not_before=context.clock.now() + delay):
            return
        await context.publish()
        await self.release_generation(found)
        found.pulse()

    def watch_exit(self, found: Deployment, process: Engine, generation: int) -> None:
        """Stop routing the moment the child exits (not at the next health probe)."""

        async def watch() -> None:
            status = await process.wait_exit()
            if found.process is process and found.generation == generation:
                await self.engine_lost(
                    found,
                    generation,
                    f"the engine exited with status {status}: {process.stderr_tail(15)}",
                )

        self._context.tasks.start_contained(watch, what=f"the exit watcher of {found.deployment}")
