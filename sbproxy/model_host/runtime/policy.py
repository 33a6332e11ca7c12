"""Launch and supervision policy as pure functions: (state, observations, clock) -> decision.

Nothing here starts a process, sleeps or reads a clock; the runtime manager feeds in what it
saw and carries out what comes back, so every rule is table-tested without an engine:

* :func:`after_failed_spawn` -- a launch attempt failed: retry on a fresh port (a port
  another process took, up to :data:`PORT_RETRIES`, not counted), retry after the backoff
  (jittered), fail with ``start_timeout``, or hold the deployment in ``crash_loop`` after
  ``max_launch_attempts``;
* :func:`jittered`, :func:`restart_delay` -- equal jitter over the exponential backoff;
* :func:`start_timeout_s` -- the readiness bound of one launch;
* :func:`after_probe` -- a maintenance probe's outcome: healthy, one more miss, or lost
  (after :data:`HEALTH_MISSES` misses, or at once when the engine exited);
* :func:`keep_alive_due` -- whether an idle ready deployment's keep-alive ran out;
* :func:`after_no_room` -- a reservation did not fit: wait for the busy generations that
  block it to go idle (a swap wait, looked at again every :data:`SWAP_RECHECK_S`), or refuse
  with ``insufficient_capacity`` -- retryable after one queue timeout when busy generations
  were in the way (the wait ran out), final when nothing could make room.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from sbproxy.config import DeploymentConfig
from sbproxy.model_host.runtime.admission import AdmissionGate, keep_alive_expired
from sbproxy.model_host.runtime.launcher import Probe
from sbproxy.model_host.runtime.state import DeploymentState, LaunchBackoff

__all__ = [
    "HEALTH_MISSES",
    "PORT_RETRIES",
    "SWAP_RECHECK_S",
    "Attempts",
    "LaunchDecision",
    "ProbeVerdict",
    "SwapDecision",
    "SwapVerdict",
    "Verdict",
    "after_failed_spawn",
    "after_no_room",
    "after_probe",
    "backoff_of",
    "jittered",
    "keep_alive_due",
    "restart_delay",
    "start_timeout_s",
]

# Retries on a fresh port when another process took the chosen one before the engine bound
# it; they do not count as failed launches.
PORT_RETRIES = 3

# A non-ready answer is re-probed this many times before the engine is declared unhealthy
# (reference 7.6: a single missed probe never fails a ready engine).
HEALTH_MISSES = 3

# Longest a swap waits before it re-reads which resident generations block it, seconds (a
# blocker that starts serving meanwhile must be held).
SWAP_RECHECK_S = 0.25


def backoff_of(config: DeploymentConfig, override: LaunchBackoff | None = None) -> LaunchBackoff:
    """A deployment's launch and restart backoff (``override`` when the host sets one)."""
    if override is not None:
        return override
    return LaunchBackoff(
        base_s=config.restart_backoff_initial_ms / 1000,
        max_s=config.restart_backoff_max_ms / 1000,
        max_attempts=config.max_launch_attempts,
    )


def jittered(delay_s: float, sample: float) -> float:
    """Equal jitter: half of ``delay_s`` fixed, half scaled by ``sample`` in ``[0, 1)``."""
    return delay_s / 2 + delay_s / 2 * sample


def restart_delay(backoff: LaunchBackoff, failures: int, sample: float) -> float:
    """Seconds before relaunching after failure number ``failures`` (1-based), jittered."""
    return jittered(backoff.delay(max(1, failures)), sample)


def start_timeout_s(config: DeploymentConfig, cap_s: float | None) -> float:
    """One launch's readiness bound in seconds: ``start_timeout_ms``, at most ``cap_s``."""
    bound = config.start_timeout_ms / 1000
    return bound if cap_s is None else min(bound, cap_s)


@dataclass(frozen=True, slots=True)
class Attempts:
    """What a launch has been through so far.

    Attributes:
        failed: Launches that failed (port losses within the retries do not count).
        port_retries: Fresh ports tried after another process took one.
        first_failure_ms: Wall-clock ms of the first counted failure.
    """

    failed: int = 0
    port_retries: int = 0
    first_failure_ms: int | None = None


class Verdict(StrEnum):
    """What to do after a failed launch attempt."""

    RETRY_PORT = "retry_port"
    RETRY = "retry"
    START_TIMEOUT = "start_timeout"
    CRASH_LOOP = "crash_loop"


@dataclass(frozen=True, slots=True)
class LaunchDecision:
    """:func:`after_failed_spawn`'s answer: the verdict, the attempts after this failure
    and, for ``retry``, the seconds to wait first."""

    verdict: Verdict
    attempts: Attempts
    delay_s: float = 0.0


