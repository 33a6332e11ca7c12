"""Scale from zero at the gateway: a request for a fleet deployment that autoscaling took to
zero replicas (``replicas: {min: 0, ...}``) asks the fleet for one and waits for it.

The gateway asks through the fleet agent (:meth:`~sbproxy.fleet.agent.FleetAgent.wake`),
which records the demand in the journal -- one row per deployment however many requests
wait, so a burst of requests makes one ``fleet.scale`` decision, not one each -- and the
controller places a replica at its next pass. The request then waits, up to the
deployment's ``queue_timeout_ms`` (as a request on one host waits for a cold start), until
the routing table lists a ready replica, here or on a peer, and goes on by the usual rules;
none in time: 503 ``queue_timeout``, retryable, as a single host answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from sbproxy.errors import SbproxyError
from sbproxy.fleet.routing import FleetDirectory, FleetWaker
from sbproxy.model_host.runtime.admission import AdmissionReason, reject

__all__ = ["ColdWake"]

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How often a waiting request looks at the routing table again (it follows the fleet's
``NOTIFY`` within milliseconds; the look itself is a dictionary read)."""


class ColdWake:
    """The gateway's side of scale from zero (module docstring).

    Args:
        directory: The fleet's routing table.
        waker: What records the demand (the fleet agent).
        clock: Monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        directory: FleetDirectory,
        waker: FleetWaker,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.waker = waker
        self.clock = clock
        self.woken = 0
        """Requests that waited for a replica of a deployment at zero."""

    def wanted(self, deployment: str) -> bool:
        """Whether a request for ``deployment`` must wait: it scales to zero and the table
        lists no ready replica of it."""
        table = self.directory.routing()
        if deployment not in table.wakeable:
            return False
        return not any(r.ready for r in table.for_deployment(deployment))

    async def wait(self, deployment: str) -> None:
        """Ask the fleet for a replica of ``deployment`` and wait until the table lists a
        ready one.

        Raises:
            AdmissionRejected: ``queue_timeout`` (503, retryable) -- none was ready within
                the deployment's ``queue_timeout_ms``.
        """
        timeout_ms = self.directory.routing().wakeable.get(deployment, 0)
        deadline = self.clock() + timeout_ms / 1000
        self.woken += 1
        while self.wanted(deployment):
            table = self.directory.routing()
            if not table.for_deployment(deployment):
                # Nothing placed yet: (again) ask; the agent writes at most once a heartbeat.
                try:
                    await self.waker.wake(deployment)
                except SbproxyError as exc:
                    logger.warning("scale from zero of %s: [%s] %s", deployment, exc.code, exc)
            if self.clock() >= deadline:
                raise reject(
                    AdmissionReason.QUEUE_TIMEOUT,
                    f"deployment {deployment!r} was scaled to zero and no replica was ready "
                    f"within its queue timeout of {timeout_ms} ms",
                    deployment=deployment,
                    retry_after_ms=1000,
                )
            await anyio.sleep(POLL_S)
