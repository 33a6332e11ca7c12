"""Launch and supervision policy as tables: pure functions, no process, no clock."""

from __future__ import annotations

import pytest

from sbproxy.config import DeploymentConfig
from sbproxy.model_host.runtime.admission import AdmissionGate
from sbproxy.model_host.runtime.launcher import Probe
from sbproxy.model_host.runtime.policy import (
    HEALTH_MISSES,
    PORT_RETRIES,
    SWAP_RECHECK_S,
    Attempts,
    ProbeVerdict,
    SwapDecision,
    SwapVerdict,
    Verdict,
    after_failed_spawn,
    after_no_room,
    after_probe,
    backoff_of,
    jittered,
    keep_alive_due,
    restart_delay,
    start_timeout_s,
)
from sbproxy.model_host.runtime.state import DeploymentState, LaunchBackoff

BACKOFF = LaunchBackoff(base_s=1.0, max_s=4.0, max_attempts=3)


@pytest.mark.parametrize(
    ("before", "code", "retryable", "verdict", "after", "delay_s"),
    [
        # A port another process took: a fresh one at once, not counted, up to the limit.
        (Attempts(), "engine_port_lost", True, Verdict.RETRY_PORT, Attempts(0, 1, None), 0.0),
        (
            Attempts(0, PORT_RETRIES, None),
            "engine_port_lost",
            True,
            Verdict.RETRY,
            Attempts(1, PORT_RETRIES, 500),
            0.75,
        ),
        # Early exits retry after the jittered backoff until max_launch_attempts.
        (Attempts(), "engine_early_exit", True, Verdict.RETRY, Attempts(1, 0, 500), 0.75),
        (Attempts(1, 0, 100), "engine_early_exit", True, Verdict.RETRY, Attempts(2, 0, 100), 1.5),
        (
            Attempts(2, 0, 100),
            "engine_early_exit",
            True,
            Verdict.CRASH_LOOP,
            Attempts(3, 0, 100),
            0,
        ),
        # A failure the engine calls final is a crash loop at once.
        (Attempts(), "engine_spawn_failed", False, Verdict.CRASH_LOOP, Attempts(1, 0, 500), 0.0),
        # No /health within start_timeout_ms: start_timeout, never a crash loop.
        (
            Attempts(),
            "engine_readiness_timeout",
            True,
            Verdict.START_TIMEOUT,
            Attempts(1, 0, 500),
            0,
        ),
    ],
)
def test_after_a_failed_spawn(
    before: Attempts,
    code: str,
    retryable: bool,
    verdict: Verdict,
    after: Attempts,
    delay_s: float,
) -> None:
    decision = after_failed_spawn(
        before, code=code, retryable=retryable, backoff=BACKOFF, sample=0.5, now_ms=500
    )
    assert (decision.verdict, decision.attempts, decision.delay_s) == (verdict, after, delay_s)


@pytest.mark.parametrize(
    ("delay_s", "sample", "expected"), [(2.0, 0.0, 1.0), (2.0, 0.5, 1.5), (2.0, 0.999, 1.999)]
)
def test_equal_jitter_keeps_half_the_delay(delay_s: float, sample: float, expected: float) -> None:
    assert jittered(delay_s, sample) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("failures", "expected"), [(0, 0.5), (1, 0.5), (2, 1.0), (3, 2.0), (9, 2.0)]
)
def test_the_restart_delay_doubles_up_to_its_cap(failures: int, expected: float) -> None:
    assert restart_delay(BACKOFF, failures, 0.0) == expected


def test_the_backoff_comes_from_the_definition_unless_the_host_sets_one() -> None:
    config = DeploymentConfig.model_validate(
        {
            "model": "tiny",
            "variant": "q4_k_m",
            "restart_backoff_initial_ms": 250,
            "restart_backoff_max_ms": 8000,
            "max_launch_attempts": 7,
            "start_timeout_ms": 90_000,
        }
    )
    assert backoff_of(config) == LaunchBackoff(base_s=0.25, max_s=8.0, max_attempts=7)
    assert backoff_of(config, BACKOFF) is BACKOFF
    assert start_timeout_s(config, None) == 90.0
    assert start_timeout_s(config, 20.0) == 20.0


