"""The runtime's read side: :class:`Snapshots` turns live deployments into frozen values
for readers outside the runtime (statuses, tallies, protected digests, routing facts)."""

from __future__ import annotations

from sbproxy.catalog import ResolvedArtifact
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.state import DeploymentStatus
from sbproxy.model_host.runtime.upstream import RuntimeTallies

__all__ = ["Snapshots"]


class Snapshots:
    """Frozen views of the runtime's live state; it changes nothing and owns no state."""

    def __init__(self, context: RuntimeContext) -> None:
        self._context = context

    def _status_of(self, found: Deployment) -> DeploymentStatus:
        routable = found.routable()
        process = found.process
        config = found.config
        return DeploymentStatus(
            deployment=found.deployment,
            generation=found.generation,
            state=found.state,
            active_requests=found.gate.active,
            queued_requests=found.gate.queued,
            engine="llama_cpp" if found.executable else None,
            engine_version=None,
            driver_availability="available" if found.executable else None,
            artifact_digest=found.artifact.digest if found.artifact else None,
            selected_devices=self._context.reserved_devices(found),
            memory=found.estimate.to_dict() if found.estimate else None,
            port=found.port if routable else None,
            reason_code=found.reason_code,
            job_id=found.job_id,
            last_error=found.last_error,
            extra={
                "engine_pid": process.pid if routable and process else None,
                "keep_alive_expires_in_s": self._keep_alive_left_s(found),
            },
            routable=routable,
            crash_looped=found.crash is not None,
            desired_replicas=config.replica_count,
            configured_engine=str(config.engine),
            keep_alive_secs=config.keep_alive_secs,
        )

    def _keep_alive_left_s(self, found: Deployment) -> float | None:
        """Seconds until an idle ready deployment's keep-alive stops it (on the runtime's
        clock); ``None`` while it is busy, not ready, or has no keep-alive."""
        keep_alive = found.config.keep_alive_secs
        gate = found.gate
        released = gate.last_released_at
        if keep_alive is None or released is None or not found.routable():
            return None
        if gate.active or gate.queued:
            return None
        return round(max(0.0, keep_alive - (self._context.clock.now() - released)), 1)

    def status(self) -> list[DeploymentStatus]:
        """Every deployment's status (a frozen snapshot), sorted by id."""
        live = self._context.live
        return [self._status_of(live[name]) for name in sorted(live)]

    def snapshot(self, deployment: str) -> DeploymentStatus:
        """One deployment's status now (frozen).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        return self._status_of(self._context.deployment(deployment))

    def artifact_protection(self) -> dict[str, str]:
        """Artifact digests removal and collection must not touch, with the reason:
        ``configured`` (every deployment's artifact -- the one it resolved, else resolved
        now; one that does not resolve protects nothing) or ``resident`` (a ready one's,
        which wins)."""
        context = self._context
        protected: dict[str, str] = {}
        for found in context.live.values():
            digest = found.artifact.digest if found.artifact is not None else None
            if digest is None:
                try:
                    digest = context.resolve_config(found.config, context.catalog).digest
                except SbproxyError:
                    continue
            protected[digest] = "configured"
        for digest in self.resident_digests():
            protected[digest] = "resident"
        return protected

    def tallies_snapshot(self) -> RuntimeTallies:
        """The runtime's metric tallies now (a copy: transitions, swap waits)."""
        return self._context.tallies.copy()

    def resident_digests(self) -> set[str]:
        """Artifact digests of ready deployments."""
        return {
            found.artifact.digest
            for found in self._context.live.values()
            if found.routable() and found.artifact is not None
        }

    def _artifact_of(self, deployment: str) -> ResolvedArtifact | None:
        context = self._context
        found = context.deployment(deployment)
        if found.artifact is not None:
            return found.artifact
        try:
            return context.resolve_config(found.config, context.catalog)
        except SbproxyError:
            return None  # reported by the load; routing decides nothing from it

    def can_chat(self, deployment: str) -> bool:
        """Whether ``deployment`` serves chat completions: its catalog variant has a chat
        template (``chat_template`` is not ``none``).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        artifact = self._artifact_of(deployment)
        return artifact is None or artifact.can_chat

    def output_limit(self, deployment: str) -> int:
        """``max_tokens`` for a request of ``deployment`` that sets none: its
        ``max_output_tokens``, never more than its context length (``max_context``, else
        the catalog's).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        config = self._context.deployment(deployment).config
        limit = config.max_output_tokens
        context = config.max_context
        if context is None:
            artifact = self._artifact_of(deployment)
            context = artifact.context_length if artifact is not None else None
        return max(1, min(limit, context)) if context else limit

    def engine_pids(self) -> set[int]:
        """Pids of every live engine child the runtime holds (current and staged)."""
        return {p.pid for p in self._context.engines() if p.alive()}
