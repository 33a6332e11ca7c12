# mypy: disable-error-code="misc"
# (mixin methods take the manager as an explicit `self: RuntimeManager`; mypy files that
# under "misc" because the manager is a subclass, not a supertype, of the mixin)
"""The runtime manager's reload side: staging candidate generations, rolling them back, and
applying a committed candidate in one step (``runtime/reload.py`` writes no slot itself).

A mixin of :class:`~sbproxy.model_host.runtime.manager.RuntimeManager` (one owner, split by
verb group); every method takes the manager as ``self``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from sbproxy.catalog import Catalog, ResolvedArtifact
from sbproxy.config import CompiledConfig, DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.slot import Slot, new_slot
from sbproxy.model_host.runtime.state import DeploymentState

if TYPE_CHECKING:
    from sbproxy.model_host.runtime.manager import RuntimeManager

logger = logging.getLogger(__name__)

__all__ = ["StagingMixin"]


class StagingMixin:
    """Reload staging of the runtime manager (see the module docstring)."""

    # -- reload staging (runtime/reload.py calls these; it writes no slot itself) ---------

    def begin_staging(self: RuntimeManager) -> None:
        """Start staging a reload's generations: every current reservation is protected
        from eviction until :meth:`end_staging`."""
        self.staged.clear()
        self.recreated.clear()
        self.protect_all = True

    def end_staging(self: RuntimeManager) -> None:
        """Stop protecting every reservation (the staged slots stay staged)."""
        self.protect_all = False

    def stage(
        self: RuntimeManager, deployment: str, config: DeploymentConfig, artifact: ResolvedArtifact
    ) -> Slot:
        """A new, not yet routed slot for ``deployment`` (a changed or added definition)."""
        slot = new_slot(deployment, config, clock=self.clock.now)
        slot.gate.on_idle = self._capacity_changed
        slot.artifact = artifact
        self.staged[deployment] = slot
        return slot

    async def recreate_stop(self: RuntimeManager, slot: Slot, *, job_id: str) -> None:
        """Drain and stop a live generation a ``recreate`` rollout replaces, remembering
        whether it was ready (a rollback restarts it)."""
        was_ready = slot.routable()
        await self.drain_slot(slot, job_id=job_id)
        self.recreated.append((slot, was_ready))

    async def roll_back(self: RuntimeManager) -> list[str]:
        """Undo a staging: stop the staged engines, restart the generations a ``recreate``
        stopped (under their own generation numbers); the deployments discarded."""
        with anyio.CancelScope(shield=True):
            staged, recreated = dict(self.staged), list(self.recreated)
            self.staged.clear()
            self.recreated.clear()
            for slot in staged.values():
                if slot.process is not None or slot.state != DeploymentState.CONFIGURED:
                    await self.drain_slot(slot)
            for old, was_ready in recreated:
                if not was_ready or old.executable is None:
                    continue
                try:
                    await self.launch_generation(
                        old,
                        executable=old.executable,
                        job_id=old.job_id or "rollback",
                        generation=old.generation,
                    )
                except SbproxyError as exc:  # logged: the job reports the original failure
                    logger.error("rollback could not restart %s: %s", old.deployment, exc)
            self.protect_all = False
        return sorted(staged)

    def apply(
        self: RuntimeManager,
        *,
        added: Iterable[str],
        changed: Iterable[str],
        removed: Iterable[str],
        candidate: CompiledConfig,
        catalog: Catalog,
    ) -> list[Slot]:
        """Make the staged generations live and ``candidate`` the desired state, in one
        step with no await; the slots superseded or removed (still running until
        :meth:`drain_slot` retires them)."""
        staged = dict(self.staged)
        self.staged.clear()
        self.recreated.clear()
        slots = dict(self.slots)
        retired: list[Slot] = []
        for deployment in removed:
            gone = slots.pop(deployment, None)
            if gone is not None:
                retired.append(gone)
        for deployment in (*added, *changed):
            fresh = staged.get(deployment)
            if fresh is None:
                if deployment not in slots:  # resumed without staged state: start cold
                    slots[deployment] = new_slot(
                        deployment, candidate.deployments[deployment], clock=self.clock.now
                    )
                    slots[deployment].gate.on_idle = self._capacity_changed
                continue
            old = slots.get(deployment)
            if old is not None:
                retired.append(old)
            slots[deployment] = fresh
        self.slots = slots
        self.compiled = candidate
        self.catalog = catalog
        host = candidate.model_host
        self.safety_margin = host.safety_margin if host else 0.10
        if host is not None:  # policies a running host takes at once
            self.shutdown_deadline_s = host.shutdown_deadline_ms / 1000
            self.prepares.total_tokens = host.max_parallel_prepares
        return retired

    async def enforce_resident_limit(
        self: RuntimeManager, limit: int | None, *, job_id: str
    ) -> None:
        """Apply ``cache.max_resident_models``: a lowered limit evicts idle generations,
        least recently used first; with too much protected work the old limit stays
        (logged)."""
        try:
            victims = self.residency.enforce_limit(limit).victims
        except AdmissionRejected as exc:
            logger.warning("max_resident_models %s is not applied: %s", limit, exc)
            return
        for victim in victims:
            evicted = self.slots.get(victim.key.deployment)
            if evicted is not None and evicted.generation == victim.key.generation:
                await self.drain_slot(evicted, job_id=job_id)

    async def record_revision(
        self: RuntimeManager, *, content_digest: str, desired: Mapping[str, Any]
    ) -> int:
        """Record the committed desired state (a new revision only when it changed)."""
        latest = await self.runtime_store.latest_revision()
        if latest is None or latest.content_digest != content_digest:
            revision = await self.runtime_store.commit_revision(
                content_digest=content_digest, desired=dict(desired)
            )
        else:  # the same desired deployments (routes or keys may differ): no new revision
            revision = latest.revision
        self.revision = revision
        return revision
