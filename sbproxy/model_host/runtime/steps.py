"""The effects the durable steps and reloads ask of the runtime: :class:`RuntimeSteps`,
the :class:`~sbproxy.model_host.runtime.port.RuntimePort` of the ``load``, ``drain`` and
``reset`` steps (resolve, pull, acquire the engine, launch, drain, reset, observe)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

from sbproxy.catalog import ResolvedArtifact
from sbproxy.model_host.engines import provision_llama_cpp
from sbproxy.model_host.flows.pull import PullOutput
from sbproxy.model_host.runtime.commands import CommandKind
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.definitions import deployment_digest
from sbproxy.model_host.runtime.jobs import pull_artifact
from sbproxy.model_host.runtime.launches import Launches
from sbproxy.model_host.runtime.port import Launched
from sbproxy.model_host.runtime.retire import Retirement
from sbproxy.workflows import WorkflowEngine, process_start_ticks

__all__ = ["RuntimeSteps"]


class RuntimeSteps:
    """The :class:`~sbproxy.model_host.runtime.port.RuntimePort` over the runtime: what the
    ``load``, ``drain`` and ``reset`` steps may do, and nothing else; it owns no state."""

    def __init__(
        self, context: RuntimeContext, *, launches: Launches, retirement: Retirement
    ) -> None:
        self._context = context
        self._launches = launches
        self._retirement = retirement

    @property
    def engine(self) -> WorkflowEngine:
        """The workflow engine the jobs are journaled in."""
        return self._context.engine

    def definition_digest(self, deployment: str) -> str:
        """See :meth:`RuntimePort.definition_digest`."""
        return deployment_digest(self._context.deployment(deployment).config)

    def step_scope(
        self, job_id: str, deployment: str, kind: CommandKind
    ) -> AbstractAsyncContextManager[None]:
        """See :meth:`CommandLanes.step_scope`."""
        return self._context.lanes.step_scope(job_id, deployment, kind)

    def resolve(self, deployment: str) -> ResolvedArtifact:
        """Resolve the deployment's exact artifact on this worker (and remember it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
        """
        context = self._context
        found = context.deployment(deployment)
        artifact = context.resolve_config(found.config, context.catalog)
        found.use_artifact(artifact)
        return artifact

    async def pull(
        self, deployment: str, artifact: ResolvedArtifact, intent: str | None = None
    ) -> PullOutput:
        """Make ``artifact`` (remembered as the deployment's) verified in the cache through
        its pull job, with the deployment's pull policy (``on_boot``: a startup pull).

        Raises:
            SbproxyError: the pull job's failure (``manual_artifact_missing``, ...).
        """
        context = self._context
        found = context.deployment(deployment)
        found.use_artifact(artifact)
        policy = str(found.config.pull)
        intent = intent or ("startup" if policy == "on_boot" else "runtime")
        return await pull_artifact(
            context.engine, context.catalog, artifact, pull_policy=policy, intent=intent
        )

    async def provision_engine(self) -> Path:
        """Find or acquire the llama-server executable (``engines.llama_cpp``).

        Raises:
            EngineError: acquisition failures.
        """
        context = self._context
        host = context.compiled.model_host
        config = host.engines.llama_cpp if host else None
        return await provision_llama_cpp(
            config, engine=context.engine, layout_root=context.layout.root
        )

    async def launch(
        self, deployment: str, artifact: ResolvedArtifact, executable: Path, *, job_id: str
    ) -> Launched:
        """See :meth:`Launches.launch_generation`."""
        found = self._context.deployment(deployment)
        found.use_artifact(artifact)
        port = await self._launches.launch_generation(found, executable=executable, job_id=job_id)
        process = found.process
        return Launched(
            generation=found.generation,
            port=port,
            pid=process.pid if process else None,
            start_ticks=process.start_ticks if process else None,
        )

    async def drain(self, deployment: str, *, job_id: str, reason: str | None) -> dict[str, object]:
        """See :meth:`Retirement.drain_deployment`."""
        found = self._context.deployment(deployment)
        return await self._retirement.drain_deployment(found, job_id=job_id, reason=reason)

    async def reset(self, deployment: str, *, job_id: str) -> tuple[bool, str]:
        """Clear a retained failure so the deployment may launch again (backoff too);
        ``(cleared, state)``. A deployment that has not failed has nothing to reset.

        Raises:
            SbproxyError: ``draining`` while it is preparing or draining.
        """
        found = self._context.deployment(deployment)
        cleared = found.reset(job_id=job_id)
        await self._context.publish()
        return cleared, found.state.value

    def observe(
        self, deployment: str, *, generation: int, pid: int | None, start_ticks: str | None
    ) -> bool:
        """Whether a journaled launch still describes a live engine of ours: the deployment
        runs that generation, its child is that pid with those start ticks, and it is
        routable. After a host restart this is false, and the launch runs again."""
        found = self._context.live.get(deployment)
        if found is None or found.generation != generation or not found.routable():
            return False
        process = found.process
        assert process is not None  # noqa: S101 - routable deployments have a process
        return (
            process.pid == pid
            and process.start_ticks == start_ticks
            and process_start_ticks(process.pid) == start_ticks
        )
