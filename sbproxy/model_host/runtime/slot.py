"""Live state of one deployment -- owned and written only by the runtime manager -- and
the small values around it: an admitted request's :class:`Upstream`, the runtime's metric
tallies, its errors.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from sbproxy.catalog import ResolvedArtifact
from sbproxy.config import DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.artifacts.locks import DigestLease
from sbproxy.model_host.engines import EngineProcess
from sbproxy.model_host.runtime.admission import AdmissionGate, Permit
from sbproxy.model_host.runtime.memory import MemoryEstimate
from sbproxy.model_host.runtime.state import CrashLoop, DeploymentState
from sbproxy.store.outcomes import DurationHistogram

__all__ = [
    "IllegalTransition",
    "RuntimeTallies",
    "Slot",
    "UnknownDeployment",
    "Upstream",
    "free_port",
    "new_slot",
    "pulse",
]


class UnknownDeployment(SbproxyError):
    """No deployment has this id (``unknown_deployment``)."""

    default_code = "unknown_deployment"


class IllegalTransition(SbproxyError):
    """A deployment state change the transition table forbids (``illegal_transition``):
    a bug in the runtime, never an operator error."""

    default_code = "illegal_transition"


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


@dataclass
class Slot:
    """Live state of one deployment (replica 0: this runtime is single-node).

    Only :class:`RuntimeManager` writes these fields; ``state`` is read-only here and changes
    through the manager's checked transition function.
    """

    deployment: str
    config: DeploymentConfig
    gate: AdmissionGate
    _state: DeploymentState = DeploymentState.CONFIGURED
    generation: int = 0
    artifact: ResolvedArtifact | None = None
    metadata: CachedMetadata | None = None
    executable: Path | None = None
    engine_version: str | None = None
    process: EngineProcess | None = None
    port: int | None = None
    lease: DigestLease | None = None
    estimate: MemoryEstimate | None = None
    reason_code: str | None = None
    last_error: str | None = None
    job_id: str | None = None
    crash: CrashLoop | None = None
    health_misses: int = 0
    timeouts: int = 0
    failures: int = 0
    not_before: float = 0.0
    restarting: bool = False
    swap_waiting: bool = False
    # Whether a retained insufficient_capacity came from waiting out busy models (a swap
    # that fits once they idle: retryable) rather than from a load that can never fit.
    capacity_retryable: bool = False
    waiting: int = 0
    ready: anyio.Event = field(default_factory=anyio.Event)
    launching: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def state(self) -> DeploymentState:
        """The lifecycle state (changed only by the manager's transition function)."""
        return self._state

    def routable(self) -> bool:
        """Whether requests may go to this generation now: ready, child alive, port known."""
        return (
            self._state == DeploymentState.READY
            and self.process is not None
            and self.process.alive()
            and self.port is not None
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


def pulse(slot: Slot) -> None:
    """Wake everyone waiting on the slot's state; they re-check it."""
    slot.ready.set()
    slot.ready = anyio.Event()


def new_slot(
    deployment: str, config: DeploymentConfig, *, clock: Callable[[], float] = time.monotonic
) -> Slot:
    """A ``configured`` slot for one deployment definition, with its admission gate on
    ``clock`` (the manager's, so that keep-alive and the gate agree on time)."""
    return Slot(
        deployment=deployment,
        config=config,
        gate=AdmissionGate(
            deployment,
            max_active=config.max_concurrency,
            max_queue=config.max_queue_depth,
            queue_timeout_s=config.queue_timeout_ms / 1000,
            clock=clock,
        ),
    )
