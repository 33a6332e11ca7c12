"""Why a request is refused, read off a live deployment (``refusals.py``): pure functions,
tested without a process or a manager."""

from __future__ import annotations

import pytest

from sbproxy.config import DeploymentConfig
from sbproxy.model_host.runtime.admission import AdmissionGate, AdmissionRejected
from sbproxy.model_host.runtime.deployment import Deployment, Outbox
from sbproxy.model_host.runtime.refusals import refuse_failed, refuse_now, waited_too_long

CONFIG = DeploymentConfig.model_validate(
    {"model": "tiny", "variant": "q4_k_m", "queue_timeout_ms": 4000}
)


def fresh() -> Deployment:
    gate = AdmissionGate("tiny", max_active=1, max_queue=1, queue_timeout_s=4.0)
    return Deployment("tiny", CONFIG, gate=gate, outbox=Outbox())


def test_a_configured_deployment_is_not_refused_at_once() -> None:
    found = fresh()
    refuse_now(found)
    refuse_failed(found, now=0.0)


def test_a_draining_deployment_is_refused_at_once_as_draining() -> None:
    found = fresh()
    found.begin_drain(job_id=None, reason="stop")
    with pytest.raises(AdmissionRejected) as refused:
        refuse_now(found)
    assert refused.value.code == "draining"


def test_a_request_that_waited_out_a_swap_is_told_capacity_and_to_retry() -> None:
    found = fresh()
    found.swap_wait(True)
    refusal = waited_too_long(found, 4.0)
    assert (refusal.code, refusal.retryable, refusal.retry_after_ms) == (
        "insufficient_capacity",
        True,
        4000,
    )


def test_a_request_that_waited_for_a_slow_start_is_told_queue_timeout() -> None:
    refusal = waited_too_long(fresh(), 4.0)
    assert refusal.code == "queue_timeout"
    assert refusal.retry_after_ms is None


def test_a_load_that_failed_before_launch_refuses_its_waiters_as_unhealthy() -> None:
    found = fresh()
    found.failed_before_launch("artifact_not_ready", "not in the cache", job_id=None)
    with pytest.raises(AdmissionRejected) as refused:
        refuse_failed(found, now=0.0)
    assert refused.value.code == "engine_unhealthy"
    assert refused.value.retry_after_ms is None  # not relaunched by itself: no advice
