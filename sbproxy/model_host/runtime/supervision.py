"""Supervision and maintenance: :class:`Supervision` starts the runtime (orphans reaped,
adopted jobs, warm loads, poisoned loads held), runs its loops (health and socket probes,
keep-alive, job adoption), restarts a generation that keeps timing out, and shuts it all
down within a deadline."""

from __future__ import annotations

import functools
import logging

import anyio
import anyio.to_thread

from sbproxy.errors import SbproxyError
from sbproxy.model_host.engines import kill_owned, owned_alive, reap_orphans
from sbproxy.model_host.runtime.command_runner import ADOPT_POLL_S, RUNTIME_JOB_KINDS, CommandRunner
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.definitions import deployment_digest, desired_digest, desired_of
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.policy import (
    ProbeVerdict,
    after_probe,
    keep_alive_due,
    restart_delay,
)
from sbproxy.model_host.runtime.retire import Retirement
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.model_host.runtime.steps import RuntimeSteps
from sbproxy.store import RECOVERY_EXHAUSTED, JobRecord, JobStatus

__all__ = ["Supervision"]

logger = logging.getLogger(__name__)

S = DeploymentState


class Supervision:
    """The runtime's own initiative: start, loops, restarts, shutdown.

    Args:
        context: The runtime's shared state.
        commands: Where its loads and stops are entered, in order.
        retirement: Drains, exits and releases.
        steps: The effects an ``on_boot`` verification uses (resolve, pull).
        health_interval_s: Maintenance tick period, in seconds.
    """

    def __init__(
        self,
        context: RuntimeContext,
        *,
        commands: CommandRunner,
        retirement: Retirement,
        steps: RuntimeSteps,
        health_interval_s: float,
    ) -> None:
        self._context = context
        self._commands = commands
        self._retirement = retirement
        self._steps = steps
        self.health_interval_s = health_interval_s

    async def start(self) -> None:
        """Reap orphan engines, commit the desired revision, start converging to it (see
        :meth:`~sbproxy.model_host.runtime.manager.RuntimeManager.start`)."""
        context = self._context
        owned_dir = context.layout.owned_engines
        report = await anyio.to_thread.run_sync(reap_orphans, owned_dir)
        if report.killed:
            logger.warning("reaped orphan engines: %s", report.killed)
        desired = desired_of(context.compiled)
        context.revision = await context.runtime_store.commit_revision(
            content_digest=desired_digest(desired), desired=desired
        )
        # A dead host's running jobs go back to the queue first, so the adoption below sees
        # them as they are (and ends those no deployment here declares at once).
        await context.engine.recover()
        await self._commands.adopt_runtime_jobs()
        exhausted = await self._exhausted_loads()
        tasks = context.tasks
        for found in context.live.values():
            poison = exhausted.get(found.deployment)
            if poison is not None:
                self._hold_exhausted(found, poison)
            elif found.config.warm:
                self._commands.request_load(found.deployment, reason="warm")
            elif str(found.config.pull) == "on_boot":
                name = found.deployment
                tasks.start_contained(
                    functools.partial(self._verify_on_boot, name),
                    what=f"the on_boot verification of {name}",
                )
        tasks.start_contained(self._maintenance, what="the maintenance loop")
        tasks.start_contained(self._adoption, what="the runtime job adoption loop")

    async def _exhausted_loads(self) -> dict[str, JobRecord]:
        """Deployments whose latest runtime job (of this node) is a ``load`` that ended
        ``failed`` with ``recovery_exhausted`` for their current definition, with that
        job. A later load, drain or reset, a ``jobs retry`` (the job is queued again) or a
        changed definition (``config_digest``) lifts it."""
        context = self._context
        store = context.engine.store
        latest: dict[str, JobRecord] = {}
        for deployment in context.live:
            # Each deployment's own jobs (newest first), not the whole shared journal.
            jobs = await store.list_jobs(subject=f"deployment:{deployment}", limit=-1)
            for job in jobs:
                if job.kind not in RUNTIME_JOB_KINDS:
                    continue
                if job.node not in (None, store.node):
                    continue  # another host's job on a shared journal
                latest[deployment] = job
                break
        exhausted = {}
        for deployment, job in latest.items():
            found = context.live.get(deployment)
            if found is None or job.kind != "load" or job.status != JobStatus.FAILED:
                continue
            if job.error is None or job.error.code != RECOVERY_EXHAUSTED:
                continue
            if job.input.get("config_digest") not in (None, deployment_digest(found.config)):
                continue  # the definition changed since: the new one deserves its load
            exhausted[deployment] = job
        return exhausted

    def _hold_exhausted(self, found: Deployment, job: JobRecord) -> None:
        """Hold ``found`` ``failed`` (``recovery_exhausted``, the job's error) instead of
        giving it a fresh load at boot that would die where the exhausted one died."""
        message = job.error.message if job.error is not None else "recovery exhausted"
        found.load_exhausted(job.id, message)
        logger.error(
            "%s is not loaded at start: its load job %s ended recovery_exhausted (%s); "
            "a reset (POST /admin/model-host/reset) or `sbproxy models load %s` tries again "
            "once the cause is fixed",
            found.deployment,
            job.id,
            message,
            found.deployment,
        )

    async def _verify_on_boot(self, deployment: str) -> None:
        found = self._context.deployment(deployment)
        try:
            artifact = found.artifact or self._steps.resolve(deployment)
            await self._steps.pull(deployment, artifact, "startup")
        except SbproxyError as exc:
            if found.state is S.CONFIGURED:
                found.failed_before_launch(exc.code, str(exc), job_id=None)
                await self._context.publish()

    async def _adoption(self) -> None:
        """Take queued runtime jobs this host does not hold yet (``adopt_runtime_jobs``)."""
        while True:
            await anyio.sleep(ADOPT_POLL_S)
            try:
                await self._commands.adopt_runtime_jobs()
            except SbproxyError as exc:  # a journal that cannot be read now: next pass
                logger.warning("runtime job adoption skipped: %s [%s]", exc, exc.code)

    async def _maintenance(self) -> None:
        while True:
            await anyio.sleep(self.health_interval_s)
            try:
                await self.tick()
            except Exception:
                # One failed pass (a probe, a journal write) must not stop the loop.
                logger.exception("maintenance tick failed")

    async def tick(self) -> None:
        """One maintenance pass: health and socket-ownership probes of ready engines,
        keep-alive expiry (on the injected clock)."""
        context = self._context
        for found in list(context.live.values()):
            process, generation, port = found.process, found.generation, found.port
            if found.state is not S.READY or process is None or port is None:
                continue
            # Ownership first: /health goes only to a socket our child holds, never to a
            # process that took the port.
            probe = await context.launcher.probe(process, port)
            if found.process is not process or found.generation != generation:
                continue  # changed while probing
            verdict, why = after_probe(probe, found.health_misses)
            if verdict is ProbeVerdict.HEALTHY:
                found.health_ok()
            elif verdict is ProbeVerdict.MISSED:
                found.health_missed()
            else:
                detail = process.stderr_tail(15) if probe.health == "stopped" else f"port {port}"
                await self._retirement.engine_lost(found, generation, f"{why} ({detail})")
            if keep_alive_due(
                found.state,
                commands_pending=context.lanes.pending(found.deployment),
                gate=found.gate,
                keep_alive_s=found.config.keep_alive_secs,
                now=context.clock.now(),
            ):
                await self._commands.stop(found.deployment, reason="keep_alive")

    def record_outcome(self, deployment: str, generation: int, *, timed_out: bool) -> None:
        """Count one request's end at the engine of ``deployment``/``generation``:
        ``unhealthy_after`` consecutive timeouts drain the generation and relaunch it after
        the restart backoff; a request that ended in time resets the count and the backoff.
        """
        found = self._context.live.get(deployment)
        if found is not None and found.count_outcome(generation, timed_out=timed_out):
            self._context.tasks.background(lambda: self._restart_unhealthy(found, generation))

    async def _restart_unhealthy(self, found: Deployment, generation: int) -> None:
        """Mark the generation unhealthy, drain it and relaunch after the backoff."""
        context = self._context
        try:
            delay = restart_delay(context.backoff(found), found.failures + 1, context.jitter())
            message = (
                f"{found.timeouts} consecutive requests timed out at generation {generation}; "
                f"it is restarted in {delay:.1f} s"
            )
            if not found.unhealthy(
                generation, not_before=context.clock.now() + delay, message=message
            ):
                return
            logger.warning("%s: %s", found.deployment, message)
            await context.publish()
            await self._commands.stop(found.deployment, reason="engine_unhealthy")
            self._commands.request_load(found.deployment, reason="restart")
        finally:
            found.restart_finished()

    async def shutdown(self, *, deadline_s: float | None = None) -> None:
        """Let in-flight commands settle, then drain every deployment (staged ones too, all
        at once) and stop every engine, all within ``deadline_s`` seconds from now (default
        ``shutdown_deadline_ms``): half the budget for commands to settle, what is left for
        the drains; engines still up at the end are killed. Unfinished jobs stay in the
        journal and resume at the next start."""
        context = self._context
        tasks = context.tasks
        budget = context.shutdown_deadline_s if deadline_s is None else max(0.0, deadline_s)
        end = anyio.current_time() + budget
        tasks.closing_at = end
        with anyio.CancelScope(shield=True):
            if tasks.running:
                # Said, since the wait may be long and silent otherwise (a load whose job
                # waits for a journal that is away).
                logger.info(
                    "stopping: waiting up to %.1f s for %d runtime command(s) under way",
                    budget / 2,
                    tasks.running,
                )
            with anyio.move_on_after(budget / 2):
                while tasks.running:
                    await anyio.sleep(0.05)
            every = [*context.live.values(), *context.staging.staged.values()]
            running = [found for found in every if found.process is not None]
            with anyio.move_on_after(max(0.0, end - anyio.current_time())):
                async with anyio.create_task_group() as group:
                    for found in running:
                        group.start_soon(self._drain_for_shutdown, found)
            self.kill_engines()
            for found in running:
                await self._retirement.release_generation(found)

    async def _drain_for_shutdown(self, found: Deployment) -> None:
        try:
            await self._retirement.drain_deployment(found)
        except SbproxyError as exc:  # an engine that will not die is killed right after
            logger.error("%s: shutdown drain failed: %s", found.deployment, exc)

    def kill_engines(self) -> list[int]:
        """SIGKILL every engine the runtime holds (current and staged) at once, without
        grace. A running shutdown then sees them exit. The pids signalled."""
        killed = []
        context = self._context
        for process in context.engines():
            if process.alive():
                context.launcher.kill(process)
                killed.append(process.pid)
        return killed

    def holds_engines(self) -> bool:
        """Whether any child this host started still runs: an engine the runtime holds, or
        one its ownership records name (starting, stopping, a split's RPC worker)."""
        context = self._context
        owned = owned_alive(context.layout.owned_engines, owner=context.identity.owner)
        return any(process.alive() for process in context.engines()) or bool(owned)

    def kill_every_engine(self, *, stopping: bool = False) -> list[int]:
        """SIGKILL every child this host started, at once (a second stop signal, a fence):
        the engines the runtime holds and, from the ownership records, any it holds no
        more or not yet -- one in the middle of its graceful stop, one still starting, a
        split's RPC worker. The pids (process groups) signalled.

        ``stopping``: the host is stopping now (a second stop signal): an engine's exit
        from here on is the stop's -- its deployment is not failed, gets no restart
        backoff, and the shutdown settles it ``stopped``. A fence passes ``False``: its
        engines' deployments fail, and restart once the host may serve again."""
        context = self._context
        if stopping:
            context.tasks.stopping_now = True
        killed = self.kill_engines()
        for pid in kill_owned(context.layout.owned_engines, owner=context.identity.owner):
            if pid not in killed:
                killed.append(pid)
        return killed
