"""Requests into the runtime: :class:`Requests` admits one request to a deployment's gate,
starting or healing its engine first when needed, and refuses with a stable reason what
waiting cannot help (``refusals.py``)."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from sbproxy.config import PriorityClass
from sbproxy.model_host.runtime.admission import AdmissionReason, Permit, reject
from sbproxy.model_host.runtime.command_runner import CommandRunner
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.refusals import refuse_failed, refuse_now, waited_too_long
from sbproxy.model_host.runtime.residency import ResidencyKey
from sbproxy.model_host.runtime.upstream import Upstream

__all__ = ["OutcomeSink", "Requests"]

# Where a request's end is reported: ``(deployment, generation, timed_out)``.
OutcomeSink = Callable[[str, int, bool], None]


class Requests:
    """Admission of requests; it owns no state beyond the deployments' gates it admits to.

    Args:
        context: The runtime's shared state.
        commands: Where a request that finds no ready engine asks for a load.
        on_outcome: Where each admitted request's end is reported (supervision).
    """

    def __init__(
        self, context: RuntimeContext, *, commands: CommandRunner, on_outcome: OutcomeSink
    ) -> None:
        self._context = context
        self._commands = commands
        self._on_outcome = on_outcome

    async def acquire(self, deployment: str, *, priority: PriorityClass) -> Upstream:
        """Admit one request to ``deployment``, starting or healing its engine if needed.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            AdmissionRejected: ``draining``, ``crash_loop``, ``engine_unhealthy``,
                ``queue_full``, ``queue_timeout`` or ``insufficient_capacity`` (with
                ``retry_after_ms``).
        """
        context = self._context
        found = context.deployment(deployment)
        refuse_now(found)
        # The common case -- a ready engine with a free slot and nobody queued -- is
        # admitted without waiting, so it needs no deadline (a cancel scope and a timer per
        # request cost more than the rest of admission).
        permit = found.gate.try_admit() if found.routable() else None
        if permit is None:
            found, permit = await self._admit_waiting(deployment, priority)
        tick = context.next_tick()
        if found.generation:
            context.residency.touch(ResidencyKey(deployment, found.generation), tick)
        config = found.config
        report = self._on_outcome
        return Upstream(
            deployment=deployment,
            generation=found.generation,
            base_url=f"http://127.0.0.1:{found.port}",
            permit=permit,
            request_timeout_s=config.request_timeout_ms / 1000,
            first_token_timeout_s=config.first_token_timeout_ms / 1000,
            stall_timeout_s=config.stall_timeout_ms / 1000,
            on_outcome=lambda generation, timed_out: report(deployment, generation, timed_out),
        )

    async def _admit_waiting(
        self, deployment: str, priority: PriorityClass
    ) -> tuple[Deployment, Permit]:
        """Admission that may wait (a cold or starting engine, a full gate), within the
        deployment's ``queue_timeout_ms``; the deployment admitted to and its permit.

        Raises:
            AdmissionRejected: as :meth:`acquire`.
        """
        context = self._context
        found = context.deployment(deployment)
        timeout_s = found.config.queue_timeout_ms / 1000
        with anyio.move_on_after(timeout_s) as scope:
            while True:
                found = context.deployment(deployment)
                refuse_now(found)
                if found.evicting:
                    # Making room for another model: its relaunch (below, once it has
                    # stopped) serves this request; an operator's stop refuses above.
                    await found.ready.wait()
                    continue
                if not found.routable():
                    await self._wait_ready(found)
                permit = await found.gate.admit(priority)
                if found.routable() and context.live.get(deployment) is found:
                    break
                permit.release()  # evicted or replaced while it queued: start over
        if scope.cancelled_caught:
            raise waited_too_long(found, timeout_s)
        return found, permit

    async def _wait_ready(self, found: Deployment) -> None:
        """Ask for a load and wait until it is routable (or the load failed)."""
        if str(found.config.cold_start) == "reject":
            raise reject(
                AdmissionReason.ENGINE_UNHEALTHY,
                f"{found.deployment} has no ready replica (cold_start: reject)",
                deployment=found.deployment,
                retry_after_ms=1000,
            )
        self._commands.request_load(found.deployment)
        found.add_waiter()  # keeps the generation from being evicted meanwhile
        try:
            while not found.routable():
                await found.ready.wait()
                refuse_failed(found, now=self._context.clock.now())
        finally:
            found.drop_waiter()
