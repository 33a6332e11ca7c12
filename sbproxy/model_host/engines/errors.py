"""Errors of engine drivers and supervision (the reference's engine reason codes)."""

from __future__ import annotations

from sbproxy.errors import SbproxyError

__all__ = ["EngineError"]


class EngineError(SbproxyError):
    """An engine could not be detected, provisioned, launched, probed or stopped.

    Codes: ``engine_blocked`` (policy or an incomplete pin), ``engine_incompatible``,
    ``engine_provision_failed``, ``artifact_not_ready``, ``unsafe_argument``,
    ``engine_spawn_failed``, ``engine_early_exit`` (retryable), ``engine_readiness_timeout``
    (retryable), ``engine_health_failed``, ``engine_shutdown_failed``, ``engine_internal``.
    ``details`` may carry ``stderr_tail`` (bounded, redacted).
    """

    default_code = "engine_internal"
