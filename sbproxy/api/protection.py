"""Which cached artifacts removal and collection must leave alone, and why.

Shared by the admin cache routes and the console's cache page.
"""

from __future__ import annotations

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.manager import RuntimeManager

__all__ = ["protection", "resident_digests"]


def resident_digests(manager: RuntimeManager) -> set[str]:
    """Artifact digests of ready deployments."""
    return {
        slot.artifact.digest
        for slot in manager.slots.values()
        if slot.routable() and slot.artifact is not None
    }


def protection(manager: RuntimeManager) -> dict[str, str]:
    """Digests removal and collection must not touch, with the reason (resident wins).

    Configured: every deployment's artifact (the one its slot resolved, else resolved now
    against the catalog; a deployment that does not resolve protects nothing). Resident:
    the artifact of a ready deployment.
    """
    protected: dict[str, str] = {}
    for slot in manager.slots.values():
        digest = slot.artifact.digest if slot.artifact is not None else None
        if digest is None:
            try:
                digest = manager.resolve_config(slot.config, manager.catalog).digest
            except SbproxyError:
                continue
        protected[digest] = "configured"
    for digest in resident_digests(manager):
        protected[digest] = "resident"
    return protected
