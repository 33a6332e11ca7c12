"""The durable jobs of the runtime: ``load`` (prepare and warm), ``drain`` and ``reset``.

``load`` has four steps: ``resolve`` the exact artifact, ``pull`` it (joining the
artifact's pull job; the deployment's pull policy applies), acquire the ``engine`` (a source
build or release download job when needed) and ``launch`` a new generation. The first three
record durable facts and are replayed after a crash. ``launch`` records live state (port,
pid, start ticks, generation): on replay it is *observed*, not trusted -- unless the
manager still runs that very process and it holds its port, the step runs again -- so a
host killed even after the launch committed converges to a ready engine under the original
job id (engines die with their host; the restarted host reaps what is left).

The manager runs these jobs itself, in their deployment's command order (``commands.py``);
each step takes the :class:`~sbproxy.model_host.runtime.port.RuntimePort` and runs in its
``step_scope``, so a later ``stop`` cancels a load's
steps and the job ends ``cancelled``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sbproxy.catalog import Catalog, ResolvedArtifact
from sbproxy.errors import SbproxyError
from sbproxy.model_host.flows.pull import PullInput, PullIntent, PullOutput, pull_workflow
from sbproxy.model_host.registry import registry
from sbproxy.model_host.runtime.commands import CommandKind
from sbproxy.model_host.runtime.port import RuntimePort, runtime_port
from sbproxy.store import JobRecord, JobStatus
from sbproxy.workflows import StepContext, WorkflowContext, WorkflowEngine, fault_point, step

__all__ = [
    "load_workflow",
    "pull_artifact",
    "submit_drain",
    "submit_load",
    "submit_reset",
]


class DeploymentInput(BaseModel):
    """A job about one deployment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    reason: str | None = None
    # A load's deployment definition when it was submitted (``deployment_digest``): a host
    # whose configuration defines the deployment otherwise does not run the job.
    config_digest: str | None = None


class PullStepInput(BaseModel):
    """The artifact a deployment needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    artifact: ResolvedArtifact


class LaunchInput(BaseModel):
    """What a launch starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    artifact: ResolvedArtifact
    executable: str


class LoadOutput(BaseModel):
    """A ready generation: live state, observed again on every replay."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    generation: int
    port: int
    artifact_digest: str
    pid: int | None = None
    start_ticks: str | None = None


async def pull_artifact(
    engine: WorkflowEngine,
    catalog: Catalog,
    artifact: ResolvedArtifact,
    *,
    pull_policy: str,
    intent: str,
) -> PullOutput:
    """Make ``artifact`` ready through its pull job (key = the artifact digest), with the
    pickle policy of its ``catalog`` entry.

    Raises:
        SbproxyError: the pull job's failure (``manual_artifact_missing``, ...).
    """
    entry = catalog.entry(artifact.logical_model)
    request = PullInput(
        artifact=artifact,
        allow_pickle=entry.allow_pickle,
        intent=PullIntent(intent),
        pull_policy=pull_policy,
    )
    submitted = await engine.submit(
        pull_workflow,
        request,
        idempotency_key=artifact.digest,
        subject=f"artifact:sha256:{artifact.digest}",
    )
    job = await engine.join(submitted.job.id)
    if job.status != JobStatus.SUCCEEDED:
        error = job.error
        raise SbproxyError(
            error.message if error else f"pull job {job.id} {job.status.value}",
            code=error.code if error else "prepare_failed",
            details={"job_id": job.id},
        )
    return PullOutput.model_validate(job.output)


@step("resolve")
async def resolve_step(ctx: StepContext, request: DeploymentInput) -> ResolvedArtifact:
    """Resolve the deployment to its exact artifact on this worker.

    Idempotency: pure (catalog and worker profile).
    """
    runtime = runtime_port(ctx)
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.LOAD):
        return runtime.resolve(request.deployment)


@step("pull")
async def pull_step(ctx: StepContext, request: PullStepInput) -> PullOutput:
    """Ensure the artifact is verified in the cache (policy ``runtime``: manual refuses).

    Idempotency: the pull job is keyed by the artifact digest; a cached artifact is a hit.
    """
    runtime = runtime_port(ctx)
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.LOAD):
        return await runtime.pull(request.deployment, request.artifact)


@step("engine")
async def engine_step(ctx: StepContext, request: DeploymentInput) -> str:
    """Find or acquire the llama-server executable.

    Idempotency: detection finds an engine acquired by an earlier run.
    """
    runtime = runtime_port(ctx)
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.LOAD):
        executable = await runtime.provision_engine()
    return str(executable)


async def _launch_still_live(ctx: StepContext, output: LoadOutput) -> bool:
    """Replay check of ``launch``: is the recorded engine still ours, alive, listening?"""
    return runtime_port(ctx).observe(
        output.deployment,
        generation=output.generation,
        pid=output.pid,
        start_ticks=output.start_ticks,
    )


@step("launch", observe=_launch_still_live)
async def launch_step(ctx: StepContext, request: LaunchInput) -> LoadOutput:
    """Start a new generation and wait for it to be ready.

    Idempotency: a live ready engine of the deployment is reused; after a host crash there
    is none (engines die with their host) and a new generation starts. The output names a
    process, so a replay re-checks it (``observe``) instead of trusting it.
    """
    runtime = runtime_port(ctx)
    # One deployment's launch, for a test that must kill the host while loading only it.
    fault_point(f"load.launch:{request.deployment}")
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.LOAD):
        launched = await runtime.launch(
            request.deployment, request.artifact, Path(request.executable), job_id=ctx.job_id
        )
    return LoadOutput(
        deployment=request.deployment,
        generation=launched.generation,
        port=launched.port,
        artifact_digest=request.artifact.digest,
        pid=launched.pid,
        start_ticks=launched.start_ticks,
    )


@registry.workflow("load", version=1)
async def load_workflow(ctx: WorkflowContext, request: DeploymentInput) -> LoadOutput:
    """Prepare and warm one deployment (see the module docstring)."""
    artifact = await ctx.step(resolve_step, request)
    await ctx.step(pull_step, PullStepInput(deployment=request.deployment, artifact=artifact))
    executable = await ctx.step(engine_step, request)
    return await ctx.step(
        launch_step,
        LaunchInput(deployment=request.deployment, artifact=artifact, executable=executable),
    )


@step("drain")
async def drain_step(ctx: StepContext, request: DeploymentInput) -> dict[str, object]:
    """Refuse new work, cancel the queue, wait for active requests, stop the engine.

    Idempotency: draining a stopped deployment only settles its state.
    """
    runtime = runtime_port(ctx)
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.STOP):
        return await runtime.drain(request.deployment, job_id=ctx.job_id, reason=request.reason)


@registry.workflow("drain", version=1)
async def drain_workflow(ctx: WorkflowContext, request: DeploymentInput) -> dict[str, object]:
    """Drain and stop one deployment; the artifact stays cached."""
    return await ctx.step(drain_step, request)


class ResetOutput(BaseModel):
    """What a reset did: ``cleared`` a retained failure, or found none (a no-op)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    deployment: str
    cleared: bool
    state: str


