"""Which cached artifacts removal and collection must leave alone, and why.

Shared by the admin cache routes and the console's cache page; the runtime answers from its
own state (:meth:`RuntimeManager.artifact_protection`).
"""

from __future__ import annotations

from sbproxy.model_host.runtime.manager import RuntimeManager

__all__ = ["protection", "resident_digests"]


def resident_digests(manager: RuntimeManager) -> set[str]:
    """Artifact digests of ready deployments."""
    return manager.resident_digests()


def protection(manager: RuntimeManager) -> dict[str, str]:
    """Digests removal and collection must not touch, with the reason (resident wins):
    ``configured`` (every deployment's artifact) or ``resident`` (a ready one's)."""
    return manager.artifact_protection()
