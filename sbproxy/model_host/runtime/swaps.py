"""Making room for a launch: :class:`Swaps` reserves a generation's memory, evicting idle
generations and waiting (up to the queue timeout) for busy ones to go idle."""

from __future__ import annotations

import anyio

from sbproxy.model_host.runtime.admission import AdmissionReason, AdmissionRejected, reject
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.memory import MemoryEstimate
from sbproxy.model_host.runtime.policy import SwapDecision, SwapVerdict, after_no_room
from sbproxy.model_host.runtime.residency import ReservationRequest, ResidencyKey
from sbproxy.model_host.runtime.retire import Retirement

__all__ = ["Swaps"]


class Swaps:
    """Reservations with swap waits; the waits are timed into the runtime's tallies."""

    def __init__(self, context: RuntimeContext, retirement: Retirement) -> None:
        self._context = context
        self._retirement = retirement

    async def reserve(
        self,
        found: Deployment,
        key: ResidencyKey,
        estimate: MemoryEstimate,
        devices: tuple[int, ...],
    ) -> None:
        """Reserve ``estimate`` for ``key`` on each of ``devices``; evict idle victims; wait
        for busy ones (swap wait).

        Raises:
            AdmissionRejected: ``insufficient_capacity`` (with ``retry_after_ms``) when it
                cannot fit, or a busy generation stayed busy past the queue timeout.
        """
        context = self._context
        timeout_s = found.config.queue_timeout_ms / 1000
        started = context.clock.now()
        held: list[Deployment] = []
        try:
            while True:
                tick = context.next_tick()
                try:
                    # Protection comes from the deployment's state (preparing) through
                    # ``protected``, so a swap can tell a transient hold from a pin.
                    plan = context.residency.reserve(
                        key, estimate=estimate, devices=devices, protected=False, tick=tick
                    )
                    break
                except AdmissionRejected as exc:
                    blockers = self._busy_blockers(key, estimate, devices)
                    decision = after_no_room(
                        busy_blockers=len(blockers),
                        started=started,
                        now=context.clock.now(),
                        timeout_s=timeout_s,
                    )
                    if decision.verdict is SwapVerdict.REFUSE:
                        raise _no_room(found, exc, blockers, decision) from None
                    # Hold only generations that serve: a starting one must let its first
                    # waiters in, or it would be evicted before it served.
                    held.extend(b for b in blockers if b not in held and b.hold())
                    found.swap_wait(True)
                    # Woken when a gate goes idle, a reservation is freed or a state
                    # changes; looked at again after ``wait_s`` at the latest.
                    changed = context.capacity
                    with anyio.move_on_after(decision.wait_s):
                        await changed.wait()
            for victim in plan.victims:
                evicted = context.current(victim.key)
                if evicted is not None:
                    await self._retirement.evict(evicted, job_id=found.job_id)
        finally:
            for blocker in held:
                blocker.release()
            if found.swap_waiting:
                found.swap_wait(False)
                context.tallies.swap_waits.observe(context.clock.now() - started)

    def _busy_blockers(
        self, key: ResidencyKey, estimate: MemoryEstimate, devices: tuple[int, ...]
    ) -> list[Deployment]:
        """The busy or transient (preparing, draining) generations whose eviction would make
        ``key`` fit once they settle (empty: it would not fit even then -- pinned, or too
        large -- and waiting cannot help)."""
        context = self._context
        try:
            plan = context.residency.plan(
                ReservationRequest(key=key, estimate=estimate, devices=devices),
                is_protected=lambda other: context.protected(other, transient=False),
            )
        except AdmissionRejected:
            return []
        blockers = []
        for victim in plan.victims:
            found = context.current(victim.key)
            if found is not None:
                blockers.append(found)
        return blockers


def _no_room(
    found: Deployment,
    exc: AdmissionRejected,
    blockers: list[Deployment],
    decision: SwapDecision,
) -> AdmissionRejected:
    """The refusal of a reservation, as :func:`after_no_room` decided it (with blockers:
    it would fit once they idle, so it is retryable after ``retry_after_ms``)."""
    waited = (
        f"; waited {decision.waited_s:.1f} s for "
        f"{', '.join(b.deployment for b in blockers)} to go idle"
        if blockers
        else ""
    )
    return reject(
        AdmissionReason.INSUFFICIENT_CAPACITY,
        exc.message + waited,
        deployment=found.deployment,
        retry_after_ms=decision.retry_after_ms,
        retryable=decision.retryable,
    )