@pytest.mark.parametrize(
    ("health", "holder", "misses", "verdict", "why"),
    [
        ("ready", "ours", 2, ProbeVerdict.HEALTHY, None),
        ("stopped", "none", 0, ProbeVerdict.LOST, "the engine exited"),
        ("unhealthy", "ours", 0, ProbeVerdict.MISSED, None),
        ("unhealthy", "ours", HEALTH_MISSES - 2, ProbeVerdict.MISSED, None),
        (
            "unhealthy",
            "ours",
            HEALTH_MISSES - 1,
            ProbeVerdict.LOST,
            "the engine stopped answering /health",
        ),
        (
            "unhealthy",
            "foreign",
            HEALTH_MISSES - 1,
            ProbeVerdict.LOST,
            "its port is held by another process",
        ),
    ],
)
def test_after_a_probe(
    health: str, holder: str, misses: int, verdict: ProbeVerdict, why: str | None
) -> None:
    probe = Probe(health=health, holder=holder)  # type: ignore[arg-type]
    assert after_probe(probe, misses) == (verdict, why)


def _gate(*, released_at: float | None, active: bool = False) -> AdmissionGate:
    clock = iter([released_at or 0.0] * 10)
    gate = AdmissionGate(
        "tiny", max_active=2, max_queue=1, queue_timeout_s=1.0, clock=lambda: next(clock)
    )
    if released_at is not None:
        gate.mark_idle()
    if active:
        gate.try_admit()
    return gate


@pytest.mark.parametrize(
    ("state", "pending", "released_at", "active", "keep_alive", "now", "due"),
    [
        (DeploymentState.READY, False, 100.0, False, 60, 160.0, True),
        (DeploymentState.READY, False, 100.0, False, 60, 159.9, False),
        (DeploymentState.READY, True, 100.0, False, 60, 500.0, False),  # a command pending
        (DeploymentState.READY, False, 100.0, True, 60, 500.0, False),  # busy
        (DeploymentState.READY, False, None, False, 60, 500.0, False),  # never idle
        (DeploymentState.READY, False, 100.0, False, None, 500.0, False),  # no keep-alive
        (DeploymentState.PREPARING, False, 100.0, False, 60, 500.0, False),
    ],
)
def test_keep_alive_expiry(
    state: DeploymentState,
    pending: bool,
    released_at: float | None,
    active: bool,
    keep_alive: int | None,
    now: float,
    due: bool,
) -> None:
    gate = _gate(released_at=released_at, active=active)
    assert (
        keep_alive_due(state, commands_pending=pending, gate=gate, keep_alive_s=keep_alive, now=now)
        is due
    )


@pytest.mark.parametrize(
    ("blockers", "started", "now", "timeout_s", "expected"),
    [
        # Busy generations in the way and time left: hold them and look again soon.
        (1, 10.0, 10.0, 5.0, SwapDecision(SwapVerdict.WAIT, 0.0, wait_s=SWAP_RECHECK_S)),
        (2, 10.0, 12.0, 5.0, SwapDecision(SwapVerdict.WAIT, 2.0, wait_s=SWAP_RECHECK_S)),
        # Less left than a recheck: wait only what is left of the queue timeout.
        (1, 0.0, 4.875, 5.0, SwapDecision(SwapVerdict.WAIT, 4.875, wait_s=0.125)),
        # The wait ran out: insufficient_capacity, retryable after one queue timeout.
        (
            1,
            10.0,
            15.0,
            5.0,
            SwapDecision(SwapVerdict.REFUSE, 5.0, retryable=True, retry_after_ms=5000),
        ),
        (
            1,
            10.0,
            40.0,
            5.0,
            SwapDecision(SwapVerdict.REFUSE, 30.0, retryable=True, retry_after_ms=5000),
        ),
        # Nothing that idles would make room (pinned, or too large): refused at once, final.
        (
            0,
            10.0,
            10.0,
            5.0,
            SwapDecision(SwapVerdict.REFUSE, 0.0, retryable=False, retry_after_ms=5000),
        ),
        # A queue timeout under a second still asks for a one-second Retry-After.
        (
            1,
            0.0,
            0.2,
            0.2,
            SwapDecision(SwapVerdict.REFUSE, 0.2, retryable=True, retry_after_ms=1000),
        ),
        # A zero queue timeout never waits.
        (
            3,
            0.0,
            0.0,
            0.0,
            SwapDecision(SwapVerdict.REFUSE, 0.0, retryable=True, retry_after_ms=1000),
        ),
    ],
)
def test_after_no_room(
    blockers: int, started: float, now: float, timeout_s: float, expected: SwapDecision
) -> None:
    assert (
        after_no_room(busy_blockers=blockers, started=started, now=now, timeout_s=timeout_s)
        == expected
    )
