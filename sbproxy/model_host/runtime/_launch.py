# mypy: disable-error-code="misc"
# (mixin methods take the manager as an explicit `self: RuntimeManager`; mypy files that
# under "misc" because the manager is a subclass, not a supertype, of the mixin)
"""The runtime manager's engine side: launching a generation (backoff, swap waits, port
ownership, start timeout, crash loop), watching it exit, losing it, evicting and draining it.

A mixin of :class:`~sbproxy.model_host.runtime.manager.RuntimeManager` (one owner, split by
verb group); every method takes the manager as ``self``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.engines import (
    EngineError,
    EngineProcess,
    LaunchRequest,
    launch,
    plan_llama_launch,
)
from sbproxy.model_host.runtime.admission import AdmissionReason, AdmissionRejected, reject
from sbproxy.model_host.runtime.memory import MemoryEstimate
from sbproxy.model_host.runtime.residency import ReservationRequest, ResidencyKey
from sbproxy.model_host.runtime.slot import Slot, free_port, pulse
from sbproxy.model_host.runtime.state import CrashLoop, DeploymentState, LaunchBackoff
from sbproxy.store import wall_clock_ms
from sbproxy.workflows import process_start_ticks

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

logger = logging.getLogger(__name__)

__all__ = ["LaunchMixin"]

# Retries on a fresh port when another process took the chosen one before the engine
# bound it; they do not count as failed launches.
PORT_RETRIES = 3

# Longest a swap waits before it re-reads which resident generations block it, seconds.
SWAP_RECHECK_S = 0.25


def _pinned_template(slot: Slot) -> str | None:
    """The chat template name the catalog pins for the slot's artifact, if any."""
    template = slot.artifact.chat_template if slot.artifact is not None else "embedded"
    return None if template in ("embedded", "none") else template


