"""The runtime manager: the one owner of live deployment state, a thin facade over its parts.

Per deployment the runtime holds a :class:`~sbproxy.model_host.runtime.deployment.Deployment`
(the admission gate, the current generation, the lifecycle state, the retained failure) and a
command lane. Callers send commands (:meth:`RuntimeManager.load`, ``stop``, ``reset``, a
reload's ``exclusive`` turn) and read frozen snapshots (``status``, ``snapshot``); durable
steps see the runtime through the narrow :class:`~sbproxy.model_host.runtime.port.RuntimePort`
(:attr:`RuntimeManager.port`). The manager wires parts that each own one thing, over a
shared :class:`~sbproxy.model_host.runtime.context.RuntimeContext` (deployments, desired
state, residency, command lanes, staging, clock, the outbox of checked transitions):

* ``command_runner.py`` -- **ordered commands**: on one deployment they run in arrival order
  and the last one wins; their durable jobs (and those a crashed host left) run in the
  command's turn, never out of order.
* ``requests.py`` -- admission of requests (``refusals.py``: why not, with reason codes).
* ``launches.py`` -- launches and relaunches, with ``swaps.py`` (**swaps wait** for a busy
  generation to go idle, up to ``queue_timeout_ms``) and ``spawner.py`` (attempts,
  ``start_timeout``, ``crash_loop``); ``retire.py`` ends generations (drain, evict, exit).
* ``supervision.py`` -- start, **observed processes** (exit watchers, maintenance probes),
  restarts after ``unhealthy_after`` timeouts, keep-alive, shutdown.
* ``snapshots.py`` (the read side), ``transaction.py`` (a reload's staging, rollback and
  commit), ``steps.py`` (the runtime port), ``tasks.py`` (background work).

Every state change is a compare-and-set against
:data:`~sbproxy.model_host.runtime.state.DEPLOYMENT_TRANSITIONS`, journaled as a
``deployment`` event of the job that caused it. Time comes from an injectable
:class:`~sbproxy.model_host.runtime.clock.Clock`.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path

import anyio
import anyio.abc

from sbproxy.catalog import Catalog, ResolvedArtifact, WorkerProfile
from sbproxy.config import CompiledConfig
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.runtime.clock import Clock, MonotonicClock
from sbproxy.model_host.runtime.command_runner import ADOPT_POLL_S, RUNTIME_JOB_KINDS, CommandRunner
from sbproxy.model_host.runtime.commands import CommandQueue
from sbproxy.model_host.runtime.context import RuntimeContext, SplitLaunch
from sbproxy.model_host.runtime.definitions import (
    artifact_request,
    deployment_digest,
    desired_digest,
    desired_of,
)
from sbproxy.model_host.runtime.deployment import Deployment, IllegalTransition, UnknownDeployment
from sbproxy.model_host.runtime.devices import HostDevices, host_devices
from sbproxy.model_host.runtime.launcher import Launcher
from sbproxy.model_host.runtime.launches import Launches
from sbproxy.model_host.runtime.requests import Requests
from sbproxy.model_host.runtime.retire import Retirement
from sbproxy.model_host.runtime.snapshots import Snapshots
from sbproxy.model_host.runtime.spawner import Spawner
from sbproxy.model_host.runtime.state import LaunchBackoff
from sbproxy.model_host.runtime.steps import RuntimeSteps
from sbproxy.model_host.runtime.supervision import Supervision
from sbproxy.model_host.runtime.swaps import Swaps
from sbproxy.model_host.runtime.tasks import contained
from sbproxy.model_host.runtime.transaction import ReloadTransaction
from sbproxy.model_host.runtime.upstream import RuntimeTallies, Upstream, free_port
from sbproxy.store import RuntimeStore
from sbproxy.workflows import WorkflowEngine

__all__ = [
    "ADOPT_POLL_S",
    "RUNTIME_JOB_KINDS",
    "Deployment",
    "IllegalTransition",
    "RuntimeManager",
    "RuntimeTallies",
    "UnknownDeployment",
    "Upstream",
    "artifact_request",
    "contained",
    "deployment_digest",
    "desired_digest",
    "desired_of",
]


class RuntimeManager:
    """Owner of every deployment's live state (see the module docstring).

    Args:
        compiled: The desired state.
        layout: The cache root (artifacts, engines, journal, logs).
        catalog: The catalog deployments resolve against.
        engine: The workflow engine whose resources include this manager.
        runtime_store: Generations and committed revisions.
        worker: This worker's profile (accelerator, memory).
        backoff: Launch retry policy for every deployment (tests); default: each
            deployment's ``restart_backoff_*_ms`` and ``max_launch_attempts``.
        ready_timeout_s: Upper bound on any launch's readiness wait, in seconds (each
            deployment's ``start_timeout_ms`` applies below it).
        health_interval_s: Maintenance tick period, in seconds.
        clock: Monotonic time for keep-alive, backoff and swap waits.
        jitter: Source of backoff jitter in ``[0, 1)`` (tests pin it).
        launcher: The effects on engines (default: real llama-server children).
        devices: This host's device table (:func:`host_devices`): residency capacities per
            device index and the accelerator every launch asks for. Default: one device 0
            of ``worker.memory_bytes`` on the worker's accelerator.
    """

    def __init__(
        self,
        *,
        compiled: CompiledConfig,
        layout: CacheLayout,
        catalog: Catalog,
        engine: WorkflowEngine,
        runtime_store: RuntimeStore,
        worker: WorkerProfile,
        backoff: LaunchBackoff | None = None,
        ready_timeout_s: float | None = None,
        health_interval_s: float = 1.0,
        clock: Clock | None = None,
        jitter: Callable[[], float] = random.random,
        launcher: Launcher | None = None,
        devices: HostDevices | None = None,
    ) -> None:
        self._context = ctx = RuntimeContext(
            compiled=compiled,
            layout=layout,
            catalog=catalog,
            engine=engine,
            runtime_store=runtime_store,
            worker=worker,
            devices=devices or host_devices(worker, ()),
            clock=clock or MonotonicClock(),
            jitter=jitter,
            launcher=launcher,
            backoff=backoff,
            ready_timeout_s=ready_timeout_s,
        )
        self.layout, self.cache, self.runtime_store = layout, ctx.cache, runtime_store
        self.worker, self.devices, self.identity = worker, ctx.devices, ctx.identity
        self.clock, self.tallies, self.launcher = ctx.clock, ctx.tallies, ctx.launcher
        self.residency, self.lanes, self.staging = ctx.residency, ctx.lanes, ctx.staging
        self.outbox = ctx.outbox
        self._wire(ctx, health_interval_s=health_interval_s)
        # Checks a configuration file's candidate before a file reload plans it (`serve
        # --locked` refuses one that drifts from the lockfile); raising refuses the reload.
        self.config_guard: Callable[[CompiledConfig], Awaitable[None]] | None = None
        # Callbacks a commit runs (the gateway swaps its routes and keys).
        self.on_commit: list[Callable[[CompiledConfig], None]] = []
        self.reload_lock = anyio.Lock()

    def _wire(self, ctx: RuntimeContext, *, health_interval_s: float) -> None:
        """Build the parts over ``ctx`` and make their operations the manager's own (each
        part's docstring says what they do, with their errors and reason codes)."""
        retirement = Retirement(ctx)
        swaps, spawner = Swaps(ctx, retirement), Spawner(ctx, free_port=free_port)
        self._launches = launches = Launches(
            ctx, retirement=retirement, swaps=swaps, spawner=spawner
        )
        self._steps = steps = RuntimeSteps(ctx, launches=launches, retirement=retirement)
        commands = CommandRunner(ctx, port=steps)
        self._supervision = supervision = Supervision(
            ctx,
            commands=commands,
            retirement=retirement,
            steps=steps,
            health_interval_s=health_interval_s,
        )
        # Reports go through record_outcome, looked up at each report (a wrapper sees them).
        requests = Requests(ctx, commands=commands, on_outcome=self._report)
        reloads = ReloadTransaction(ctx, launches=launches, retirement=retirement)
        snapshots, tasks = Snapshots(ctx), ctx.tasks
        self.status, self.snapshot = snapshots.status, snapshots.snapshot
        self.artifact_protection = snapshots.artifact_protection
        self.tallies_snapshot = snapshots.tallies_snapshot
        self.resident_digests = snapshots.resident_digests
        self.can_chat, self.output_limit = snapshots.can_chat, snapshots.output_limit
        self.engine_pids = snapshots.engine_pids
        self.background, self.start_contained = tasks.background, tasks.start_contained
        self.resolve_config, self.backoff = ctx.resolve_config, ctx.backoff
        self.resolve, self.pull, self.observe_generation = steps.resolve, steps.pull, steps.observe
        self.provision_engine, self.exclusive = steps.provision_engine, ctx.lanes.exclusive
        self.acquire = requests.acquire
        self.estimate, self.drain_deployment = launches.estimate, retirement.drain_deployment
        self.adopt_runtime_jobs = commands.adopt_runtime_jobs
        self.request_load = commands.request_load
        self.load, self.stop, self.reset = commands.load, commands.stop, commands.reset
        self.tick, self.shutdown = supervision.tick, supervision.shutdown
        self.kill_engines = supervision.kill_engines
        self.kill_every_engine = supervision.kill_every_engine
        self.holds_engines = supervision.holds_engines
        self.stage, self.recreate_stop = reloads.stage, reloads.recreate_stop
        self.roll_back, self.apply = reloads.roll_back, reloads.apply
        self.enforce_resident_limit = reloads.enforce_resident_limit
        self.record_revision = reloads.record_revision

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        """Reap orphan engines, commit the desired revision, start converging to it.

        Unfinished ``load``, ``drain`` and ``reset`` jobs a crashed host left behind are
        adopted as commands in their original order and finish under their ids (and later
        ones -- a ``jobs retry`` -- within :data:`ADOPT_POLL_S`); then
        ``warm: true`` deployments get a ``load`` (joining an adopted one) and ``pull:
        on_boot`` deployments get their artifact verified -- except a deployment whose
        latest runtime job is a load that ended ``recovery_exhausted`` (it killed the host
        on every run): that one is held ``failed`` with the job's error instead, so the
        host stays up for the others. The maintenance loop starts.
        """
        self._context.tasks.group = group
        await self._supervision.start()

    def record_outcome(self, deployment: str, generation: int, *, timed_out: bool) -> None:
        """Count one request's end at ``deployment``/``generation`` (``timed_out``: the
        engine timed out); see :meth:`Supervision.record_outcome`."""
        self._supervision.record_outcome(deployment, generation, timed_out=timed_out)

    def _report(self, deployment: str, generation: int, timed_out: bool) -> None:
        self.record_outcome(deployment, generation, timed_out=timed_out)

    async def launch_generation(
        self, found: Deployment, *, executable: Path, job_id: str, generation: int | None = None
    ) -> int:
        """Start a new generation of ``found`` and wait until it is ready; its port. Raises
        ``crash_loop``, ``start_timeout``, ``artifact_not_ready`` or
        ``insufficient_capacity``; see :meth:`Launches.launch_generation`."""
        return await self._launches.launch_generation(
            found, executable=executable, job_id=job_id, generation=generation
        )

    def use_artifact(self, deployment: Deployment, artifact: ResolvedArtifact) -> None:
        """Remember the artifact a job resolved for ``deployment``."""
        deployment.use_artifact(artifact)

    # -- what a reload replaces, read through the context ----------------------------------

    @property
    def compiled(self) -> CompiledConfig:
        """The desired state (a reload's commit replaces it)."""
        return self._context.compiled

    @property
    def catalog(self) -> Catalog:
        """The catalog deployments resolve against (replaced with the desired state)."""
        return self._context.catalog

    @property
    def revision(self) -> int | None:
        """The committed desired-state revision (``None`` before :meth:`start`)."""
        return self._context.revision

    def lead_splits(self, splits: dict[str, SplitLaunch]) -> None:
        """The deployments this host leads as splits over other hosts' RPC workers, from
        their next launch on (``{deployment: split}``; the fleet agent's, before it loads
        one). A deployment not listed launches on this host alone."""
        self._context.splits = dict(splits)

    @property
    def safety_margin(self) -> float:
        """The memory estimate's safety margin (``model_host.safety_margin``)."""
        return self._context.safety_margin

    @property
    def shutdown_deadline_s(self) -> float:
        """``model_host.shutdown_deadline_ms``, in seconds."""
        return self._context.shutdown_deadline_s

    @property
    def prepares(self) -> anyio.CapacityLimiter:
        """The limiter of concurrent launches (``max_parallel_prepares``)."""
        return self._launches.prepares

    @property
    def engine(self) -> WorkflowEngine:
        """The workflow engine the runtime's jobs are journaled in."""
        return self._context.engine

    def split_placement(self, deployment: str) -> str | None:
        """The split placement ``deployment``'s engine was last launched for (``None``: it
        was not launched as a split, or not at all)."""
        return self._context.split_launched.get(deployment)

    def hold_launches(self) -> None:
        """Hold every launch of the deployments this host has now (a fenced fleet node:
        :class:`~sbproxy.model_host.runtime.context.LaunchHold`) until
        :meth:`release_launches`."""
        self._context.launch_hold.hold(self._context.live)

    @property
    def held_launches(self) -> frozenset[str]:
        """The deployments whose launches are held now (:meth:`hold_launches`)."""
        return self._context.launch_hold.held

    def release_launches(self, wanted: Collection[str]) -> None:
        """Let the held launches of ``wanted`` (deployment ids this host is to run) go on,
        and drop the holds of deployments it no longer has; the others stay held, and a
        launch of theirs that waits on the hold ends (cancelled: it would otherwise keep
        their command lane, and the stop that follows, waiting for ever)."""
        hold = self._context.launch_hold
        live = self._context.live
        hold.release([name for name in hold.held if name in wanted or name not in live])
        hold.end_waiting([name for name in hold.held if name not in wanted])

    @property
    def owned_dir(self) -> Path:
        """Ownership records of the engines this host started."""
        return self.layout.owned_engines

    @property
    def port(self) -> RuntimeSteps:
        """The :class:`~sbproxy.model_host.runtime.port.RuntimePort` of the durable steps
        (add it to the workflow engine's resources)."""
        return self._steps

    @property
    def deployments(self) -> Mapping[str, Deployment]:
        """The live deployments by id (read them; only the manager changes them)."""
        return self._context.live

    def deployment(self, deployment: str) -> Deployment:
        """The live deployment ``deployment`` (read it; only the manager changes it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        return self._context.deployment(deployment)

    def queue(self, deployment: str) -> CommandQueue:
        """The command queue of ``deployment`` (kept across reloads)."""
        return self.lanes.queue(deployment)