def after_failed_spawn(
    attempts: Attempts,
    *,
    code: str,
    retryable: bool,
    backoff: LaunchBackoff,
    sample: float,
    now_ms: int,
) -> LaunchDecision:
    """Decide after a launch attempt failed with ``code`` (``retryable`` as the engine
    said), given the ``attempts`` before it, the backoff, a jitter ``sample`` in ``[0, 1)``
    and the wall clock (ms)."""
    if code == "engine_port_lost" and attempts.port_retries < PORT_RETRIES:
        return LaunchDecision(
            Verdict.RETRY_PORT, replace(attempts, port_retries=attempts.port_retries + 1)
        )
    counted = replace(
        attempts,
        failed=attempts.failed + 1,
        first_failure_ms=attempts.first_failure_ms or now_ms,
    )
    if code == "engine_readiness_timeout":
        return LaunchDecision(Verdict.START_TIMEOUT, counted)
    if retryable and counted.failed < backoff.max_attempts:
        return LaunchDecision(
            Verdict.RETRY, counted, jittered(backoff.delay(counted.failed), sample)
        )
    return LaunchDecision(Verdict.CRASH_LOOP, counted)


class ProbeVerdict(StrEnum):
    """What a maintenance probe of a ready engine means."""

    HEALTHY = "healthy"
    MISSED = "missed"
    LOST = "lost"


def after_probe(probe: Probe, misses: int) -> tuple[ProbeVerdict, str | None]:
    """Judge one probe, given the consecutive misses *before* it; ``(verdict, why)`` where
    ``why`` says what was lost. An exit is lost at once; a foreign port holder or a silent
    ``/health`` after :data:`HEALTH_MISSES` misses in a row."""
    if probe.health == "stopped":
        return ProbeVerdict.LOST, "the engine exited"
    if probe.health == "ready":
        return ProbeVerdict.HEALTHY, None
    if misses + 1 < HEALTH_MISSES:
        return ProbeVerdict.MISSED, None
    if probe.holder == "foreign":
        return ProbeVerdict.LOST, "its port is held by another process"
    return ProbeVerdict.LOST, "the engine stopped answering /health"


def keep_alive_due(
    state: DeploymentState,
    *,
    commands_pending: bool,
    gate: AdmissionGate,
    keep_alive_s: float | None,
    now: float,
) -> bool:
    """Whether a deployment should be stopped for keep-alive now: ready, no command
    pending, and its gate idle for ``keep_alive_s`` (see :func:`keep_alive_expired`)."""
    return (
        state is DeploymentState.READY
        and not commands_pending
        and keep_alive_expired(gate, keep_alive_s, now)
    )


class SwapVerdict(StrEnum):
    """What to do when a reservation does not fit now."""

    WAIT = "wait"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class SwapDecision:
    """:func:`after_no_room`'s answer.

    Attributes:
        verdict: Wait (hold the blockers, look again) or refuse.
        waited_s: Seconds the reservation has waited so far.
        wait_s: For ``wait``: the longest to wait before looking again, seconds.
        retryable: For ``refuse``: whether a retry can succeed (busy generations were in the
            way; they may be idle by then), so the refusal is a 503 with ``Retry-After``.
        retry_after_ms: For ``refuse``: when to look again, ms (one queue timeout, at least
            one second).
    """

    verdict: SwapVerdict
    waited_s: float
    wait_s: float = 0.0
    retryable: bool = False
    retry_after_ms: int = 0


def after_no_room(
    *, busy_blockers: int, started: float, now: float, timeout_s: float
) -> SwapDecision:
    """Decide after a reservation found no room, given how many busy or transient
    generations block it (``0``: nothing that idles would make room -- pinned deployments,
    or an estimate larger than the device), when the reservation started and the runtime's
    clock now (seconds), and the deployment's queue timeout (seconds).

    Waiting is bounded by the queue timeout: past it, a swap wait is refused like a request
    that queued too long (issue 22: 503 ``insufficient_capacity``, retryable, with
    ``Retry-After``).
    """
    waited = now - started
    left = timeout_s - waited
    if busy_blockers and left > 0:
        return SwapDecision(SwapVerdict.WAIT, waited, wait_s=min(left, SWAP_RECHECK_S))
    return SwapDecision(
        SwapVerdict.REFUSE,
        waited,
        retryable=busy_blockers > 0,
        retry_after_ms=max(1000, round(timeout_s * 1000)),
    )
