"""A reload's transaction on the live runtime: :class:`ReloadTransaction` stages new
generations, stops the ones a ``recreate`` rollout replaces, rolls a failed reload back,
and commits a successful one in one step (``runtime/reload.py`` drives it)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import anyio

from sbproxy.catalog import Catalog, ResolvedArtifact
from sbproxy.config import CompiledConfig, DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.launches import Launches
from sbproxy.model_host.runtime.retire import Retirement
from sbproxy.model_host.runtime.state import DeploymentState

__all__ = ["ReloadTransaction"]

logger = logging.getLogger(__name__)

S = DeploymentState


class ReloadTransaction:
    """Staging, rollback and commit of a reload; the staged state itself is the context's
    :class:`~sbproxy.model_host.runtime.staging.Staging`."""

    def __init__(
        self, context: RuntimeContext, *, launches: Launches, retirement: Retirement
    ) -> None:
        self._context = context
        self._launches = launches
        self._retirement = retirement

    def stage(
        self, deployment: str, config: DeploymentConfig, artifact: ResolvedArtifact
    ) -> Deployment:
        """A new, not yet routed deployment for ``deployment`` (a changed or added
        definition), kept in the staging."""
        fresh = self._context.new_deployment(deployment, config)
        fresh.use_artifact(artifact)
        self._context.staging.stage(fresh)
        return fresh

    async def recreate_stop(self, found: Deployment, *, job_id: str) -> None:
        """Drain and stop a live generation a ``recreate`` rollout replaces, remembering
        whether it was ready (a rollback restarts it)."""
        was_ready = found.routable()
        await self._retirement.drain_deployment(found, job_id=job_id)
        self._context.staging.recreated(found, was_ready=was_ready)

    async def roll_back(self) -> list[str]:
        """Undo a staging: stop the staged engines, restart the generations a ``recreate``
        stopped (under their own generation numbers); the deployments discarded."""
        staging = self._context.staging
        with anyio.CancelScope(shield=True):
            staged, recreated = staging.take()
            for found in staged.values():
                if found.process is not None or found.state is not S.CONFIGURED:
                    await self._retirement.drain_deployment(found)
            for old, was_ready in recreated:
                if not was_ready or old.executable is None:
                    continue
                try:
                    await self._launches.launch_generation(
                        old,
                        executable=old.executable,
                        job_id=old.job_id or "rollback",
                        generation=old.generation,
                    )
                except SbproxyError as exc:  # logged: the job reports the original failure
                    logger.error("rollback could not restart %s: %s", old.deployment, exc)
            staging.end()
        return sorted(staged)

    def apply(
        self,
        *,
        added: Iterable[str],
        changed: Iterable[str],
        removed: Iterable[str],
        candidate: CompiledConfig,
        catalog: Catalog,
    ) -> list[Deployment]:
        """Make the staged generations live and ``candidate`` the desired state, in one
        step with no await; the deployments superseded or removed (still running until
        a drain retires them)."""
        context = self._context
        staged, _ = context.staging.take()
        live = dict(context.live)
        retired: list[Deployment] = []
        for name in removed:
            gone = live.pop(name, None)
            if gone is not None:
                retired.append(gone)
        for name in (*added, *changed):
            fresh = staged.get(name)
            if fresh is None:
                if name not in live:  # resumed without staged state: start cold
                    live[name] = context.new_deployment(name, candidate.deployments[name])
                continue
            old = live.get(name)
            if old is not None:
                retired.append(old)
            live[name] = fresh
        context.live = live
        context.compiled = candidate
        context.catalog = catalog
        context.take_host_policies(candidate)
        self._launches.take_policies(candidate)
        return retired

    async def enforce_resident_limit(self, limit: int | None, *, job_id: str) -> None:
        """Apply ``cache.max_resident_models``: a lowered limit evicts idle generations,
        least recently used first; with too much protected work the old limit stays
        (logged)."""
        context = self._context
        try:
            victims = context.residency.enforce_limit(limit).victims
        except AdmissionRejected as exc:
            logger.warning("max_resident_models %s is not applied: %s", limit, exc)
            return
        for victim in victims:
            evicted = context.current(victim.key)
            if evicted is not None:
                await self._retirement.drain_deployment(evicted, job_id=job_id)

    async def record_revision(self, *, content_digest: str, desired: Mapping[str, Any]) -> int:
        """Record the committed desired state (a new revision only when it changed)."""
        context = self._context
        store = context.runtime_store
        latest = await store.latest_revision()
        if latest is None or latest.content_digest != content_digest:
            revision = await store.commit_revision(
                content_digest=content_digest, desired=dict(desired)
            )
        else:  # the same desired deployments (routes or keys may differ): no new revision
            revision = latest.revision
        context.revision = revision
        return revision
