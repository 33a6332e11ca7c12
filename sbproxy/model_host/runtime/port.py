"""What the runtime's durable steps may ask of the runtime: :class:`RuntimePort`.

The ``load``, ``drain`` and ``reset`` jobs (``runtime/jobs.py``) take this narrow port from
their context (``ctx.resource(RuntimePort)``) instead of the whole manager: resolve, pull,
acquire the engine, launch, drain, reset, observe a journaled launch, and the frame each
step runs in. The runtime manager implements it.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from sbproxy.catalog import ResolvedArtifact
from sbproxy.model_host.flows.pull import PullOutput
from sbproxy.model_host.runtime.commands import CommandKind
from sbproxy.workflows import StepContext, WorkflowEngine

__all__ = ["Launched", "RuntimePort", "runtime_port"]


@dataclass(frozen=True, slots=True)
class Launched:
    """A ready generation as a ``launch`` step records it.

    Attributes:
        generation: The generation number.
        port: Its loopback port.
        pid: The engine's pid.
        start_ticks: The engine's start time in clock ticks.
    """

    generation: int
    port: int
    pid: int | None
    start_ticks: str | None


@runtime_checkable
class RuntimePort(Protocol):
    """The runtime as its durable steps see it (see the module docstring)."""

    @property
    def engine(self) -> WorkflowEngine:
        """The workflow engine the jobs are journaled in."""
        ...

    def definition_digest(self, deployment: str) -> str:
        """SHA-256 of ``deployment``'s current definition (a load job records it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        ...

    def step_scope(
        self, job_id: str, deployment: str, kind: CommandKind
    ) -> AbstractAsyncContextManager[None]:
        """The frame a step of ``job_id`` runs in (its command's turn and cancel scope).

        Raises:
            JobCancelled: ``cancelled`` when a later command superseded it.
        """
        ...

    def resolve(self, deployment: str) -> ResolvedArtifact:
        """Resolve ``deployment`` to its exact artifact on this worker (remembered).

        Raises:
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
        """
        ...

    async def pull(self, deployment: str, artifact: ResolvedArtifact) -> PullOutput:
        """Make ``artifact`` verified in the cache through its pull job (its policy).

        Raises:
            SbproxyError: the pull job's failure (``manual_artifact_missing``, ...).
        """
        ...

    async def provision_engine(self) -> Path:
        """Find or acquire the llama-server executable.

        Raises:
            EngineError: acquisition failures.
        """
        ...

    async def launch(
        self, deployment: str, artifact: ResolvedArtifact, executable: Path, *, job_id: str
    ) -> Launched:
        """Start a generation of ``deployment`` and wait until it is ready.

        Raises:
            EngineError: ``crash_loop``, ``start_timeout``, ``artifact_not_ready``.
            AdmissionRejected: ``insufficient_capacity``.
        """
        ...

    async def drain(self, deployment: str, *, job_id: str, reason: str | None) -> dict[str, object]:
        """Drain and stop ``deployment``; the drain report as JSON."""
        ...

    async def reset(self, deployment: str, *, job_id: str) -> tuple[bool, str]:
        """Clear a retained failure; ``(cleared, state)``.

        Raises:
            SbproxyError: ``draining`` while it is preparing or draining.
        """
        ...

    def observe(
        self, deployment: str, *, generation: int, pid: int | None, start_ticks: str | None
    ) -> bool:
        """Whether a journaled launch still describes a live, routable engine of ours."""
        ...


def runtime_port(ctx: StepContext) -> RuntimePort:
    """The :class:`RuntimePort` among the step's resources.

    Raises:
        WorkflowError: ``missing_resource`` when the engine has none.
    """
    kind: type[RuntimePort] = RuntimePort  # type: ignore[type-abstract]
    return ctx.resource(kind)