@step("reset")
async def reset_step(ctx: StepContext, request: DeploymentInput) -> ResetOutput:
    """Clear a retained failure.

    Idempotency: a deployment that was reset already is ``configured``, and resetting a
    deployment that has not failed changes nothing (``cleared: false``, the job succeeds).
    """
    runtime = runtime_port(ctx)
    async with runtime.step_scope(ctx.job_id, request.deployment, CommandKind.RESET):
        cleared, state = await runtime.reset(request.deployment, job_id=ctx.job_id)
    return ResetOutput(deployment=request.deployment, cleared=cleared, state=state)


@registry.workflow("reset", version=1)
async def reset_workflow(ctx: WorkflowContext, request: DeploymentInput) -> ResetOutput:
    """Clear a failed deployment's retained error so it can launch again (a no-op that
    succeeds when there is none)."""
    return await ctx.step(reset_step, request)


async def submit_load(
    runtime: RuntimePort, deployment: str, *, idempotency_key: str | None = None
) -> JobRecord:
    """Queue (or join, by ``idempotency_key``, default ``load:<deployment>``) a ``load``
    job of ``deployment``. Commands go through :meth:`RuntimeManager.load`, which picks the
    key and runs the job in order; this only writes the journal."""
    submitted = await runtime.engine.submit(
        load_workflow,
        DeploymentInput(deployment=deployment, config_digest=runtime.definition_digest(deployment)),
        idempotency_key=idempotency_key or f"load:{deployment}",
        subject=f"deployment:{deployment}",
    )
    return submitted.job


async def submit_drain(runtime: RuntimePort, deployment: str, *, reason: str = "stop") -> JobRecord:
    """Queue a ``drain`` job of ``deployment`` (each stop is its own job, so a stop after a
    load never joins an earlier stop). Use :meth:`RuntimeManager.stop` for a command."""
    submitted = await runtime.engine.submit(
        drain_workflow,
        DeploymentInput(deployment=deployment, reason=reason),
        subject=f"deployment:{deployment}",
    )
    return submitted.job


async def submit_reset(runtime: RuntimePort, deployment: str) -> JobRecord:
    """Queue a ``reset`` job of ``deployment``. Use :meth:`RuntimeManager.reset`."""
    submitted = await runtime.engine.submit(
        reset_workflow,
        DeploymentInput(deployment=deployment),
        subject=f"deployment:{deployment}",
    )
    return submitted.job
