"""Deployment lifecycle as data, and the status record the admin API and ``models ps`` show."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "DEPLOYMENT_TRANSITIONS",
    "CrashLoop",
    "DeploymentState",
    "DeploymentStatus",
    "LaunchBackoff",
]

# A retained error is bounded, like the reference's (512 characters, control bytes removed).
MAX_LAST_ERROR_CHARS = 512


class DeploymentState(StrEnum):
    """Where a deployment's current generation is."""

    CONFIGURED = "configured"
    PREPARING = "preparing"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


# Every deployment state change goes through ``Deployment._move``, a compare-and-set that
# refuses a move this table does not list (``illegal_transition``); a move to the same state
# only updates the reason.
DEPLOYMENT_TRANSITIONS: dict[DeploymentState, frozenset[DeploymentState]] = {
    DeploymentState.CONFIGURED: frozenset({DeploymentState.PREPARING, DeploymentState.DRAINING}),
    # A launch that a later stop cancelled ends stopped.
    DeploymentState.PREPARING: frozenset(
        {
            DeploymentState.READY,
            DeploymentState.FAILED,
            DeploymentState.DRAINING,
            DeploymentState.STOPPED,
        }
    ),
    DeploymentState.READY: frozenset(
        {DeploymentState.DRAINING, DeploymentState.FAILED, DeploymentState.PREPARING}
    ),
    DeploymentState.DRAINING: frozenset({DeploymentState.STOPPED, DeploymentState.FAILED}),
    DeploymentState.STOPPED: frozenset({DeploymentState.PREPARING, DeploymentState.DRAINING}),
    DeploymentState.FAILED: frozenset(
        {DeploymentState.PREPARING, DeploymentState.CONFIGURED, DeploymentState.DRAINING}
    ),
}


@dataclass(frozen=True)
class LaunchBackoff:
    """Launch retries of an engine that exits early or never becomes ready.

    ``delay(n) = base_s * 2**(n-1)`` capped at ``max_s``; after ``max_attempts`` launches the
    deployment is crash-looped until ``reset``. Defaults follow the reference (section 7.7:
    1 s, 60 s, 5 attempts -> delays 1, 2, 4, 8 s).
    """

    base_s: float = 1.0
    max_s: float = 60.0
    max_attempts: int = 5

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed launch number ``attempt`` (1-based)."""
        return float(min(self.base_s * 2 ** (attempt - 1), self.max_s))


@dataclass
class CrashLoop:
    """A retained launch failure; only ``reset`` clears it."""

    attempts: int
    reason: str
    last_error: str
    stderr_tail: str
    first_failure_at_ms: int
    last_failure_at_ms: int
    job_id: str | None = None


def bounded(text: str | None) -> str | None:
    """A retained error: control characters to spaces, at most 512 characters."""
    if text is None:
        return None
    cleaned = "".join(ch if ch.isprintable() else " " for ch in text)
    return cleaned[:MAX_LAST_ERROR_CHARS]


@dataclass(frozen=True)
class DeploymentStatus:
    """One deployment as ``GET /admin/model-host/status`` reports it (reference 2): the
    frozen value every reader outside the runtime gets (admin status, the gateway's
    availability, the console, metrics), never the live deployment.

    The fields after ``extra`` are for those readers and are not part of the status route's
    JSON: ``routable`` (requests go to it now), ``crash_looped`` (a retained crash loop),
    ``desired_replicas``, ``configured_engine`` (the definition's engine) and
    ``keep_alive_secs``.
    """

    deployment: str
    generation: int
    state: DeploymentState
    active_requests: int
    queued_requests: int
    engine: str | None = None
    engine_version: str | None = None
    driver_availability: str | None = None
    artifact_digest: str | None = None
    selected_devices: tuple[int, ...] = ()
    memory: dict[str, int] | None = None
    port: int | None = None
    reason_code: str | None = None
    job_id: str | None = None
    last_error: str | None = None
    replica: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    routable: bool = False
    crash_looped: bool = False
    desired_replicas: int = 1
    configured_engine: str = "llama_cpp"
    keep_alive_secs: int | None = None

    def availability(self) -> dict[str, object]:
        """``{state: ready|cold|unavailable, ready_replicas, desired_replicas}`` as the
        gateway's model listing shows it."""
        if self.routable:
            state = "ready"
        elif self.crash_looped or self.state in (DeploymentState.FAILED, DeploymentState.DRAINING):
            state = "unavailable"
        else:
            state = "cold"
        return {
            "state": state,
            "ready_replicas": int(self.routable),
            "desired_replicas": self.desired_replicas,
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the status route."""
        return {
            "deployment": self.deployment,
            "replica": self.replica,
            "generation": self.generation,
            "state": self.state.value,
            "active_requests": self.active_requests,
            "queued_requests": self.queued_requests,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "driver_availability": self.driver_availability,
            "artifact_digest": self.artifact_digest,
            "selected_devices": list(self.selected_devices),
            "memory": self.memory,
            "port": self.port,
            "reason_code": self.reason_code,
            "job_id": self.job_id,
            "last_error": bounded(self.last_error),
            **self.extra,
        }
