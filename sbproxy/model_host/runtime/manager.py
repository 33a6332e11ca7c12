"""The runtime manager: the one owner of live deployment state.

Per deployment it holds a :class:`~sbproxy.model_host.runtime.deployment.Deployment` (the
admission gate, the current generation, the lifecycle state, the retained failure) and a
command lane. It is composed of parts that each own one thing: the deployments (their
fields private, every change a named method, every transition a compare-and-set queued to
an :class:`~sbproxy.model_host.runtime.deployment.Outbox` the manager drains into the
journal), a :class:`~sbproxy.model_host.runtime.launcher.Launcher` (the effects on engine
processes; a fake one in unit tests), the
:class:`~sbproxy.model_host.runtime.residency.Residency` (memory), the
:class:`~sbproxy.model_host.runtime.lanes.CommandLanes` (ordered commands), a
:class:`~sbproxy.model_host.runtime.staging.Staging` (a reload's transaction) and pure
policy (``policy.py``). Callers send commands (:meth:`RuntimeManager.load`,
:meth:`~RuntimeManager.stop`, :meth:`~RuntimeManager.reset`, a reload's
:meth:`~RuntimeManager.exclusive` turn) and read frozen snapshots
(:meth:`~RuntimeManager.status`, :meth:`~RuntimeManager.snapshot`); durable steps see it
through the narrow :class:`~sbproxy.model_host.runtime.port.RuntimePort`.

* **Ordered commands.** Commands on one deployment run in arrival order and the last one
  wins (``commands.py``): a stop supersedes a load in flight (its launch is cancelled and
  its child stopped), a load after a stop runs after it and ends ready. Slow work runs in
  durable jobs (``runtime/jobs.py``) that the manager itself runs in the command's turn --
  including jobs a crashed host left unfinished, adopted at :meth:`~RuntimeManager.start`
  -- so the job worker loop never runs them out of order.
* **Checked transitions.** Every state change is a compare-and-set against
  :data:`~sbproxy.model_host.runtime.state.DEPLOYMENT_TRANSITIONS`; it is logged, counted
  and queued as a ``deployment`` event of the job that caused it, journaled right after.
* **Observed processes.** A generation is routable only while its child is alive and holds
  the listening socket on its port (psutil); an exit is noticed at once by a watcher task,
  a foreign listener by the maintenance probe. After a restart a journaled launch output is
  re-checked against the live process (pid + start ticks + socket) and relaunched when it
  no longer holds (``launch`` step ``observe``).
* **Supervision.** The gateway reports each request's end (:meth:`Upstream.report`);
  ``unhealthy_after`` consecutive engine timeouts drain the generation and relaunch it after
  an exponential backoff with jitter. ``start_timeout_ms`` bounds a launch (``start_timeout``,
  retried by the next request or ``reset``). Launches that keep exiting early are held in
  ``crash_loop`` after ``max_launch_attempts``.
* **Swaps wait.** A launch that needs a busy generation evicted holds that generation's gate
  (no new request is admitted to it) and waits, up to its ``queue_timeout_ms``, for it to go
  idle; only then is it refused ``insufficient_capacity`` with ``Retry-After``.
* **Time** comes from an injectable monotonic :class:`~sbproxy.model_host.runtime.clock.Clock`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.abc
import anyio.to_thread
import rfc8785

from sbproxy.catalog import (
    Accelerator,
    ArtifactRequest,
    Catalog,
    ResolvedArtifact,
    WorkerProfile,
    resolve_artifact,
)
from sbproxy.config import CompiledConfig, DeploymentConfig, PriorityClass
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache, CachedMetadata, CacheLayout
from sbproxy.model_host.engines import EngineError, LaunchRequest, provision_llama_cpp, reap_orphans
from sbproxy.model_host.flows.pull import PullOutput
from sbproxy.model_host.runtime.admission import (
    AdmissionGate,
    AdmissionReason,
    AdmissionRejected,
    Permit,
    reject,
)
from sbproxy.model_host.runtime.clock import Clock, MonotonicClock
from sbproxy.model_host.runtime.commands import Command, CommandKind, CommandQueue
from sbproxy.model_host.runtime.deployment import (
    Deployment,
    IllegalTransition,
    Outbox,
    Transition,
    UnknownDeployment,
)
from sbproxy.model_host.runtime.devices import HostDevices, host_devices
from sbproxy.model_host.runtime.jobs import pull_artifact, submit_drain, submit_load, submit_reset
from sbproxy.model_host.runtime.lanes import CommandLanes
from sbproxy.model_host.runtime.launcher import Engine, EngineLauncher, Launcher, LaunchSpec
from sbproxy.model_host.runtime.memory import MemoryEstimate, estimate_memory, read_gguf_header
from sbproxy.model_host.runtime.policy import (
    Attempts,
    ProbeVerdict,
    SwapDecision,
    SwapVerdict,
    Verdict,
    after_failed_spawn,
    after_no_room,
    after_probe,
    backoff_of,
    keep_alive_due,
    restart_delay,
    start_timeout_s,
)
from sbproxy.model_host.runtime.port import Launched
from sbproxy.model_host.runtime.residency import (
    ReservationRequest,
    Residency,
    ResidencyKey,
    select_devices,
)
from sbproxy.model_host.runtime.staging import Staging
from sbproxy.model_host.runtime.state import (
    CrashLoop,
    DeploymentState,
    DeploymentStatus,
    LaunchBackoff,
)
from sbproxy.model_host.runtime.upstream import RuntimeTallies, Upstream, free_port
from sbproxy.store import RECOVERY_EXHAUSTED, JobRecord, JobStatus, RuntimeStore, wall_clock_ms
from sbproxy.workflows import WorkerIdentity, WorkflowEngine, owner_is_gone, process_start_ticks

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
    "deployment_digest",
    "desired_digest",
    "desired_of",
]

# Failure reasons after which the runtime relaunches the engine by itself (after its
# restart backoff): a request refused meanwhile is told to retry.
_RELAUNCHED = frozenset({"engine_health_failed", "engine_unhealthy"})
logger = logging.getLogger(__name__)

S = DeploymentState

# Job kinds the manager runs itself, in its deployments' command order; the worker loop
# leaves them alone (``run_worker(exclude=...)``).
RUNTIME_JOB_KINDS = ("load", "drain", "reset")

# How often a running host looks for runtime jobs it does not hold yet, seconds.
ADOPT_POLL_S = 0.5

_COMMAND_OF_KIND = {
    "load": CommandKind.LOAD,
    "drain": CommandKind.STOP,
    "reset": CommandKind.RESET,
}


async def contained(work: Callable[[], Awaitable[object]], *, what: str) -> None:
    """Run one background task of the host so that its end never ends the host.

    A task on the host's task group that raises takes the whole group down; one that ends
    with a cancellation that is not the group's own (a ``CancelledError`` re-raised from
    a cancelled inner task) cancels the group *silently*, and the server once exited with
    status 0 that way. Here the group's own cancellation passes through; any other is
    logged and swallowed, and so is an error (logged with its traceback: it is a bug).
    """
    try:
        await work()
    except anyio.get_cancelled_exc_class():
        if anyio.current_effective_deadline() == -math.inf:
            raise  # the host is stopping: this task's cancellation is the group's own
        logger.error("%s ended with a stray cancellation; the host stays up", what)
    except Exception:
        logger.exception("%s failed; the host stays up", what)


def _sets_threads(extra_args: Iterable[str]) -> bool:
    """Whether the operator's engine flags already set llama.cpp's thread count."""
    return any(arg in ("-t", "--threads") or arg.startswith("--threads=") for arg in extra_args)


def _pinned_template(deployment: Deployment) -> str | None:
    """The chat template name the catalog pins for the deployment's artifact, if any."""
    artifact = deployment.artifact
    template = artifact.chat_template if artifact is not None else "embedded"
    return None if template in ("embedded", "none") else template


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
        self.compiled = compiled
        self.layout = layout
        self.cache = ArtifactCache(layout)
        self.catalog = catalog
        self._engine = engine
        self.runtime_store = runtime_store
        self.worker = worker
        self.devices = devices or host_devices(worker, ())
        # The devices each recent generation ran on, by deployment, so that restarting a
        # stopped generation under its own number keeps them (the last two per deployment).
        self._placed: dict[str, dict[int, tuple[int, ...]]] = {}
        self.backoff_override = backoff
        self.ready_timeout_s = ready_timeout_s
        self.health_interval_s = health_interval_s
        self.clock: Clock = clock or MonotonicClock()
        self.tallies = RuntimeTallies()
        self.jitter = jitter
        self.identity = WorkerIdentity.current()
        self.launcher: Launcher = launcher or EngineLauncher(
            owned_dir=self.owned_dir, identity=self.identity
        )
        self._take_host_policies(compiled)
        # Checks a configuration file's candidate before a file reload plans it (`serve
        # --locked` refuses one that drifts from the lockfile); raising refuses the reload.
        self.config_guard: Callable[[CompiledConfig], Awaitable[None]] | None = None
        self.residency = self._residency_for(compiled)
        self.lanes = CommandLanes()
        self.staging = Staging()
        self.outbox = Outbox()
        self._tick = 0
        self._background = 0
        self._group: anyio.abc.TaskGroup | None = None
        self._capacity = anyio.Event()
        self._closing_at: float | None = None
        self._live: dict[str, Deployment] = {
            name: self._new_deployment(name, config)
            for name, config in compiled.deployments.items()
        }
        # Callbacks a commit runs (the gateway swaps its routes and keys).
        self.on_commit: list[Callable[[CompiledConfig], None]] = []
        self.reload_lock = anyio.Lock()
        self.revision: int | None = None

    def _residency_for(self, compiled: CompiledConfig) -> Residency:
        host = compiled.model_host
        cache_config = host.cache if host else None
        return Residency(
            self.devices.capacities(),
            max_resident_models=cache_config.max_resident_models if cache_config else None,
            eviction=cache_config.eviction if cache_config else "lru",
            is_protected=self._protected,
            demand=self._demand,
        )

    def _take_host_policies(self, compiled: CompiledConfig) -> None:
        """The host-wide settings a running host takes at once (and at a reload)."""
        host = compiled.model_host
        self.safety_margin = host.safety_margin if host else 0.10
        self.shutdown_deadline_s = (host.shutdown_deadline_ms if host else 30_000) / 1000
        # Engine launches of different deployments run at once up to this limit
        # (``max_parallel_prepares``, reference default 2); more wait their turn.
        limit = host.max_parallel_prepares if host else 2
        if not hasattr(self, "prepares"):
            self.prepares = anyio.CapacityLimiter(limit)
        elif host is not None:
            self.prepares.total_tokens = limit

    # -- lookup ----------------------------------------------------------------------------

    @property
    def engine(self) -> WorkflowEngine:
        """The workflow engine the runtime's jobs are journaled in."""
        return self._engine

    @property
    def deployments(self) -> Mapping[str, Deployment]:
        """The live deployments by id (read them; only the manager changes them)."""
        return self._live

    def deployment(self, deployment: str) -> Deployment:
        """The live deployment ``deployment`` (read it; only the manager changes it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        found = self._live.get(deployment)
        if found is None:
            raise UnknownDeployment(
                f"no deployment {deployment!r}",
                remediation="Check proxy.model_host.deployments; `sbproxy models ps` lists them.",
                details={"deployment": deployment},
            )
        return found

    def queue(self, deployment: str) -> CommandQueue:
        """The command queue of ``deployment`` (kept across reloads)."""
        return self.lanes.queue(deployment)

    def _new_deployment(self, deployment: str, config: DeploymentConfig) -> Deployment:
        gate = AdmissionGate(
            deployment,
            max_active=config.max_concurrency,
            max_queue=config.max_queue_depth,
            queue_timeout_s=config.queue_timeout_ms / 1000,
            clock=self.clock.now,
        )
        gate.on_idle = self._capacity_changed
        return Deployment(deployment, config, gate=gate, outbox=self.outbox, on_move=self._moved)

    def _moved(self, transition: Transition) -> None:
        """Every transition, synchronously: count it, wake a swap waiting on a transient
        generation."""
        key = (transition.deployment, transition.before.value, transition.after.value)
        self.tallies.transitions[key] += 1
        self._capacity_changed()

    async def _publish(self) -> None:
        """Journal the queued transitions, oldest first (a journal write never wedges the
        runtime: a failed one is logged)."""
        with anyio.CancelScope(shield=True):
            for transition in self.outbox.take():
                if transition.job_id is None:
                    continue
                try:
                    await self.engine.store.record_event(
                        transition.job_id, kind="deployment", data=transition.event_data()
                    )
                except Exception:
                    logger.exception("could not record the transition on %s", transition.job_id)

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = anyio.Event()

    def _protected(self, key: ResidencyKey, *, transient: bool = True) -> bool:
        """Whether ``key``'s generation may not be evicted now: staged, pinned, or (with
        ``transient``, the normal rule) busy, preparing or draining."""
        if self.staging.protects(key):
            return True
        found = self._live.get(key.deployment)
        if found is None or found.generation != key.generation:
            return False
        gate = found.gate
        # A held gate admits nobody new: its queue waits for the swap, so only the requests
        # already running keep it resident. Requests waiting for it to become ready count.
        busy = gate.active > 0 or (gate.queued > 0 and not gate.held) or found.waiting > 0
        settling = busy or found.state in (S.PREPARING, S.DRAINING)
        return found.config.pinned or (transient and settling)

    def _demand(self, key: ResidencyKey) -> int:
        """Requests active, queued or waiting for ``key``'s generation: each would wait for
        a relaunch if it were evicted (the residency evicts the least wanted first)."""
        found = self._live.get(key.deployment)
        if found is None or found.generation != key.generation:
            return 0
        return found.gate.active + found.gate.queued + found.waiting

    # -- snapshots (frozen values for readers outside the runtime) -------------------------

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
            selected_devices=self._reserved_devices(found),
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
            desired_replicas=config.replicas,
            configured_engine=str(config.engine),
            keep_alive_secs=config.keep_alive_secs,
        )

    def _reserved_devices(self, found: Deployment) -> tuple[int, ...]:
        """The devices the deployment's generation holds memory on (empty when none)."""
        reservation = self.residency.get(found.key) if found.generation else None
        return reservation.devices if reservation is not None else ()

    def _keep_alive_left_s(self, found: Deployment) -> float | None:
        """Seconds until an idle ready deployment's keep-alive stops it (on the manager's
        clock); ``None`` while it is busy, not ready, or has no keep-alive."""
        keep_alive = found.config.keep_alive_secs
        gate = found.gate
        released = gate.last_released_at
        if keep_alive is None or released is None or not found.routable():
            return None
        if gate.active or gate.queued:
            return None
        return round(max(0.0, keep_alive - (self.clock.now() - released)), 1)

    def status(self) -> list[DeploymentStatus]:
        """Every deployment's status (a frozen snapshot), sorted by id."""
        return [self._status_of(self._live[name]) for name in sorted(self._live)]

    def snapshot(self, deployment: str) -> DeploymentStatus:
        """One deployment's status now (frozen).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        return self._status_of(self.deployment(deployment))

    def artifact_protection(self) -> dict[str, str]:
        """Artifact digests removal and collection must not touch, with the reason:
        ``configured`` (every deployment's artifact -- the one it resolved, else resolved
        now; one that does not resolve protects nothing) or ``resident`` (a ready one's,
        which wins)."""
        protected: dict[str, str] = {}
        for found in self._live.values():
            digest = found.artifact.digest if found.artifact is not None else None
            if digest is None:
                try:
                    digest = self.resolve_config(found.config, self.catalog).digest
                except SbproxyError:
                    continue
            protected[digest] = "configured"
        for digest in self.resident_digests():
            protected[digest] = "resident"
        return protected

    def tallies_snapshot(self) -> RuntimeTallies:
        """The runtime's metric tallies now (a copy: transitions, swap waits)."""
        return self.tallies.copy()

    def resident_digests(self) -> set[str]:
        """Artifact digests of ready deployments."""
        return {
            found.artifact.digest
            for found in self._live.values()
            if found.routable() and found.artifact is not None
        }

    def _artifact_of(self, deployment: str) -> ResolvedArtifact | None:
        found = self.deployment(deployment)
        if found.artifact is not None:
            return found.artifact
        try:
            return self.resolve_config(found.config, self.catalog)
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
        config = self.deployment(deployment).config
        limit = config.max_output_tokens
        context = config.max_context
        if context is None:
            artifact = self._artifact_of(deployment)
            context = artifact.context_length if artifact is not None else None
        return max(1, min(limit, context)) if context else limit

    def engine_pids(self) -> set[int]:
        """Pids of every live engine child this manager holds (current and staged)."""
        return {p.pid for p in self._engines() if p.alive()}

    def _engines(self) -> list[Engine]:
        every = [*self._live.values(), *self.staging.staged.values()]
        return [found.process for found in every if found.process is not None]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        """Reap orphan engines, commit the desired revision, start converging to it.

        Unfinished ``load``, ``drain`` and ``reset`` jobs a crashed host left behind are
        adopted as commands in their original order and finish under their ids (and later
        ones -- a ``jobs retry`` -- within :data:`ADOPT_POLL_S`); then
        ``warm: true`` deployments get a ``load`` (joining an adopted one) and ``pull:
        on_boot`` deployments get their artifact verified -- except a deployment whose
        latest runtime job is a load that ended ``recovery_exhausted`` (it killed the host
        on every run): that one is held ``failed`` with the job's error instead
        (:meth:`_hold_exhausted`), so the host stays up for the others. The maintenance
        loop starts.
        """
        self._group = group
        report = await anyio.to_thread.run_sync(reap_orphans, self.owned_dir)
        if report.killed:
            logger.warning("reaped orphan engines: %s", report.killed)
        desired = desired_of(self.compiled)
        self.revision = await self.runtime_store.commit_revision(
            content_digest=desired_digest(desired), desired=desired
        )
        # A dead host's running jobs go back to the queue first, so the adoption below sees
        # them as they are (and ends those no deployment here declares at once).
        await self.engine.recover()
        await self.adopt_runtime_jobs()
        exhausted = await self._exhausted_loads()
        for found in self._live.values():
            poison = exhausted.get(found.deployment)
            if poison is not None:
                self._hold_exhausted(found, poison)
            elif found.config.warm:
                self.request_load(found.deployment, reason="warm")
            elif str(found.config.pull) == "on_boot":
                name = found.deployment
                self.start_contained(
                    functools.partial(self._verify_on_boot, name),
                    what=f"the on_boot verification of {name}",
                )
        self.start_contained(self._maintenance, what="the maintenance loop")
        self.start_contained(self._adoption, what="the runtime job adoption loop")

    async def _exhausted_loads(self) -> dict[str, JobRecord]:
        """Deployments whose latest runtime job (of this node) is a ``load`` that ended
        ``failed`` with ``recovery_exhausted`` for their current definition, with that
        job. A later load, drain or reset, a ``jobs retry`` (the job is queued again) or a
        changed definition (``config_digest``) lifts it."""
        latest: dict[str, JobRecord] = {}
        for deployment in self._live:
            # Each deployment's own jobs (newest first), not the whole shared journal.
            jobs = await self.engine.store.list_jobs(subject=f"deployment:{deployment}", limit=-1)
            for job in jobs:
                if job.kind not in RUNTIME_JOB_KINDS:
                    continue
                if job.node not in (None, self.engine.store.node):
                    continue  # another host's job on a shared journal
                latest[deployment] = job
                break
        exhausted = {}
        for deployment, job in latest.items():
            found = self._live.get(deployment)
            if found is None or job.kind != "load" or job.status != JobStatus.FAILED:
                continue
            if job.error is None or job.error.code != RECOVERY_EXHAUSTED:
                continue
            if job.input.get("config_digest") not in (None, deployment_digest(found.config)):
                continue  # the definition changed since: the new one deserves its load
            exhausted[deployment] = job
        return exhausted

    def _hold_exhausted(self, found: Deployment, job: JobRecord) -> None:
        """Hold ``found`` ``failed`` (``recovery_exhausted``, the job's error) instead of
        giving it a fresh load at boot that would die where the exhausted one died."""
        message = job.error.message if job.error is not None else "recovery exhausted"
        found.load_exhausted(job.id, message)
        logger.error(
            "%s is not loaded at start: its load job %s ended recovery_exhausted (%s); "
            "a reset (POST /admin/model-host/reset) or `sbproxy models load %s` tries again "
            "once the cause is fixed",
            found.deployment,
            job.id,
            message,
            found.deployment,
        )

    @property
    def owned_dir(self) -> Path:
        """Ownership records of the engines this host started."""
        return self.layout.owned_engines

    def background(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` on the manager's task group, counted so that :meth:`shutdown` waits
        for it (up to the deadline) instead of cancelling it mid-write."""
        if self._group is None:
            return
        self._background += 1

        async def run() -> None:
            try:
                await contained(work, what="a runtime task")
            finally:
                self._background -= 1

        self._group.start_soon(run)

    def start_contained(self, work: Callable[[], Awaitable[object]], *, what: str) -> None:
        """Run ``work`` on the manager's task group, not counted by :meth:`shutdown` (a
        watcher that ends with the host), contained as :func:`contained` says."""
        if self._group is not None:
            self._group.start_soon(lambda: contained(work, what=what))

    async def _verify_on_boot(self, deployment: str) -> None:
        found = self.deployment(deployment)
        try:
            await self.pull(deployment, found.artifact or self.resolve(deployment), "startup")
        except SbproxyError as exc:
            if found.state is S.CONFIGURED:
                found.failed_before_launch(exc.code, str(exc), job_id=None)
                await self._publish()

    # -- effects the durable steps and reloads ask for --------------------------------------

    def resolve_config(self, config: DeploymentConfig, catalog: Catalog) -> ResolvedArtifact:
        """Resolve one deployment definition against ``catalog`` on this worker.

        Raises:
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
            NoCompatibleVariantError: ``no_compatible_variant``.
        """
        return resolve_artifact(catalog, artifact_request(config), self.worker).artifact

    def resolve(self, deployment: str) -> ResolvedArtifact:
        """Resolve the deployment's exact artifact on this worker (and remember it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
        """
        found = self.deployment(deployment)
        artifact = self.resolve_config(found.config, self.catalog)
        found.use_artifact(artifact)
        return artifact

    def use_artifact(self, deployment: Deployment, artifact: ResolvedArtifact) -> None:
        """Remember the artifact a job resolved for ``deployment``."""
        deployment.use_artifact(artifact)

    async def pull(
        self, deployment: str, artifact: ResolvedArtifact, intent: str | None = None
    ) -> PullOutput:
        """Make ``artifact`` (remembered as the deployment's) verified in the cache through
        its pull job, with the deployment's pull policy (``on_boot``: a startup pull).

        Raises:
            SbproxyError: the pull job's failure (``manual_artifact_missing``, ...).
        """
        found = self.deployment(deployment)
        found.use_artifact(artifact)
        policy = str(found.config.pull)
        intent = intent or ("startup" if policy == "on_boot" else "runtime")
        return await pull_artifact(
            self.engine, self.catalog, artifact, pull_policy=policy, intent=intent
        )

    async def provision_engine(self) -> Path:
        """Find or acquire the llama-server executable (``engines.llama_cpp``).

        Raises:
            EngineError: acquisition failures.
        """
        host = self.compiled.model_host
        config = host.engines.llama_cpp if host else None
        return await provision_llama_cpp(config, engine=self.engine, layout_root=self.layout.root)

    def observe_generation(
        self, deployment: str, *, generation: int, pid: int | None, start_ticks: str | None
    ) -> bool:
        """Whether a journaled launch still describes a live engine of ours: the deployment
        runs that generation, its child is that pid with those start ticks, and it is
        routable. After a host restart this is false, and the launch runs again."""
        found = self._live.get(deployment)
        if found is None or found.generation != generation or not found.routable():
            return False
        process = found.process
        assert process is not None  # noqa: S101 - routable deployments have a process
        return (
            process.pid == pid
            and process.start_ticks == start_ticks
            and process_start_ticks(process.pid) == start_ticks
        )

    def exclusive(
        self, deployments: Iterable[str], *, job_id: str
    ) -> AbstractAsyncContextManager[None]:
        """Hold a turn on each of ``deployments`` (see :meth:`CommandLanes.exclusive`)."""
        return self.lanes.exclusive(deployments, job_id=job_id)

    # -- requests --------------------------------------------------------------------------

    async def acquire(self, deployment: str, *, priority: PriorityClass) -> Upstream:
        """Admit one request to ``deployment``, starting or healing its engine if needed.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            AdmissionRejected: ``draining``, ``crash_loop``, ``engine_unhealthy``,
                ``queue_full``, ``queue_timeout`` or ``insufficient_capacity`` (with
                ``retry_after_ms``).
        """
        found = self.deployment(deployment)
        self._refuse_now(found)
        # The common case -- a ready engine with a free slot and nobody queued -- is
        # admitted without waiting, so it needs no deadline (a cancel scope and a timer per
        # request cost more than the rest of admission).
        permit = found.gate.try_admit() if found.routable() else None
        if permit is None:
            found, permit = await self._admit_waiting(deployment, priority)
        self._tick += 1
        if found.generation:
            self.residency.touch(ResidencyKey(deployment, found.generation), self._tick)
        config = found.config
        return Upstream(
            deployment=deployment,
            generation=found.generation,
            base_url=f"http://127.0.0.1:{found.port}",
            permit=permit,
            request_timeout_s=config.request_timeout_ms / 1000,
            first_token_timeout_s=config.first_token_timeout_ms / 1000,
            stall_timeout_s=config.stall_timeout_ms / 1000,
            on_outcome=lambda generation, timed_out: self.record_outcome(
                deployment, generation, timed_out=timed_out
            ),
        )

    async def _admit_waiting(
        self, deployment: str, priority: PriorityClass
    ) -> tuple[Deployment, Permit]:
        """Admission that may wait (a cold or starting engine, a full gate), within the
        deployment's ``queue_timeout_ms``; the deployment admitted to and its permit.

        Raises:
            AdmissionRejected: as :meth:`acquire`.
        """
        found = self.deployment(deployment)
        timeout_s = found.config.queue_timeout_ms / 1000
        with anyio.move_on_after(timeout_s) as scope:
            while True:
                found = self.deployment(deployment)
                self._refuse_now(found)
                if found.evicting:
                    # Making room for another model: its relaunch (below, once it has
                    # stopped) serves this request; an operator's stop refuses above.
                    await found.ready.wait()
                    continue
                if not found.routable():
                    await self._wait_ready(found)
                permit = await found.gate.admit(priority)
                if found.routable() and self._live.get(deployment) is found:
                    break
                permit.release()  # evicted or replaced while it queued: start over
        if scope.cancelled_caught:
            raise self._waited_too_long(found, timeout_s)
        return found, permit

    async def _wait_ready(self, found: Deployment) -> None:
        """Ask for a load and wait until it is routable (or the load failed)."""
        if str(found.config.cold_start) == "reject":
            raise reject(
                AdmissionReason.ENGINE_UNHEALTHY,
                f"{found.deployment} has no ready replica (cold_start: reject)",
                deployment=found.deployment,
                retry_after_ms=1000,
            )
        self.request_load(found.deployment)
        found.add_waiter()  # keeps the generation from being evicted meanwhile
        try:
            while not found.routable():
                await found.ready.wait()
                self._refuse_failed(found)
        finally:
            found.drop_waiter()

    def _waited_too_long(self, found: Deployment, timeout_s: float) -> AdmissionRejected:
        if found.swap_waiting:  # its launch still waits for a busy generation
            return reject(
                AdmissionReason.INSUFFICIENT_CAPACITY,
                f"{found.deployment} waited {timeout_s:g} s for a busy resident model to go "
                "idle so that it could be swapped in; retry later",
                deployment=found.deployment,
                retry_after_ms=max(1000, found.config.queue_timeout_ms),
                retryable=True,  # busy, not too big: the swap fits once that model idles
            )
        return reject(
            AdmissionReason.QUEUE_TIMEOUT,
            f"{found.deployment} did not become ready within {timeout_s:g} s",
            deployment=found.deployment,
        )

    def _exhausted_refusal(self, found: Deployment) -> AdmissionRejected:
        """Why ``found`` is not loaded while its exhausted load job holds it failed."""
        return reject(
            AdmissionReason.CRASH_LOOP,
            f"{found.deployment} is held failed: its load job {found.exhausted_job} ended "
            f"recovery_exhausted ({found.last_error}); once the cause is fixed, a reset "
            f"(POST /admin/model-host/reset) or `sbproxy models load {found.deployment}` "
            "tries again",
            deployment=found.deployment,
        )

    def _refuse_now(self, found: Deployment) -> None:
        """Refuse at once what waiting cannot help: an operator's stop or drain, a crash
        loop, an exhausted load. An eviction (:attr:`Deployment.evicting`) is waited out."""
        if found.exhausted_job is not None:
            raise self._exhausted_refusal(found)
        if (found.state is S.DRAINING and not found.evicting) or found.gate.draining:
            raise reject(
                AdmissionReason.DRAINING,
                f"{found.deployment} is draining",
                deployment=found.deployment,
            )
        if found.crash is not None:
            raise reject(
                AdmissionReason.CRASH_LOOP,
                f"{found.deployment} is crash-looped: {found.crash.last_error}",
                deployment=found.deployment,
            )

    def _refuse_failed(self, found: Deployment) -> None:
        """After a wake-up: refuse when the load this request waited for failed."""
        if found.crash is not None or found.state is S.DRAINING:
            self._refuse_now(found)
        if found.state is not S.FAILED:
            return
        if found.reason_code == AdmissionReason.INSUFFICIENT_CAPACITY.value:
            raise reject(
                AdmissionReason.INSUFFICIENT_CAPACITY,
                found.last_error or "the deployment does not fit",
                deployment=found.deployment,
                retry_after_ms=max(1000, found.config.queue_timeout_ms),
                retryable=found.capacity_retryable,
            )
        # An engine that died or stopped answering is relaunched after its backoff (no
        # crash loop yet): the refusal says when to come back, like any passing refusal.
        relaunching = found.reason_code in _RELAUNCHED
        raise reject(
            AdmissionReason.ENGINE_UNHEALTHY,
            found.last_error or "the engine failed",
            deployment=found.deployment,
            retry_after_ms=max(1000, int((found.not_before - self.clock.now()) * 1000))
            if relaunching
            else None,
            retryable=True if relaunching else None,
        )

    def record_outcome(self, deployment: str, generation: int, *, timed_out: bool) -> None:
        """Count one request's end at the engine of ``deployment``/``generation``:
        ``unhealthy_after`` consecutive timeouts drain the generation and relaunch it after
        the restart backoff; a request that ended in time resets the count and the backoff.
        """
        found = self._live.get(deployment)
        if found is not None and found.count_outcome(generation, timed_out=timed_out):
            self.background(lambda: self._restart_unhealthy(found, generation))

    async def _restart_unhealthy(self, found: Deployment, generation: int) -> None:
        """Mark the generation unhealthy, drain it and relaunch after the backoff."""
        try:
            delay = restart_delay(self.backoff(found), found.failures + 1, self.jitter())
            message = (
                f"{found.timeouts} consecutive requests timed out at generation {generation}; "
                f"it is restarted in {delay:.1f} s"
            )
            if not found.unhealthy(
                generation, not_before=self.clock.now() + delay, message=message
            ):
                return
            logger.warning("%s: %s", found.deployment, message)
            await self._publish()
            await self.stop(found.deployment, reason="engine_unhealthy")
            self.request_load(found.deployment, reason="restart")
        finally:
            found.restart_finished()

    # -- launching -------------------------------------------------------------------------

    def backoff(self, found: Deployment) -> LaunchBackoff:
        """The deployment's launch and restart backoff (its config, unless the manager's)."""
        return backoff_of(found.config, self.backoff_override)

    def _ctx_size(self, found: Deployment) -> int:
        assert found.artifact is not None  # noqa: S101 - resolved before launch
        return max(1, min(found.config.max_context or found.artifact.context_length, 1 << 20))

    def estimate(
        self, found: Deployment, metadata: CachedMetadata, *, tensor_parallel: int = 1
    ) -> MemoryEstimate:
        """Memory estimate of one generation from the artifact's GGUF header, per device
        when split across ``tensor_parallel`` devices."""
        snapshot = self.cache.snapshot(metadata.artifact_digest)
        ggufs = [f for f in metadata.files if f.path.endswith(".gguf")]
        facts = read_gguf_header(snapshot / ggufs[0].path) if ggufs else None
        return estimate_memory(
            weights_bytes=metadata.total_size_bytes,
            facts=facts,
            seq_len=self._ctx_size(found),
            concurrency=found.config.max_concurrency,
            kv_quant=found.config.kv_quant,
            safety_margin=self.safety_margin,
            format_quant=metadata.quant,
            tensor_parallel=tensor_parallel,
        )

    def _select_devices(self, found: Deployment) -> tuple[int, ...]:
        """The devices the deployment's current generation runs on: those it ran on before
        when it restarts under its own number, else :func:`select_devices`.

        Raises:
            AdmissionRejected: ``insufficient_capacity`` (see :func:`select_devices`).
        """
        before = self._placed.get(found.deployment, {}).get(found.generation)
        if before:
            return before
        config = found.config
        free = {index: self.residency.free_bytes(index) for index in self.devices.indexes()}
        devices = select_devices(
            free,
            deployment=found.deployment,
            count=config.tensor_parallel or 1,
            pinned=config.devices,
        )
        recent = self._placed.setdefault(found.deployment, {})
        recent[found.generation] = devices
        for generation in sorted(recent)[:-2]:
            del recent[generation]
        logger.info(
            "%s generation %d: %s device(s) %s",
            found.deployment,
            found.generation,
            self.devices.accelerator.value,
            ",".join(str(index) for index in devices),
        )
        return devices

    async def launch_generation(
        self,
        found: Deployment,
        *,
        executable: Path,
        job_id: str,
        generation: int | None = None,
    ) -> int:
        """Start a new generation of ``found`` and wait until it is ready; its port.

        Idempotency: a live, ready engine of this deployment is reused; concurrent callers
        serialize on the deployment, and the second finds it ready. Launches across
        deployments run at most ``max_parallel_prepares`` at once. A launch waits out the
        restart backoff first. Early exits retry with the backoff (jittered); exhaustion (or
        a non-retryable failure) retains ``crash_loop``; a lost port retries at once on a
        new one. ``generation`` restarts a stopped generation under its own number (a
        failed ``recreate`` rollout restoring the prior engine). A cancelled launch (a stop
        superseded it) stops its child and leaves the deployment ``stopped``.

        Raises:
            EngineError: ``crash_loop`` (or the non-retryable launch error),
                ``start_timeout`` (no ``/health`` within ``start_timeout_ms``),
                ``artifact_not_ready``.
            AdmissionRejected: ``insufficient_capacity`` when the estimate does not fit,
                even after waiting for busy generations to go idle.
        """
        async with found.launching, self.prepares:
            return await self._launch_locked(
                found, executable=executable, job_id=job_id, generation=generation
            )

    async def _launch_locked(
        self, found: Deployment, *, executable: Path, job_id: str, generation: int | None
    ) -> int:
        if found.routable():
            assert found.port is not None  # noqa: S101 - a routable deployment has a port
            return found.port
        if found.crash is not None:
            raise EngineError(found.crash.last_error, code="crash_loop")
        artifact = found.artifact
        metadata = self.cache.read_metadata(artifact.digest) if artifact else None
        if metadata is None:
            raise EngineError("the artifact is not in the cache", code="artifact_not_ready")
        if found.process is not None:  # a dead or foreign-held generation: clear it first
            await self._release_generation(found)
        found.begin_launch(metadata, executable, job_id)
        await self._publish()
        wait_s = found.not_before - self.clock.now()
        if wait_s > 0:
            logger.info("%s: relaunch in %.2f s (restart backoff)", found.deployment, wait_s)
            await self.clock.sleep(wait_s)
        found.numbered(generation or await self.runtime_store.next_generation(found.deployment))
        try:
            devices = self._select_devices(found)
            estimate = self.estimate(found, metadata, tensor_parallel=len(devices))
            await self._reserve(found, found.key, estimate, devices)
        except AdmissionRejected as exc:
            found.refused_capacity(exc.code, exc.message, retryable=exc.retryable)
            await self._publish()
            raise
        found.reserved(estimate)
        try:
            process, port = await self._spawn_until_ready(found, metadata, executable, job_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.residency.release(found.key)
                self._capacity_changed()
                found.launch_abandoned()
                await self._publish()
            raise
        found.launched(process, port, self.cache.lease(metadata.artifact_digest))
        # Requests that find this engine gone later need a new load, not this one.
        self.queue(found.deployment).close_joins()
        await self._publish()
        self._watch_exit(found, process, found.generation)
        return port

    async def _reserve(
        self,
        found: Deployment,
        key: ResidencyKey,
        estimate: MemoryEstimate,
        devices: tuple[int, ...],
    ) -> None:
        """Reserve ``estimate`` for ``key`` on each of ``devices``; evict idle victims; wait
        for busy ones (swap wait).

        Raises:
            AdmissionRejected: ``insufficient_capacity`` (with ``retry_after_ms``) when it
                cannot fit, or a busy generation stayed busy past the queue timeout.
        """
        timeout_s = found.config.queue_timeout_ms / 1000
        started = self.clock.now()
        held: list[Deployment] = []
        try:
            while True:
                self._tick += 1
                try:
                    # Protection comes from the deployment's state (preparing) through
                    # ``_protected``, so a swap can tell a transient hold from a pin.
                    plan = self.residency.reserve(
                        key, estimate=estimate, devices=devices, protected=False, tick=self._tick
                    )
                    break
                except AdmissionRejected as exc:
                    blockers = self._busy_blockers(key, estimate, devices)
                    decision = after_no_room(
                        busy_blockers=len(blockers),
                        started=started,
                        now=self.clock.now(),
                        timeout_s=timeout_s,
                    )
                    if decision.verdict is SwapVerdict.REFUSE:
                        raise self._no_room(found, exc, blockers, decision) from None
                    # Hold only generations that serve: a starting one must let its first
                    # waiters in, or it would be evicted before it served.
                    held.extend(b for b in blockers if b not in held and b.hold())
                    found.swap_wait(True)
                    # Woken when a gate goes idle, a reservation is freed or a state
                    # changes; looked at again after ``wait_s`` at the latest.
                    changed = self._capacity
                    with anyio.move_on_after(decision.wait_s):
                        await changed.wait()
            for victim in plan.victims:
                evicted = self._live.get(victim.key.deployment)
                if evicted is not None and evicted.generation == victim.key.generation:
                    await self._evict(evicted, job_id=found.job_id)
        finally:
            for blocker in held:
                blocker.release()
            if found.swap_waiting:
                found.swap_wait(False)
                self.tallies.swap_waits.observe(self.clock.now() - started)

    def _no_room(
        self,
        found: Deployment,
        exc: AdmissionRejected,
        blockers: list[Deployment],
        decision: SwapDecision,
    ) -> AdmissionRejected:
        """The refusal of a reservation, as :func:`after_no_room` decided it (with blockers:
        it would fit once they idle, so it is retryable after ``retry_after_ms``)."""
        waited = (
            f"; waited {decision.waited_s:.1f} s for "
            f"{', '.join(b.deployment for b in blockers)} to go idle"
            if blockers
            else ""
        )
        return reject(
            AdmissionReason.INSUFFICIENT_CAPACITY,
            exc.message + waited,
            deployment=found.deployment,
            retry_after_ms=decision.retry_after_ms,
            retryable=decision.retryable,
        )

    def _busy_blockers(
        self, key: ResidencyKey, estimate: MemoryEstimate, devices: tuple[int, ...]
    ) -> list[Deployment]:
        """The busy or transient (preparing, draining) generations whose eviction would make
        ``key`` fit once they settle (empty: it would not fit even then -- pinned, or too
        large -- and waiting cannot help)."""
        try:
            plan = self.residency.plan(
                ReservationRequest(key=key, estimate=estimate, devices=devices),
                is_protected=lambda other: self._protected(other, transient=False),
            )
        except AdmissionRejected:
            return []
        blockers = []
        for victim in plan.victims:
            found = self._live.get(victim.key.deployment)
            if found is not None and found.generation == victim.key.generation:
                blockers.append(found)
        return blockers

    def _launch_spec(
        self, found: Deployment, metadata: CachedMetadata, executable: Path, timeout_s: float
    ) -> LaunchSpec:
        config = found.config
        request = LaunchRequest(
            deployment=found.deployment,
            generation=found.generation,
            metadata=metadata,
            snapshot=self.cache.snapshot(metadata.artifact_digest),
            port=free_port(),
            ctx_size=self._ctx_size(found) * config.max_concurrency,
            max_concurrency=config.max_concurrency,
            kv_quant=str(config.kv_quant),
            extra_args=tuple(config.extra_args),
            chat_template=_pinned_template(found),
            **self._device_request(found),
        )
        return LaunchSpec(
            request=request,
            executable=executable,
            log_path=self.layout.engine_log(found.deployment, found.generation),
            label=f"{found.deployment}/{found.generation}",
            ready_timeout_s=timeout_s,
        )

    def _device_request(self, found: Deployment) -> dict[str, Any]:
        """The launch fields that place an engine on its devices: the host's accelerator;
        on an accelerator the reserved devices, the estimate and the smallest device's
        memory; on a CPU host split into several devices, the threads of the shares it
        holds."""
        accelerator = self.devices.accelerator
        devices = self._reserved_devices(found)
        if accelerator is Accelerator.CPU:
            shares = len(self.devices.devices)
            if shares <= 1 or _sets_threads(found.config.extra_args):
                return {"accelerator": "cpu"}
            per_share = max(1, (os.cpu_count() or 1) // shares)
            return {"accelerator": "cpu", "threads": per_share * max(1, len(devices))}
        totals = [d.total_bytes for i in devices if (d := self.devices.get(i)) is not None]
        return {
            "accelerator": accelerator.value,
            "devices": devices,
            "gpu_memory_bytes": found.estimate.total_bytes if found.estimate else None,
            "device_memory_bytes": min(totals) if totals else None,
        }

    async def _spawn_until_ready(
        self, found: Deployment, metadata: CachedMetadata, executable: Path, job_id: str
    ) -> tuple[Engine, int]:
        """Launch attempts until one is ready, as :func:`after_failed_spawn` decides."""
        backoff = self.backoff(found)
        timeout_s = start_timeout_s(found.config, self.ready_timeout_s)
        attempts = Attempts()
        while True:
            spec = self._launch_spec(found, metadata, executable, timeout_s)
            try:
                return await self.launcher.spawn(spec), spec.request.port
            except EngineError as exc:
                decision = after_failed_spawn(
                    attempts,
                    code=exc.code,
                    retryable=exc.retryable,
                    backoff=backoff,
                    sample=self.jitter(),
                    now_ms=wall_clock_ms(),
                )
                attempts = decision.attempts
                if decision.verdict is Verdict.RETRY_PORT:
                    logger.warning(
                        "%s: port %d was taken; retrying on another",
                        found.deployment,
                        spec.request.port,
                    )
                elif decision.verdict is Verdict.RETRY:
                    logger.warning(
                        "%s: launch %d failed (%s); retrying",
                        found.deployment,
                        attempts.failed,
                        exc.code,
                    )
                    await self.clock.sleep(decision.delay_s)
                else:
                    await self._launch_failed(found, exc, decision.verdict, attempts, timeout_s)

    async def _launch_failed(
        self,
        found: Deployment,
        exc: EngineError,
        verdict: Verdict,
        attempts: Attempts,
        timeout_s: float,
    ) -> NoReturn:
        """Retain a launch's failure (``start_timeout`` or ``crash_loop``) and raise it."""
        name = found.deployment
        if verdict is Verdict.START_TIMEOUT:
            found.start_timed_out(
                f"the engine did not answer /health within {timeout_s:g} s "
                f"(start_timeout_ms): {exc.message}"
            )
            await self._publish()
            raise EngineError(
                f"{name}: the engine was not ready within {timeout_s:g} s; it was stopped",
                code="start_timeout",
                remediation=f"Raise proxy.model_host.deployments.{name}.start_timeout_ms or "
                "check the engine log; the next request or a reset retries.",
                details={"deployment": name, "log": exc.details.get("log")},
            ) from exc
        now = wall_clock_ms()
        crash = CrashLoop(
            attempts=attempts.failed,
            reason=exc.code,
            last_error=exc.message,
            stderr_tail=str(exc.details.get("stderr_tail") or ""),
            first_failure_at_ms=attempts.first_failure_ms or now,
            last_failure_at_ms=now,
            job_id=found.job_id,
        )
        found.crash_looped(crash, f"{exc.code} after {attempts.failed} launch(es): {exc}")
        await self._publish()
        raise EngineError(
            str(exc), code="crash_loop", remediation="Fix the cause, then reset the deployment."
        ) from exc

    def _watch_exit(self, found: Deployment, process: Engine, generation: int) -> None:
        """Stop routing the moment the child exits (not at the next health probe)."""

        async def watch() -> None:
            status = await process.wait_exit()
            if found.process is process and found.generation == generation:
                await self._engine_lost(
                    found,
                    generation,
                    f"the engine exited with status {status}: {process.stderr_tail(15)}",
                )

        self.start_contained(watch, what=f"the exit watcher of {found.deployment}")

    async def _engine_lost(self, found: Deployment, generation: int, message: str) -> None:
        """A ready generation died or stopped answering: fail it, free what it held, and
        set the restart backoff (the next request relaunches it after that)."""
        delay = restart_delay(self.backoff(found), found.failures + 1, self.jitter())
        if not found.lost(generation, message, not_before=self.clock.now() + delay):
            return
        await self._publish()
        await self._release_generation(found)
        found.pulse()

    async def _release_generation(self, found: Deployment) -> None:
        """Stop the deployment's engine (if any) and free its reservation, lease and port."""
        process, lease = found.detach()
        if process is not None:
            with anyio.CancelScope(shield=True):
                await self.launcher.stop(
                    process,
                    grace_s=self._remaining_s(min(self.shutdown_deadline_s, 10.0)),
                    kill_wait_s=2.0 if self._closing_at is not None else 5.0,
                )
        if found.generation:
            self.residency.release(found.key)
            self._capacity_changed()
        if lease is not None:
            lease.release()

    async def _evict(self, found: Deployment, *, job_id: str | None) -> None:
        """Stop an idle generation to make room; its gate (and any held queue) stays."""
        if found.state not in (S.READY, S.FAILED):
            await self._release_generation(found)
            return
        retained = found.begin_evict(job_id=job_id)
        await self._publish()
        await self._release_generation(found)
        found.drained(retained, job_id=job_id, reason="evicted")
        await self._publish()

    async def drain_deployment(
        self, found: Deployment, *, job_id: str | None = None, reason: str | None = None
    ) -> dict[str, object]:
        """Refuse new work, cancel the queue, wait for active requests (up to the shutdown
        deadline), stop the engine. A failed deployment stays failed.

        Idempotency: draining a stopped deployment only settles its state.
        """
        retained = found.begin_drain(job_id=job_id, reason=reason)
        await self._publish()
        report = await found.gate.drain(deadline_s=self._remaining_s(self.shutdown_deadline_s))
        await self._release_generation(found)
        found.drained(retained, job_id=job_id, reason=reason)
        await self._publish()
        return {
            "active_at_start": report.active_at_start,
            "cancelled_queued": report.cancelled_queued,
            "remaining_active": report.remaining_active,
            "timed_out": report.timed_out,
        }

    # -- commands --------------------------------------------------------------------------

    async def adopt_runtime_jobs(self) -> list[str]:
        """Run every unfinished ``load``, ``drain`` and ``reset`` job that no command lane
        of this host holds, in its deployment's command order, oldest first; the ids taken.

        Called at start (the jobs of a host that died) and every :data:`ADOPT_POLL_S`
        seconds after (a job ``sbproxy jobs retry`` queued, or one the journal's recovery
        returned to the queue), so a queued runtime job never waits for a restart.

        Never taken: another node's job (hosts sharing a journal); a job running under
        another live process (pid and start time: only a dead owner's work is adopted).
        Never run: a job of a deployment this host's configuration does not declare, or
        whose definition changed since the job was submitted (``config_digest`` of its
        input) -- those are ended ``cancelled`` with a
        ``superseded`` event that says why, since running them would start an engine no
        configuration asks for.
        """
        mark = self.lanes.mark()
        active = (JobStatus.QUEUED, JobStatus.RUNNING)
        jobs = await self.engine.store.list_jobs(statuses=active, limit=-1)
        if not self.lanes.quiet_since(mark):
            return []  # a command was submitting: its job may not be in its lane yet
        taken = []
        for job in sorted(jobs, key=lambda j: (j.created_at_ms, j.id)):
            if job.node not in (None, self.engine.store.node):
                continue  # another host's job on a shared journal: never adopted or ended here
            kind = _COMMAND_OF_KIND.get(job.kind)
            subject = job.subject or ""
            if kind is None or not subject.startswith("deployment:") or self.lanes.holds(job.id):
                continue
            if job.status == JobStatus.RUNNING and self._owned_by_a_live_other(job):
                continue  # a live process runs it: never taken from a live owner
            deployment = subject.removeprefix("deployment:")
            why = self._not_runnable_here(job, deployment)
            if why is not None:
                await self._end_unrunnable(job, why)
                continue
            queue = self.queue(deployment)
            command, _ = queue.submit(kind, reason="recovered", join=False)
            if job.cancel_requested:
                command.superseded_by = command.seq  # ends cancelled; nothing joins it
            command.assign(job.id)
            logger.info("adopted unfinished %s job %s of %s", job.kind, job.id, deployment)
            self._spawn_command(queue, command, None)
            taken.append(job.id)
        return taken

    def _owned_by_a_live_other(self, job: JobRecord) -> bool:
        owner = job.lease_owner
        return owner is not None and owner != self.identity.owner and not owner_is_gone(owner)

    def _not_runnable_here(self, job: JobRecord, deployment: str) -> str | None:
        """Why this host must not run ``job`` (``None``: it may)."""
        found = self._live.get(deployment)
        if found is None:
            return (
                f"deployment {deployment!r} is not declared in this host's configuration; "
                f"the {job.kind} job came from another configuration"
            )
        recorded = job.input.get("config_digest")
        if recorded is not None and recorded != deployment_digest(found.config):
            return (
                f"the definition of {deployment} changed since this {job.kind} job was "
                "submitted; the current configuration decides what runs"
            )
        return None

    async def _end_unrunnable(self, job: JobRecord, why: str) -> None:
        """End a job this host will not run: a ``superseded`` event saying why, then a
        durable cancellation (immediate for a queued job; a dead owner's running job is
        returned to the queue by recovery first and ends at the next pass)."""
        if job.cancel_requested and job.status == JobStatus.RUNNING:
            return  # already asked; recovery re-queues it and the cancellation ends it
        logger.warning("not running %s job %s: %s", job.kind, job.id, why)
        await self.engine.store.record_event(
            job.id, kind="superseded", data={"reason": "not_declared", "message": why}
        )
        await self._cancel_job(job.id)

    def request_load(self, deployment: str, *, reason: str = "request") -> Command:
        """Enter a ``load`` command now (joining the newest load) and run it in the
        background; the command (``assigned`` is set once its job exists).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        found = self.deployment(deployment)
        if found.exhausted_job is not None:
            raise self._exhausted_refusal(found)
        queue = self.queue(deployment)
        fresh_queue = not queue.pending
        command, created = queue.submit(CommandKind.LOAD, reason=reason)
        if created:
            # The stable key joins a load a crashed host left unfinished; behind other
            # commands the key is the command's own, so it never joins a superseded load.
            key = f"load:{deployment}" if fresh_queue else f"load:{deployment}:{command.seq}"
            self._spawn_command(
                queue, command, lambda: submit_load(self.port, deployment, idempotency_key=key)
            )
        return command

    async def load(self, deployment: str, *, reason: str = "admin") -> JobRecord:
        """Command: make ``deployment`` ready (a ``load`` job, joined when one is newest).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        # An operator's load is the explicit retry an exhausted load waits for.
        self.deployment(deployment).clear_exhausted()
        command = self.request_load(deployment, reason=reason)
        return await self._job_of(command)

    async def stop(self, deployment: str, *, reason: str = "stop") -> JobRecord:
        """Command: drain and stop ``deployment`` (a ``drain`` job). Supersedes every
        earlier load of it: a waiting one never runs, a running one is cancelled.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.deployment(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.STOP, reason=reason)
        for earlier in queue.pending:
            if earlier.superseded_by == command.seq and earlier.job_id is not None:
                await self._cancel_job(earlier.job_id)
        self._spawn_command(
            queue, command, lambda: submit_drain(self.port, deployment, reason=reason)
        )
        return await self._job_of(command)

    async def reset(self, deployment: str) -> JobRecord:
        """Command: clear a retained failure (a ``reset`` job), in arrival order.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.deployment(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.RESET, reason="admin")
        self._spawn_command(queue, command, lambda: submit_reset(self.port, deployment))
        return await self._job_of(command)

    async def _job_of(self, command: Command) -> JobRecord:
        await command.assigned.wait()
        if command.job_id is None and command.refused is not None:
            raise command.refused
        if command.job_id is None:
            raise SbproxyError(
                f"the {command.kind.value} command could not be submitted",
                code="prepare_failed",
                remediation="See the host log for the cause, then try again.",
            )
        return await self.engine.get(command.job_id)

    async def _cancel_job(self, job_id: str) -> None:
        """Cancel a superseded job durably, and free its idempotency key so that nothing
        joins it while it winds down."""
        try:
            await self.engine.cancel(job_id)
            await self.engine.store.detach_key(job_id)
        except SbproxyError as exc:  # already finished: nothing to cancel
            logger.debug("cancel of superseded job %s: %s", job_id, exc)

    def _spawn_command(
        self,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        if self._group is None:  # not started: the command is not run (unit tests)
            queue.finish(command)
            return
        self.background(lambda: self._run_command(queue, command, submit))

    async def _run_command(
        self,
        queue: CommandQueue,
        command: Command,
        submit: Callable[[], Awaitable[JobRecord]] | None,
    ) -> None:
        """Submit the command's job now, run it in the command's turn, settle the state."""
        try:
            if command.job_id is None and submit is not None:
                with self.lanes.submitting():
                    command.assign((await submit()).id)
            async with queue.turn(command):
                if command.job_id is None:
                    return
                if command.superseded_by is not None:
                    await self._cancel_job(command.job_id)
                final = await self.engine.join(command.job_id)
                await self._settle(queue.deployment, command, final)
        except SbproxyError as exc:  # the journal refused (a full disk): no traceback
            if command.job_id is None:
                command.refused = exc  # the caller gets this error (journal_unavailable: 503)
            logger.error(
                "%s command of %s failed: %s [%s]",
                command.kind.value,
                queue.deployment,
                exc,
                exc.code,
            )
            if command.kind is CommandKind.LOAD:
                await self._settle(queue.deployment, command, None, cause=exc)
        except Exception:
            logger.exception("%s command of %s failed", command.kind.value, queue.deployment)
            if command.kind is CommandKind.LOAD:
                await self._settle(queue.deployment, command, None)
        finally:
            queue.finish(command)
            found = self._live.get(queue.deployment)
            if found is not None:
                found.pulse()

    async def _settle(
        self,
        deployment: str,
        command: Command,
        final: JobRecord | None,
        *,
        cause: SbproxyError | None = None,
    ) -> None:
        """After a load job ended without a ready engine (or could not even be journaled:
        ``cause``), make the deployment say why."""
        found = self._live.get(deployment)
        if found is None or command.kind is not CommandKind.LOAD or found.routable():
            return
        if final is not None and final.status == JobStatus.CANCELLED:
            return  # superseded: the stop that won sets the state
        if found.state in (S.FAILED, S.DRAINING):
            return  # the launch already said why (or a drain decides)
        error = final.error if final is not None else None
        if cause is not None:
            code, message = cause.code, cause.message
        else:
            code = error.code if error else "prepare_failed"
            message = error.message if error else "the load did not finish"
        found.failed_before_launch(code, message, job_id=command.job_id)
        await self._publish()

    # -- maintenance -----------------------------------------------------------------------

    async def _adoption(self) -> None:
        """Take queued runtime jobs this host does not hold yet (``adopt_runtime_jobs``)."""
        while True:
            await anyio.sleep(ADOPT_POLL_S)
            try:
                await self.adopt_runtime_jobs()
            except SbproxyError as exc:  # a journal that cannot be read now: next pass
                logger.warning("runtime job adoption skipped: %s [%s]", exc, exc.code)

    async def _maintenance(self) -> None:
        while True:
            await anyio.sleep(self.health_interval_s)
            try:
                await self.tick()
            except Exception:
                # One failed pass (a probe, a journal write) must not stop the loop.
                logger.exception("maintenance tick failed")

    async def tick(self) -> None:
        """One maintenance pass: health and socket-ownership probes of ready engines,
        keep-alive expiry (on the injected clock)."""
        for found in list(self._live.values()):
            process, generation, port = found.process, found.generation, found.port
            if found.state is not S.READY or process is None or port is None:
                continue
            # Ownership first: /health goes only to a socket our child holds, never to a
            # process that took the port.
            probe = await self.launcher.probe(process, port)
            if found.process is not process or found.generation != generation:
                continue  # changed while probing
            verdict, why = after_probe(probe, found.health_misses)
            if verdict is ProbeVerdict.HEALTHY:
                found.health_ok()
            elif verdict is ProbeVerdict.MISSED:
                found.health_missed()
            else:
                detail = process.stderr_tail(15) if probe.health == "stopped" else f"port {port}"
                await self._engine_lost(found, generation, f"{why} ({detail})")
            if keep_alive_due(
                found.state,
                commands_pending=self.lanes.pending(found.deployment),
                gate=found.gate,
                keep_alive_s=found.config.keep_alive_secs,
                now=self.clock.now(),
            ):
                await self.stop(found.deployment, reason="keep_alive")

    async def shutdown(self, *, deadline_s: float | None = None) -> None:
        """Let in-flight commands settle, then drain every deployment (staged ones too, all
        at once) and stop every engine, all within ``deadline_s`` seconds from now (default
        ``shutdown_deadline_ms``): half the budget for commands to settle, what is left for
        the drains; engines still up at the end are killed. Unfinished jobs stay in the
        journal and resume at the next start."""
        budget = self.shutdown_deadline_s if deadline_s is None else max(0.0, deadline_s)
        end = anyio.current_time() + budget
        self._closing_at = end
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(budget / 2):
                while self._background:
                    await anyio.sleep(0.05)
            every = [*self._live.values(), *self.staging.staged.values()]
            running = [found for found in every if found.process is not None]
            with anyio.move_on_after(max(0.0, end - anyio.current_time())):
                async with anyio.create_task_group() as group:
                    for found in running:
                        group.start_soon(self._drain_for_shutdown, found)
            self.kill_engines()
            for found in running:
                await self._release_generation(found)

    async def _drain_for_shutdown(self, found: Deployment) -> None:
        try:
            await self.drain_deployment(found)
        except SbproxyError as exc:  # an engine that will not die is killed right after
            logger.error("%s: shutdown drain failed: %s", found.deployment, exc)

    def _remaining_s(self, wanted_s: float) -> float:
        """``wanted_s``, or less when a shutdown's deadline comes sooner."""
        if self._closing_at is None:
            return wanted_s
        return max(0.0, min(wanted_s, self._closing_at - anyio.current_time()))

    def kill_engines(self) -> list[int]:
        """SIGKILL every engine this manager holds (current and staged) at once, without
        grace: a second stop signal. A running :meth:`shutdown` then sees them exit. The
        pids signalled."""
        killed = []
        for process in self._engines():
            if process.alive():
                self.launcher.kill(process)
                killed.append(process.pid)
        return killed

    # -- reload staging (runtime/reload.py calls these with ``self.staging``) --------------

    def stage(
        self, deployment: str, config: DeploymentConfig, artifact: ResolvedArtifact
    ) -> Deployment:
        """A new, not yet routed deployment for ``deployment`` (a changed or added
        definition), kept in :attr:`staging`."""
        fresh = self._new_deployment(deployment, config)
        fresh.use_artifact(artifact)
        self.staging.stage(fresh)
        return fresh

    async def recreate_stop(self, found: Deployment, *, job_id: str) -> None:
        """Drain and stop a live generation a ``recreate`` rollout replaces, remembering
        whether it was ready (a rollback restarts it)."""
        was_ready = found.routable()
        await self.drain_deployment(found, job_id=job_id)
        self.staging.recreated(found, was_ready=was_ready)

    async def roll_back(self) -> list[str]:
        """Undo a staging: stop the staged engines, restart the generations a ``recreate``
        stopped (under their own generation numbers); the deployments discarded."""
        with anyio.CancelScope(shield=True):
            staged, recreated = self.staging.take()
            for found in staged.values():
                if found.process is not None or found.state is not S.CONFIGURED:
                    await self.drain_deployment(found)
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
            self.staging.end()
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
        :meth:`drain_deployment` retires them)."""
        staged, _ = self.staging.take()
        live = dict(self._live)
        retired: list[Deployment] = []
        for name in removed:
            gone = live.pop(name, None)
            if gone is not None:
                retired.append(gone)
        for name in (*added, *changed):
            fresh = staged.get(name)
            if fresh is None:
                if name not in live:  # resumed without staged state: start cold
                    live[name] = self._new_deployment(name, candidate.deployments[name])
                continue
            old = live.get(name)
            if old is not None:
                retired.append(old)
            live[name] = fresh
        self._live = live
        self.compiled = candidate
        self.catalog = catalog
        self._take_host_policies(candidate)
        return retired

    async def enforce_resident_limit(self, limit: int | None, *, job_id: str) -> None:
        """Apply ``cache.max_resident_models``: a lowered limit evicts idle generations,
        least recently used first; with too much protected work the old limit stays
        (logged)."""
        try:
            victims = self.residency.enforce_limit(limit).victims
        except AdmissionRejected as exc:
            logger.warning("max_resident_models %s is not applied: %s", limit, exc)
            return
        for victim in victims:
            evicted = self._live.get(victim.key.deployment)
            if evicted is not None and evicted.generation == victim.key.generation:
                await self.drain_deployment(evicted, job_id=job_id)

    async def record_revision(self, *, content_digest: str, desired: Mapping[str, Any]) -> int:
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

    @property
    def port(self) -> RuntimeSteps:
        """The :class:`~sbproxy.model_host.runtime.port.RuntimePort` of the durable steps
        (add it to the workflow engine's resources)."""
        return RuntimeSteps(self)


class RuntimeSteps:
    """The :class:`~sbproxy.model_host.runtime.port.RuntimePort` over a manager: what the
    ``load``, ``drain`` and ``reset`` steps may do, and nothing else."""

    def __init__(self, manager: RuntimeManager) -> None:
        self._manager = manager

    @property
    def engine(self) -> WorkflowEngine:
        """The workflow engine the jobs are journaled in."""
        return self._manager.engine

    def definition_digest(self, deployment: str) -> str:
        """See :meth:`RuntimePort.definition_digest`."""
        return deployment_digest(self._manager.deployment(deployment).config)

    def step_scope(
        self, job_id: str, deployment: str, kind: CommandKind
    ) -> AbstractAsyncContextManager[None]:
        """See :meth:`CommandLanes.step_scope`."""
        return self._manager.lanes.step_scope(job_id, deployment, kind)

    def resolve(self, deployment: str) -> ResolvedArtifact:
        """See :meth:`RuntimeManager.resolve`."""
        return self._manager.resolve(deployment)

    async def pull(self, deployment: str, artifact: ResolvedArtifact) -> PullOutput:
        """See :meth:`RuntimeManager.pull`."""
        return await self._manager.pull(deployment, artifact)

    async def provision_engine(self) -> Path:
        """See :meth:`RuntimeManager.provision_engine`."""
        return await self._manager.provision_engine()

    async def launch(
        self, deployment: str, artifact: ResolvedArtifact, executable: Path, *, job_id: str
    ) -> Launched:
        """See :meth:`RuntimeManager.launch_generation`."""
        manager = self._manager
        found = manager.deployment(deployment)
        found.use_artifact(artifact)
        port = await manager.launch_generation(found, executable=executable, job_id=job_id)
        process = found.process
        return Launched(
            generation=found.generation,
            port=port,
            pid=process.pid if process else None,
            start_ticks=process.start_ticks if process else None,
        )

    async def drain(self, deployment: str, *, job_id: str, reason: str | None) -> dict[str, object]:
        """See :meth:`RuntimeManager.drain_deployment`."""
        manager = self._manager
        return await manager.drain_deployment(
            manager.deployment(deployment), job_id=job_id, reason=reason
        )

    async def reset(self, deployment: str, *, job_id: str) -> tuple[bool, str]:
        """Clear a retained failure so the deployment may launch again (backoff too);
        ``(cleared, state)``. A deployment that has not failed has nothing to reset.

        Raises:
            SbproxyError: ``draining`` while it is preparing or draining.
        """
        manager = self._manager
        found = manager.deployment(deployment)
        cleared = found.reset(job_id=job_id)
        await manager._publish()
        return cleared, found.state.value

    def observe(
        self, deployment: str, *, generation: int, pid: int | None, start_ticks: str | None
    ) -> bool:
        """See :meth:`RuntimeManager.observe_generation`."""
        return self._manager.observe_generation(
            deployment, generation=generation, pid=pid, start_ticks=start_ticks
        )


def artifact_request(config: DeploymentConfig) -> ArtifactRequest:
    """What a deployment asks the catalog for (model, variant, engine, replicas)."""
    return ArtifactRequest.model_validate(
        {
            "model": config.model,
            "variant": config.variant,
            "engine": str(config.engine),
            "replicas": config.replicas,
            "heterogeneous_variants": config.heterogeneous_variants,
        }
    )


def desired_of(compiled: CompiledConfig) -> dict[str, Any]:
    """The desired deployments of ``compiled`` as JSON objects by id."""
    return {k: v.model_dump(mode="json") for k, v in compiled.deployments.items()}


def deployment_digest(config: DeploymentConfig) -> str:
    """SHA-256 hex of one deployment's definition (RFC 8785 canonical JSON): what a
    ``load`` job records, so that a host never runs a load its configuration changed."""
    return desired_digest({"deployment": config.model_dump(mode="json")})


def desired_digest(desired: Mapping[str, object]) -> str:
    """SHA-256 hex of the RFC 8785 canonical JSON of desired deployments (stable across key
    order and a JSON round trip)."""
    return hashlib.sha256(rfc8785.dumps(dict(desired))).hexdigest()  # type: ignore[arg-type]