class LaunchMixin:
    """Engine lifecycle effects of the runtime manager (see the module docstring)."""

    def backoff(self: RuntimeManager, slot: Slot) -> LaunchBackoff:
        """The slot's launch and restart backoff (its config, unless the manager's)."""
        if self.backoff_override is not None:
            return self.backoff_override
        config = slot.config
        return LaunchBackoff(
            base_s=config.restart_backoff_initial_ms / 1000,
            max_s=config.restart_backoff_max_ms / 1000,
            max_attempts=config.max_launch_attempts,
        )

    def _jittered(self: RuntimeManager, delay_s: float) -> float:
        """Equal jitter: half the delay fixed, half random (spreads restarts apart)."""
        return delay_s / 2 + delay_s / 2 * self.jitter()

    def observe_generation(
        self: RuntimeManager,
        deployment: str,
        *,
        generation: int,
        pid: int | None,
        start_ticks: str | None,
    ) -> bool:
        """Whether a journaled launch still describes a live engine of ours: the slot runs
        that generation, its child is that pid with those start ticks, and it is
        routable. After a host restart this is false, and the launch runs again."""
        slot = self.slots.get(deployment)
        if slot is None or slot.generation != generation or not slot.routable():
            return False
        process = slot.process
        assert process is not None  # noqa: S101 - routable slots have a process
        return (
            process.pid == pid
            and process.record.start_ticks == start_ticks
            and process_start_ticks(process.pid) == start_ticks
        )

    async def launch_generation(
        self: RuntimeManager,
        slot: Slot,
        *,
        executable: Path,
        job_id: str,
        generation: int | None = None,
    ) -> int:
        """Start a new generation of ``slot`` and wait until it is ready; its port.

        Idempotency: a live, ready engine of this slot is reused; concurrent callers
        serialize on the slot, and the second finds it ready. Launches across deployments
        run at most ``max_parallel_prepares`` at once. A launch waits out the slot's restart
        backoff first. Early exits retry with the backoff (jittered); exhaustion (or a
        non-retryable failure) retains ``crash_loop``; a lost port retries at once on a new
        one. ``generation`` restarts a stopped generation under its own number (a failed
        ``recreate`` rollout restoring the prior engine). A cancelled launch (a stop
        superseded it) stops its child and leaves the slot ``stopped``.

        Raises:
            EngineError: ``crash_loop`` (or the non-retryable launch error),
                ``start_timeout`` (no ``/health`` within ``start_timeout_ms``),
                ``artifact_not_ready``.
            AdmissionRejected: ``insufficient_capacity`` when the estimate does not fit,
                even after waiting for busy generations to go idle.
        """
        async with slot.launching, self.prepares:
            return await self._launch_locked(
                slot, executable=executable, job_id=job_id, generation=generation
            )

    async def _launch_locked(
        self: RuntimeManager, slot: Slot, *, executable: Path, job_id: str, generation: int | None
    ) -> int:
        if slot.routable():
            assert slot.port is not None  # noqa: S101 - a routable slot has a port
            return slot.port
        if slot.crash is not None:
            raise EngineError(slot.crash.last_error, code="crash_loop")
        metadata = self.cache.read_metadata(slot.artifact.digest) if slot.artifact else None
        if metadata is None:
            raise EngineError("the artifact is not in the cache", code="artifact_not_ready")
        if slot.process is not None:  # a dead or foreign-held generation: clear it first
            await self._release_generation(slot)
        slot.metadata = metadata
        slot.executable = executable
        slot.job_id = job_id
        await self._set_state(slot, DeploymentState.PREPARING, job_id=job_id)
        wait_s = slot.not_before - self.clock.now()
        if wait_s > 0:
            logger.info("%s: relaunch in %.2f s (restart backoff)", slot.deployment, wait_s)
            await self.clock.sleep(wait_s)
        estimate = self.estimate(slot, metadata)
        slot.generation = generation or await self.runtime_store.next_generation(slot.deployment)
        key = ResidencyKey(slot.deployment, slot.generation)
        try:
            await self._reserve(slot, key, estimate)
        except AdmissionRejected as exc:
            slot.capacity_retryable = exc.retryable
            await self._set_state(
                slot, DeploymentState.FAILED, reason_code=exc.code, error=exc.message
            )
            raise
        slot.estimate = estimate
        try:
            process, port = await self._spawn_until_ready(slot, metadata, executable, job_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.residency.release(key)
                self._capacity_changed()
                slot.estimate = None
                if slot.state == DeploymentState.PREPARING:  # cancelled: a stop won
                    await self._set_state(slot, DeploymentState.STOPPED, reason_code="superseded")
            raise
        slot.process = process
        slot.port = port
        slot.health_misses = 0
        slot.timeouts = 0
        if slot.lease is None:
            slot.lease = self.cache.lease(metadata.artifact_digest)
        slot.gate.resume()
        slot.gate.mark_idle()
        await self._set_state(slot, DeploymentState.READY, job_id=job_id)
        self._watch_exit(slot, process, slot.generation)
        pulse(slot)
        return port

    async def _reserve(
        self: RuntimeManager, slot: Slot, key: ResidencyKey, estimate: MemoryEstimate
    ) -> None:
        """Reserve memory for ``key``; evict idle victims; wait for busy ones (swap wait).

        Raises:
            AdmissionRejected: ``insufficient_capacity`` (with ``retry_after_ms``) when it
                cannot fit, or a busy generation stayed busy past the queue timeout.
        """
        timeout_s = slot.config.queue_timeout_ms / 1000
        started = self.clock.now()
        held: list[Slot] = []
        waited = False
        try:
            while True:
                self._tick += 1
                try:
                    # Protection comes from the slot's state (preparing) through
                    # ``_protected``, so a swap can tell a transient hold from a pin.
                    plan = self.residency.reserve(
                        key, estimate=estimate, devices=(0,), protected=False, tick=self._tick
                    )
                    break
                except AdmissionRejected as exc:
                    blockers = self._busy_blockers(key, estimate)
                    left = timeout_s - (self.clock.now() - started)
                    if not blockers or left <= 0:
                        # With blockers it would fit once they idle: retryable, and
                        # Retry-After says when to look again (one queue timeout).
                        raise reject(
                            AdmissionReason.INSUFFICIENT_CAPACITY,
                            exc.message
                            + (
                                f"; waited {self.clock.now() - started:.1f} s for "
                                f"{', '.join(b.deployment for b in blockers)} to go idle"
                                if blockers
                                else ""
                            ),
                            deployment=slot.deployment,
                            retry_after_ms=max(1000, round(timeout_s * 1000)),
                            retryable=bool(blockers),
                        ) from None
                    for blocker in blockers:
                        # Hold only a generation that is serving: a starting one must let
                        # its first waiters in, or it would be evicted before it served.
                        serving = blocker.state == DeploymentState.READY and blocker.gate.active
                        if serving and blocker not in held:
                            blocker.gate.hold()
                            held.append(blocker)
                    waited = True
                    slot.swap_waiting = True
                    # Woken when a gate goes idle, a reservation is freed or a state
                    # changes; re-checked at least every SWAP_RECHECK_S so that a blocker
                    # that starts serving gets held.
                    changed = self._capacity
                    with anyio.move_on_after(min(left, SWAP_RECHECK_S)):
                        await changed.wait()
            for victim in plan.victims:
                victim_slot = self.slots.get(victim.key.deployment)
                if victim_slot is not None and victim_slot.generation == victim.key.generation:
                    await self._evict(victim_slot, job_id=slot.job_id)
        finally:
            for blocker in held:
                blocker.gate.unhold()
            slot.swap_waiting = False
            if waited:
                self.tallies.swap_waits.observe(self.clock.now() - started)

    def _busy_blockers(
        self: RuntimeManager, key: ResidencyKey, estimate: MemoryEstimate
    ) -> list[Slot]:
        """The busy or transient (preparing, draining) generations whose eviction would make
        ``key`` fit once they settle (empty: it would not fit even then -- pinned, or too
        large -- and waiting cannot help)."""
        try:
            plan = self.residency.plan(
                ReservationRequest(key=key, estimate=estimate, devices=(0,)),
                is_protected=lambda other: self._protected(other, transient=False),
            )
        except AdmissionRejected:
            return []
        blockers = []
        for victim in plan.victims:
            found = self.slots.get(victim.key.deployment)
            if found is not None and found.generation == victim.key.generation:
                blockers.append(found)
        return blockers

    async def _spawn_until_ready(
        self: RuntimeManager, slot: Slot, metadata: CachedMetadata, executable: Path, job_id: str
    ) -> tuple[EngineProcess, int]:
        backoff = self.backoff(slot)
        start_timeout_s = slot.config.start_timeout_ms / 1000
        if self.ready_timeout_s is not None:
            start_timeout_s = min(start_timeout_s, self.ready_timeout_s)
        first_failure: int | None = None
        attempt = 0
        port_retries = 0
        while True:
            attempt += 1
            port = free_port()
            request = LaunchRequest(
                deployment=slot.deployment,
                generation=slot.generation,
                metadata=metadata,
                snapshot=self.cache.snapshot(metadata.artifact_digest),
                port=port,
                ctx_size=self._ctx_size(slot) * slot.config.max_concurrency,
                max_concurrency=slot.config.max_concurrency,
                kv_quant=str(slot.config.kv_quant),
                extra_args=tuple(slot.config.extra_args),
                chat_template=_pinned_template(slot),
            )
            try:
                process = await launch(
                    plan_llama_launch(request, executable=executable),
                    log_path=self.layout.root
                    / "logs"
                    / f"{slot.deployment}-g{slot.generation}.log",
                    owned_dir=self.owned_dir,
                    label=f"{slot.deployment}/{slot.generation}",
                    identity=self.identity,
                    ready_timeout_s=start_timeout_s,
                )
                return process, port
            except EngineError as exc:
                if exc.code == "engine_port_lost" and port_retries < PORT_RETRIES:
                    port_retries += 1
                    attempt -= 1
                    logger.warning(
                        "%s: port %d was taken; retrying on another", slot.deployment, port
                    )
                    continue
                now = wall_clock_ms()
                first_failure = first_failure or now
                if exc.code == "engine_readiness_timeout":
                    slot.failures += 1
                    await self._set_state(
                        slot,
                        DeploymentState.FAILED,
                        reason_code="start_timeout",
                        error=f"the engine did not answer /health within "
                        f"{start_timeout_s:g} s (start_timeout_ms): {exc.message}",
                    )
                    raise EngineError(
                        f"{slot.deployment}: the engine was not ready within "
                        f"{start_timeout_s:g} s; it was stopped",
                        code="start_timeout",
                        remediation="Raise proxy.model_host.deployments."
                        f"{slot.deployment}.start_timeout_ms or check the engine log; the "
                        "next request or a reset retries.",
                        details={"deployment": slot.deployment, "log": exc.details.get("log")},
                    ) from exc
                if exc.retryable and attempt < backoff.max_attempts:
                    logger.warning(
                        "%s: launch %d failed (%s); retrying", slot.deployment, attempt, exc.code
                    )
                    await self.clock.sleep(self._jittered(backoff.delay(attempt)))
                    continue
                slot.crash = CrashLoop(
                    attempts=attempt,
                    reason=exc.code,
                    last_error=exc.message,
                    stderr_tail=str(exc.details.get("stderr_tail") or ""),
                    first_failure_at_ms=first_failure,
                    last_failure_at_ms=now,
                    job_id=job_id,
                )
                await self._set_state(
                    slot,
                    DeploymentState.FAILED,
                    reason_code="crash_loop",
                    error=f"{exc.code} after {attempt} launch(es): {exc}",
                )
                raise EngineError(
                    str(exc),
                    code="crash_loop",
                    remediation="Fix the cause, then reset the deployment.",
                ) from exc

    def _watch_exit(
        self: RuntimeManager, slot: Slot, process: EngineProcess, generation: int
    ) -> None:
        """Stop routing the moment the child exits (not at the next health probe)."""

        async def watch() -> None:
            status = await process.wait_exit()
            if slot.process is process and slot.generation == generation:
                await self._engine_lost(
                    slot,
                    generation,
                    f"the engine exited with status {status}: {process.stderr_tail(15)}",
                )

        self.start_contained(watch, what=f"the exit watcher of {slot.deployment}")

    async def _engine_lost(self: RuntimeManager, slot: Slot, generation: int, message: str) -> None:
        """A ready generation died or stopped answering: fail it, free what it held, and
        set the restart backoff (the next request relaunches it after that)."""
        if slot.generation != generation or slot.state != DeploymentState.READY:
            return
        slot.failures += 1
        backoff = self.backoff(slot)
        slot.not_before = self.clock.now() + self._jittered(backoff.delay(slot.failures))
        await self._set_state(
            slot, DeploymentState.FAILED, reason_code="engine_health_failed", error=message
        )
        await self._release_generation(slot)
        pulse(slot)

    async def _release_generation(self: RuntimeManager, slot: Slot) -> None:
        """Stop the slot's engine (if any) and free its reservation, lease and port."""
        process, slot.process = slot.process, None
        if process is not None:
            with anyio.CancelScope(shield=True):
                await process.shutdown(
                    grace_s=self._remaining_s(min(self.shutdown_deadline_s, 10.0)),
                    kill_wait_s=2.0 if self._closing_at is not None else 5.0,
                )
        if slot.generation:
            self.residency.release(ResidencyKey(slot.deployment, slot.generation))
            self._capacity_changed()
        if slot.lease is not None:
            slot.lease.release()
            slot.lease = None
        slot.port = None
        slot.estimate = None

    async def _evict(self: RuntimeManager, slot: Slot, *, job_id: str | None) -> None:
        """Stop an idle generation to make room; its gate (and any held queue) stays."""
        if slot.state not in (DeploymentState.READY, DeploymentState.FAILED):
            await self._release_generation(slot)
            return
        previous = slot.state
        await self._set_state(slot, DeploymentState.DRAINING, job_id=job_id)
        await self._release_generation(slot)
        if previous == DeploymentState.FAILED:
            await self._set_state(slot, DeploymentState.FAILED, reason_code=slot.reason_code)
        else:
            await self._set_state(slot, DeploymentState.STOPPED, reason_code="evicted")
        pulse(slot)

    async def drain_slot(
        self: RuntimeManager, slot: Slot, *, job_id: str | None = None, reason: str | None = None
    ) -> dict[str, object]:
        """Refuse new work, cancel the queue, wait for active requests (up to the shutdown
        deadline), stop the engine. A failed deployment stays failed.

        Idempotency: draining a stopped deployment only settles its state.
        """
        previous = slot.state
        retained = (slot.reason_code, slot.last_error)
        await self._set_state(slot, DeploymentState.DRAINING, job_id=job_id, reason_code=reason)
        report = await slot.gate.drain(deadline_s=self._remaining_s(self.shutdown_deadline_s))
        await self._release_generation(slot)
        if previous == DeploymentState.FAILED:
            await self._set_state(
                slot, DeploymentState.FAILED, reason_code=retained[0], error=retained[1]
            )
        else:
            keep = None if reason in (None, "stop", "drain") else reason
            await self._set_state(slot, DeploymentState.STOPPED, job_id=job_id, reason_code=keep)
        slot.gate.resume()
        pulse(slot)
        return {
            "active_at_start": report.active_at_start,
            "cancelled_queued": report.cancelled_queued,
            "remaining_active": report.remaining_active,
            "timed_out": report.timed_out,
        }

    async def reset_slot(self: RuntimeManager, slot: Slot, *, job_id: str | None = None) -> bool:
        """Clear a retained failure so the deployment may launch again (backoff too);
        whether there was one to clear. A deployment that has not failed (ready, stopped,
        configured) has nothing to reset: that is a no-op, not an error.

        Raises:
            SbproxyError: ``draining`` while it is preparing or draining (wait for that to
                finish, then reset if it failed).
        """
        if slot.state in (DeploymentState.PREPARING, DeploymentState.DRAINING):
            raise SbproxyError(
                f"{slot.deployment} is {slot.state.value}; reset it once that has finished "
                "(if it failed)",
                code="draining",
            )
        if slot.state != DeploymentState.FAILED:
            logger.info("%s: reset: nothing to clear (%s)", slot.deployment, slot.state.value)
            return False
        slot.crash = None
        slot.failures = 0
        slot.not_before = 0.0
        await self._set_state(slot, DeploymentState.CONFIGURED, job_id=job_id)
        slot.gate.resume()
        return True
