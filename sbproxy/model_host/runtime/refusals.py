"""Why a request (or a load) is refused, read off a live deployment: pure functions that
build the :class:`~sbproxy.model_host.runtime.admission.AdmissionRejected` with its reason
code, message and retry advice (no I/O, no waiting)."""

from __future__ import annotations

from sbproxy.model_host.runtime.admission import AdmissionReason, AdmissionRejected, reject
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.state import DeploymentState

__all__ = ["exhausted_refusal", "refuse_failed", "refuse_now", "waited_too_long"]

S = DeploymentState

# Failure reasons after which the runtime relaunches the engine by itself (after its
# restart backoff): a request refused meanwhile is told to retry.
_RELAUNCHED = frozenset({"engine_health_failed", "engine_unhealthy"})


def exhausted_refusal(found: Deployment) -> AdmissionRejected:
    """Why ``found`` is not loaded while its exhausted load job holds it failed
    (``crash_loop``)."""
    return reject(
        AdmissionReason.CRASH_LOOP,
        f"{found.deployment} is held failed: its load job {found.exhausted_job} ended "
        f"recovery_exhausted ({found.last_error}); once the cause is fixed, a reset "
        f"(POST /admin/model-host/reset) or `sbproxy models load {found.deployment}` "
        "tries again",
        deployment=found.deployment,
    )


def refuse_now(found: Deployment) -> None:
    """Refuse at once what waiting cannot help: an operator's stop or drain, a crash
    loop, an exhausted load. An eviction (:attr:`Deployment.evicting`) is waited out.

    Raises:
        AdmissionRejected: ``crash_loop`` or ``draining``.
    """
    if found.exhausted_job is not None:
        raise exhausted_refusal(found)
    if (found.state is S.DRAINING and not found.evicting) or found.gate.draining:
        raise reject(
            AdmissionReason.DRAINING,
            f"{found.deployment} is draining",
            deployment=found.deployment,
        )
    if found.crash is not None:
        raise reject(
            AdmissionReason.CRASH_LOOP,
            f"{found.deployment} is crash-looped: {found.crash.last_error}",
            deployment=found.deployment,
        )


def refuse_failed(found: Deployment, *, now: float) -> None:
    """After a wake-up: refuse when the load this request waited for failed (``now`` on
    the runtime's clock, for the retry advice of an engine that is relaunched).

    Raises:
        AdmissionRejected: as :func:`refuse_now`, ``insufficient_capacity`` or
            ``engine_unhealthy``.
        SbproxyError: the journal's fault that stopped the load
            (:attr:`~sbproxy.model_host.runtime.deployment.Deployment.load_refusal`:
            ``journal_unavailable``, 503, retryable).
    """
    if found.crash is not None or found.state is S.DRAINING:
        refuse_now(found)
    if found.load_refusal is not None:
        raise found.load_refusal  # the journal is away: 503 journal_unavailable, retryable
    if found.state is not S.FAILED:
        return
    if found.reason_code == AdmissionReason.INSUFFICIENT_CAPACITY.value:
        raise reject(
            AdmissionReason.INSUFFICIENT_CAPACITY,
            found.last_error or "the deployment does not fit",
            deployment=found.deployment,
            retry_after_ms=max(1000, found.config.queue_timeout_ms),
            retryable=found.capacity_retryable,
        )
    # An engine that died or stopped answering is relaunched after its backoff (no
    # crash loop yet): the refusal says when to come back, like any passing refusal.
    relaunching = found.reason_code in _RELAUNCHED
    raise reject(
        AdmissionReason.ENGINE_UNHEALTHY,
        found.last_error or "the engine failed",
        deployment=found.deployment,
        retry_after_ms=max(1000, int((found.not_before - now) * 1000)) if relaunching else None,
        retryable=True if relaunching else None,
    )


def waited_too_long(found: Deployment, timeout_s: float) -> AdmissionRejected:
    """The refusal of a request that waited ``timeout_s`` seconds: ``insufficient_capacity``
    while its launch waits for a busy generation to go idle, else ``queue_timeout``."""
    if found.swap_waiting:  # its launch still waits for a busy generation
        return reject(
            AdmissionReason.INSUFFICIENT_CAPACITY,
            f"{found.deployment} waited {timeout_s:g} s for a busy resident model to go "
            "idle so that it could be swapped in; retry later",
            deployment=found.deployment,
            retry_after_ms=max(1000, found.config.queue_timeout_ms),
            retryable=True,  # busy, not too big: the swap fits once that model idles
        )
    return reject(
        AdmissionReason.QUEUE_TIMEOUT,
        f"{found.deployment} did not become ready within {timeout_s:g} s",
        deployment=found.deployment,
    )
