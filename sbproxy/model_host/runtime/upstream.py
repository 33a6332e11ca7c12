"""Small values around the runtime: an admitted request's :class:`Upstream`, the runtime's
metric tallies, and a free loopback port."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from sbproxy.model_host.runtime.admission import Permit
from sbproxy.store.outcomes import DurationHistogram

__all__ = ["RuntimeTallies", "Upstream", "free_port"]


@dataclass
class RuntimeTallies:
    """What the runtime counts for its metrics (read at scrape time, never reset).

    Attributes:
        transitions: Deployment state changes by ``(deployment, from, to)``
            (``sbproxy_model_host_deployment_transitions_total``).
        swap_waits: Seconds launches waited for a busy generation to go idle
            (``sbproxy_model_host_swap_wait_seconds``).
    """

    transitions: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    swap_waits: DurationHistogram = field(default_factory=DurationHistogram)

    def copy(self) -> RuntimeTallies:
        """An independent copy (what a scrape reads while the runtime goes on counting)."""
        return RuntimeTallies(
            transitions=Counter(self.transitions), swap_waits=self.swap_waits.copy()
        )


@dataclass
class Upstream:
    """An admitted request's engine: where to send it, its supervision limits, and the
    permit to release after.

    The gateway calls :meth:`report` once per request with how it ended at the engine
    (``timed_out``: a supervision limit ran out), then :meth:`release`; the runtime counts
    consecutive timeouts per generation (``unhealthy_after``).
    """

    deployment: str
    generation: int
    base_url: str
    permit: Permit
    request_timeout_s: float = 300.0
    first_token_timeout_s: float = 120.0
    stall_timeout_s: float = 30.0
    on_outcome: Callable[[int, bool], None] | None = None

    def report(self, *, timed_out: bool) -> None:
        """Tell the runtime how the request ended at the engine (first call wins)."""
        callback, self.on_outcome = self.on_outcome, None
        if callback is not None:
            callback(self.generation, timed_out)

    def release(self) -> None:
        """Free the admission slot (idempotent)."""
        self.permit.release()


def free_port() -> int:
    """An unused loopback port (the engine binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
