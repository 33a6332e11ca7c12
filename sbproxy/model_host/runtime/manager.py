"""The runtime manager: the one owner of live deployment state.

Per deployment it holds the admission gate, the current generation (engine process,
loopback port, artifact lease, memory reservation), the lifecycle state, the retained
failure and the :class:`~sbproxy.model_host.runtime.commands.CommandQueue`. Nothing outside
this module writes a slot: callers send commands (:meth:`RuntimeManager.load`,
:meth:`~RuntimeManager.stop`, :meth:`~RuntimeManager.reset`, a reload's
:meth:`~RuntimeManager.exclusive` turn) and read frozen snapshots
(:meth:`~RuntimeManager.status`, :meth:`~RuntimeManager.snapshot`).

* **Ordered commands.** Commands on one deployment run in arrival order and the last one
  wins (``commands.py``): a stop supersedes a load in flight (its launch is cancelled and
  its child stopped), a load after a stop runs after it and ends ready. Slow work runs in
  durable jobs (``runtime/jobs.py``) that the manager itself runs in the command's turn --
  including jobs a crashed host left unfinished, adopted at :meth:`~RuntimeManager.start`
  -- so the job worker loop never runs them out of order.
* **Checked transitions.** Every state change goes through one function that checks
  :data:`~sbproxy.model_host.runtime.state.DEPLOYMENT_TRANSITIONS`, logs, appends a
  ``deployment`` event to the job that caused it and tells the metrics sink.
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

import hashlib
import logging
import random
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import rfc8785

from sbproxy.catalog import (
    ArtifactRequest,
    Catalog,
    ResolvedArtifact,
    WorkerProfile,
    resolve_artifact,
)
from sbproxy.config import CompiledConfig, DeploymentConfig, PriorityClass
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache, CachedMetadata, CacheLayout
from sbproxy.model_host.artifacts.locks import DigestLease
from sbproxy.model_host.engines import (
    EngineError,
    EngineProcess,
    LaunchRequest,
    launch,
    plan_llama_launch,
    reap_orphans,
)
from sbproxy.model_host.runtime.admission import (
    AdmissionGate,
    AdmissionReason,
    AdmissionRejected,
    Permit,
    keep_alive_expired,
    reject,
)
from sbproxy.model_host.runtime.clock import Clock, MonotonicClock
from sbproxy.model_host.runtime.commands import Command, CommandKind, CommandQueue
from sbproxy.model_host.runtime.memory import MemoryEstimate, estimate_memory, read_gguf_header
from sbproxy.model_host.runtime.residency import ReservationRequest, Residency, ResidencyKey
from sbproxy.model_host.runtime.state import (
    DEPLOYMENT_TRANSITIONS,
    CrashLoop,
    DeploymentState,
    DeploymentStatus,
    LaunchBackoff,
    bounded,
)
from sbproxy.store import JobRecord, JobStatus, RuntimeStore, wall_clock_ms
from sbproxy.store.outcomes import DurationHistogram
from sbproxy.workflows import WorkerIdentity, WorkflowEngine, process_start_ticks
from sbproxy.workflows.errors import JobCancelled

__all__ = [
    "RUNTIME_JOB_KINDS",
    "IllegalTransition",
    "RuntimeManager",
    "RuntimeTallies",
    "Slot",
    "UnknownDeployment",
    "Upstream",
    "artifact_request",
    "desired_digest",
    "desired_of",
    "new_slot",
]

logger = logging.getLogger(__name__)

# A non-ready answer is re-probed this many times before the engine is declared unhealthy
# (reference 7.6: a single missed probe never fails a ready engine).
HEALTH_MISSES = 3

# Job kinds the manager runs itself, in its deployments' command order; the worker loop
# leaves them alone (``run_worker(exclude=...)``).
RUNTIME_JOB_KINDS = ("load", "drain", "reset")

_COMMAND_OF_KIND = {
    "load": CommandKind.LOAD,
    "drain": CommandKind.STOP,
    "reset": CommandKind.RESET,
}

# Retries on a fresh port when another process took the chosen one before the engine
# bound it; they do not count as failed launches.
PORT_RETRIES = 3

# Longest a swap waits before it re-reads which resident generations block it, seconds.
SWAP_RECHECK_S = 0.25


class UnknownDeployment(SbproxyError):
    """No deployment has this id (``unknown_deployment``)."""

    default_code = "unknown_deployment"


class IllegalTransition(SbproxyError):
    """A deployment state change the transition table forbids (``illegal_transition``):
    a bug in the runtime, never an operator error."""

    default_code = "illegal_transition"


@dataclass
class RuntimeTallies:
    """What the runtime counts for its metrics (read at scrape time, never reset).

    Attributes:
        transitions: Deployment state changes by ``(deployment, from, to)``
            (``sbproxy_model_host_deployment_transitions_total``).
        swap_waits: Seconds launches waited for a busy generation to go idle
            (``sbproxy_model_host_swap_wait_seconds``).
    """

    transitions: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    swap_waits: DurationHistogram = field(default_factory=DurationHistogram)


@dataclass
class Slot:
    """Live state of one deployment (replica 0: this runtime is single-node).

    Only :class:`RuntimeManager` writes these fields; ``state`` is read-only here and changes
    through the manager's checked transition function.
    """

    deployment: str
    config: DeploymentConfig
    gate: AdmissionGate
    _state: DeploymentState = DeploymentState.CONFIGURED
    generation: int = 0
    artifact: ResolvedArtifact | None = None
    metadata: CachedMetadata | None = None
    executable: Path | None = None
    engine_version: str | None = None
    process: EngineProcess | None = None
    port: int | None = None
    lease: DigestLease | None = None
    estimate: MemoryEstimate | None = None
    reason_code: str | None = None
    last_error: str | None = None
    job_id: str | None = None
    crash: CrashLoop | None = None
    health_misses: int = 0
    timeouts: int = 0
    failures: int = 0
    not_before: float = 0.0
    restarting: bool = False
    swap_waiting: bool = False
    waiting: int = 0
    ready: anyio.Event = field(default_factory=anyio.Event)
    launching: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def state(self) -> DeploymentState:
        """The lifecycle state (changed only by the manager's transition function)."""
        return self._state

    def routable(self) -> bool:
        """Whether requests may go to this generation now: ready, child alive, port known."""
        return (
            self._state == DeploymentState.READY
            and self.process is not None
            and self.process.alive()
            and self.port is not None
        )


@dataclass
class Upstream:
    """An admitted request's engine: where to send it, its supervision limits, and the
    permit to release after.

    The gateway calls :meth:`report` once per request with how it ended at the engine
    (``timed_out``: a supervision limit ran out), then :meth:`release`; the runtime counts
    consecutive timeouts per generation (``unhealthy_after``).
    """

    deployment: str
    generation: int
    base_url: str
    permit: Permit
    request_timeout_s: float = 300.0
    first_token_timeout_s: float = 120.0
    stall_timeout_s: float = 30.0
    on_outcome: Callable[[int, bool], None] | None = None

    def report(self, *, timed_out: bool) -> None:
        """Tell the runtime how the request ended at the engine (first call wins)."""
        callback, self.on_outcome = self.on_outcome, None
        if callback is not None:
            callback(self.generation, timed_out)

    def release(self) -> None:
        """Free the admission slot (idempotent)."""
        self.permit.release()


def free_port() -> int:
    """An unused loopback port (the engine binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _pulse(slot: Slot) -> None:
    """Wake everyone waiting on the slot's state; they re-check it."""
    slot.ready.set()
    slot.ready = anyio.Event()


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
    ) -> None:
        self.compiled = compiled
        self.layout = layout
        self.cache = ArtifactCache(layout)
        self.catalog = catalog
        self.engine = engine
        self.runtime_store = runtime_store
        self.worker = worker
        self.backoff_override = backoff
        self.ready_timeout_s = ready_timeout_s
        self.health_interval_s = health_interval_s
        self.clock: Clock = clock or MonotonicClock()
        self.tallies = RuntimeTallies()
        self.jitter = jitter
        self.identity = WorkerIdentity.current()
        host = compiled.model_host
        self.shutdown_deadline_s = (host.shutdown_deadline_ms if host else 30_000) / 1000
        self.safety_margin = host.safety_margin if host else 0.10
        # Checks a configuration file's candidate before a file reload plans it (`serve
        # --locked` refuses one that drifts from the lockfile); raising refuses the reload.
        self.config_guard: Callable[[CompiledConfig], Awaitable[None]] | None = None
        # Engine launches of different deployments run at once up to this limit
        # (``max_parallel_prepares``, reference default 2); more wait their turn.
        self.prepares = anyio.CapacityLimiter(host.max_parallel_prepares if host else 2)
        cache_config = host.cache if host else None
        self.residency = Residency(
            {0: worker.memory_bytes},
            max_resident_models=cache_config.max_resident_models if cache_config else None,
            eviction=cache_config.eviction if cache_config else "lru",
            is_protected=self._protected,
        )
        self._tick = 0
        self._background = 0
        self._group: anyio.abc.TaskGroup | None = None
        self._capacity = anyio.Event()
        self._ignore_busy = False
        self._closing_at: float | None = None
        self.slots: dict[str, Slot] = {}
        for deployment_id, deployment in compiled.deployments.items():
            self._adopt_slot(new_slot(deployment_id, deployment))
        self.commands: dict[str, CommandQueue] = {}
        # Reload bookkeeping, written only through the staging methods below: staged
        # generations not yet routed, generations a ``recreate`` stopped (and whether they
        # were ready), the candidates of reloads in flight by content digest, the callbacks
        # a commit runs (the gateway swaps its routes and keys), and whether a reload is
        # protecting every current reservation from eviction while it stages.
        self.staged: dict[str, Slot] = {}
        self.recreated: list[tuple[Slot, bool]] = []
        self.candidates: dict[str, CompiledConfig] = {}
        self.on_commit: list[Callable[[CompiledConfig], None]] = []
        self.protect_all = False
        self.reload_lock = anyio.Lock()
        self.revision: int | None = None

    # -- lookup and snapshots --------------------------------------------------------------

    def slot(self, deployment: str) -> Slot:
        """The slot of ``deployment`` (read it; never write it).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        found = self.slots.get(deployment)
        if found is None:
            raise UnknownDeployment(
                f"no deployment {deployment!r}",
                remediation="Check proxy.model_host.deployments; `sbproxy models ps` lists them.",
                details={"deployment": deployment},
            )
        return found

    def queue(self, deployment: str) -> CommandQueue:
        """The command queue of ``deployment`` (kept across reloads)."""
        found = self.commands.get(deployment)
        if found is None:
            found = self.commands[deployment] = CommandQueue(deployment)
        return found

    def _adopt_slot(self, slot: Slot) -> None:
        slot.gate.on_idle = self._capacity_changed
        self.slots[slot.deployment] = slot

    def _capacity_changed(self) -> None:
        self._capacity.set()
        self._capacity = anyio.Event()

    def _protected(self, key: ResidencyKey) -> bool:
        if self.protect_all:
            return True
        slot = self.slots.get(key.deployment)
        staged = self.staged.get(key.deployment)
        if staged is not None and staged.generation == key.generation:
            return True
        if slot is None or slot.generation != key.generation:
            return False
        gate = slot.gate
        # A held gate admits nobody new: its queue waits for the swap, so only the requests
        # already running keep it resident. Requests waiting for it to become ready count.
        busy = gate.active > 0 or (gate.queued > 0 and not gate.held) or slot.waiting > 0
        transient = busy or slot.state in (DeploymentState.PREPARING, DeploymentState.DRAINING)
        return slot.config.pinned or (transient and not self._ignore_busy)

    def _status_of(self, slot: Slot) -> DeploymentStatus:
        return DeploymentStatus(
            deployment=slot.deployment,
            generation=slot.generation,
            state=slot.state,
            active_requests=slot.gate.active,
            queued_requests=slot.gate.queued,
            engine="llama_cpp" if slot.executable else None,
            engine_version=slot.engine_version,
            driver_availability="available" if slot.executable else None,
            artifact_digest=slot.artifact.digest if slot.artifact else None,
            selected_devices=(),
            memory=slot.estimate.to_dict() if slot.estimate else None,
            port=slot.port if slot.routable() else None,
            reason_code=slot.reason_code,
            job_id=slot.job_id,
            last_error=slot.last_error,
            extra={"engine_pid": slot.process.pid if slot.routable() and slot.process else None},
        )

    def status(self) -> list[DeploymentStatus]:
        """Every deployment's status (a frozen snapshot), sorted by id."""
        return [self._status_of(s) for s in sorted(self.slots.values(), key=lambda s: s.deployment)]

    def snapshot(self, deployment: str) -> DeploymentStatus:
        """One deployment's status now (frozen).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        return self._status_of(self.slot(deployment))

    def engine_pids(self) -> set[int]:
        """Pids of every live engine child this manager holds (current and staged)."""
        slots = [*self.slots.values(), *self.staged.values()]
        return {s.process.pid for s in slots if s.process is not None and s.process.alive()}

    # -- the one transition function -------------------------------------------------------

    async def _set_state(
        self,
        slot: Slot,
        to: DeploymentState,
        *,
        job_id: str | None = None,
        reason_code: str | None = None,
        error: str | None = None,
    ) -> None:
        """Move ``slot`` to ``to``: checked against the transition table, logged, recorded
        as a ``deployment`` event on ``job_id`` (or the slot's job) and counted.

        A move to the same state only updates the reason and error.

        Raises:
            IllegalTransition: ``illegal_transition`` (the table forbids it).
        """
        before = slot.state
        if to != before and to not in DEPLOYMENT_TRANSITIONS[before]:
            raise IllegalTransition(
                f"{slot.deployment}: {before.value} -> {to.value} is not an allowed transition",
                details={"deployment": slot.deployment, "from": before.value, "to": to.value},
            )
        slot._state = to  # the one place a state is written
        slot.reason_code = reason_code
        slot.last_error = bounded(error)
        if to == before:
            return
        logger.info(
            "deployment %s: %s -> %s%s",
            slot.deployment,
            before.value,
            to.value,
            f" ({reason_code})" if reason_code else "",
        )
        self.tallies.transitions[(slot.deployment, before.value, to.value)] += 1
        self._capacity_changed()  # a swap waiting on a transient generation re-checks
        cause = job_id or slot.job_id
        if cause is not None:
            data: dict[str, Any] = {
                "deployment": slot.deployment,
                "generation": slot.generation,
                "from": before.value,
                "to": to.value,
            }
            if reason_code:
                data["reason_code"] = reason_code
            try:
                with anyio.CancelScope(shield=True):
                    await self.engine.store.record_event(cause, kind="deployment", data=data)
            except Exception:  # a journal write must never wedge the runtime
                logger.exception("could not record the transition on job %s", cause)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        """Reap orphan engines, commit the desired revision, start converging to it.

        Unfinished ``load``, ``drain`` and ``reset`` jobs a crashed host left behind are
        adopted as commands in their original order and finish under their ids; then
        ``warm: true`` deployments get a ``load`` (joining an adopted one) and ``pull:
        on_boot`` deployments get their artifact verified. The maintenance loop starts.
        """
        self._group = group
        report = await anyio.to_thread.run_sync(reap_orphans, self.owned_dir)
        if report.killed:
            logger.warning("reaped orphan engines: %s", report.killed)
        desired = desired_of(self.compiled)
        self.revision = await self.runtime_store.commit_revision(
            content_digest=desired_digest(desired), desired=desired
        )
        await self._adopt_unfinished_jobs()
        for slot in self.slots.values():
            if slot.config.warm:
                self.request_load(slot.deployment, reason="warm")
            elif str(slot.config.pull) == "on_boot":
                group.start_soon(self._verify_on_boot, slot.deployment)
        group.start_soon(self._maintenance)

    async def _adopt_unfinished_jobs(self) -> None:
        active = (JobStatus.QUEUED, JobStatus.RUNNING)
        jobs = await self.engine.store.list_jobs(statuses=active, limit=-1)
        for job in sorted(jobs, key=lambda j: (j.created_at_ms, j.id)):
            kind = _COMMAND_OF_KIND.get(job.kind)
            subject = job.subject or ""
            if kind is None or not subject.startswith("deployment:"):
                continue
            deployment = subject.removeprefix("deployment:")
            queue = self.queue(deployment)
            command, _ = queue.submit(kind, reason="recovered", join=False)
            if job.cancel_requested:
                command.superseded_by = command.seq  # ends cancelled; nothing joins it
            command.assign(job.id)
            logger.info("adopted unfinished %s job %s of %s", job.kind, job.id, deployment)
            self._spawn_command(queue, command, None)

    @property
    def owned_dir(self) -> Path:
        """Ownership records of the engines this host started."""
        return self.layout.engines / "owned"

    def background(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` on the manager's task group, counted so that :meth:`shutdown` waits
        for it (up to the deadline) instead of cancelling it mid-write."""
        if self._group is None:
            return
        self._background += 1

        async def run() -> None:
            try:
                await work()
            finally:
                self._background -= 1

        self._group.start_soon(run)

    # -- commands --------------------------------------------------------------------------

    def request_load(self, deployment: str, *, reason: str = "request") -> Command:
        """Enter a ``load`` command now (joining the newest load) and run it in the
        background; the command (``assigned`` is set once its job exists).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        fresh_queue = not queue.pending
        command, created = queue.submit(CommandKind.LOAD, reason=reason)
        if created:
            # The stable key joins a load a crashed host left unfinished; behind other
            # commands the key is the command's own, so it never joins a superseded load.
            key = f"load:{deployment}" if fresh_queue else f"load:{deployment}:{command.seq}"

            async def submit() -> JobRecord:
                from sbproxy.model_host.runtime.jobs import submit_load

                return await submit_load(self, deployment, idempotency_key=key)

            self._spawn_command(queue, command, submit)
        return command

    async def load(self, deployment: str, *, reason: str = "admin") -> JobRecord:
        """Command: make ``deployment`` ready (a ``load`` job, joined when one is newest).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        command = self.request_load(deployment, reason=reason)
        return await self._job_of(command)

    async def stop(self, deployment: str, *, reason: str = "stop") -> JobRecord:
        """Command: drain and stop ``deployment`` (a ``drain`` job). Supersedes every
        earlier load of it: a waiting one never runs, a running one is cancelled.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.STOP, reason=reason)
        for earlier in queue.pending:
            if earlier.superseded_by == command.seq and earlier.job_id is not None:
                await self._cancel_job(earlier.job_id)

        async def submit() -> JobRecord:
            from sbproxy.model_host.runtime.jobs import submit_drain

            return await submit_drain(self, deployment, reason=reason)

        self._spawn_command(queue, command, submit)
        return await self._job_of(command)

    async def reset(self, deployment: str) -> JobRecord:
        """Command: clear a retained failure (a ``reset`` job), in arrival order.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        self.slot(deployment)
        queue = self.queue(deployment)
        command, _ = queue.submit(CommandKind.RESET, reason="admin")

        async def submit() -> JobRecord:
            from sbproxy.model_host.runtime.jobs import submit_reset

            return await submit_reset(self, deployment)

        self._spawn_command(queue, command, submit)
        return await self._job_of(command)

    async def _job_of(self, command: Command) -> JobRecord:
        await command.assigned.wait()
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
        """Submit the command's job now, run it in the command's turn, settle the slot."""
        try:
            if command.job_id is None and submit is not None:
                command.assign((await submit()).id)
            async with queue.turn(command):
                if command.job_id is None:
                    return
                if command.superseded_by is not None:
                    await self._cancel_job(command.job_id)
                final = await self.engine.run_job(command.job_id)
                await self._settle(queue.deployment, command, final)
        except Exception:
            logger.exception("%s command of %s failed", command.kind.value, queue.deployment)
            slot = self.slots.get(queue.deployment)
            if slot is not None and command.kind is CommandKind.LOAD:
                await self._settle(queue.deployment, command, None)
        finally:
            queue.finish(command)
            slot = self.slots.get(queue.deployment)
            if slot is not None:
                _pulse(slot)

    async def _settle(self, deployment: str, command: Command, final: JobRecord | None) -> None:
        """After a load job ended without a ready engine, make the slot say why."""
        slot = self.slots.get(deployment)
        if slot is None or command.kind is not CommandKind.LOAD or slot.routable():
            return
        if final is not None and final.status == JobStatus.CANCELLED:
            return  # superseded: the stop that won sets the state
        if slot.state == DeploymentState.FAILED:
            return  # the launch already said why
        error = final.error if final is not None else None
        code = error.code if error else "prepare_failed"
        message = error.message if error else "the load did not finish"
        if slot.state == DeploymentState.PREPARING:
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)
        elif slot.state in (DeploymentState.CONFIGURED, DeploymentState.STOPPED):
            await self._set_state(slot, DeploymentState.PREPARING, job_id=command.job_id)
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)
        elif slot.state == DeploymentState.READY:  # its engine died meanwhile
            await self._set_state(slot, DeploymentState.FAILED, reason_code=code, error=message)

    @asynccontextmanager
    async def step_scope(
        self, job_id: str, deployment: str, kind: CommandKind
    ) -> AsyncIterator[None]:
        """The frame a runtime job's step runs in: the command's cancellable scope (a later
        stop cancels a load's steps), or -- for a job run outside a command, e.g. straight
        from ``run_job`` -- a turn of its own in the deployment's queue.

        Raises:
            JobCancelled: ``cancelled`` when a later command superseded this one.
        """
        queue = self.queue(deployment)
        command = queue.find(job_id)
        async with AsyncExitStack() as stack:
            if command is None:
                command, _ = queue.submit(kind, reason="job", join=False)
                command.assign(job_id)
                await stack.enter_async_context(queue.turn(command))
            scope = await stack.enter_async_context(command.live())
            yield
        if scope.cancelled_caught or command.superseded_by is not None:
            raise JobCancelled(f"job {job_id} was superseded by a later command on {deployment}")

    @asynccontextmanager
    async def exclusive(self, deployments: Iterable[str], *, job_id: str) -> AsyncIterator[None]:
        """Hold a turn on each of ``deployments`` (a reload's rollout or commit): every
        earlier command on them finishes first, later ones wait until the body ends."""
        async with AsyncExitStack() as stack:
            entered = []
            for deployment in sorted(set(deployments)):
                queue = self.queue(deployment)
                command, _ = queue.submit(CommandKind.RELOAD, reason="reload", join=False)
                command.assign(job_id)
                entered.append((queue, command))
            for queue, command in entered:
                await stack.enter_async_context(queue.turn(command))
            yield

    async def _verify_on_boot(self, deployment: str) -> None:
        from sbproxy.model_host.runtime.jobs import pull_for

        slot = self.slot(deployment)
        try:
            await pull_for(self, slot, intent="startup")
        except SbproxyError as exc:
            if slot.state == DeploymentState.CONFIGURED:
                await self._set_state(slot, DeploymentState.PREPARING)
                await self._set_state(
                    slot, DeploymentState.FAILED, reason_code=exc.code, error=str(exc)
                )

    # -- effects the durable jobs' steps call (runtime/jobs.py) ----------------------------

    def resolve(self, slot: Slot) -> ResolvedArtifact:
        """Resolve the deployment's exact artifact on this worker (and remember it)."""
        slot.artifact = self.resolve_config(slot.config, self.catalog)
        return slot.artifact

    def use_artifact(self, slot: Slot, artifact: ResolvedArtifact) -> None:
        """Remember the artifact a job resolved for ``slot``."""
        slot.artifact = artifact

    def resolve_config(self, config: DeploymentConfig, catalog: Catalog) -> ResolvedArtifact:
        """Resolve one deployment definition against ``catalog`` on this worker.

        Raises:
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
            NoCompatibleVariantError: ``no_compatible_variant``.
        """
        return resolve_artifact(catalog, artifact_request(config), self.worker).artifact

    def _ctx_size(self, slot: Slot) -> int:
        assert slot.artifact is not None  # noqa: S101 - resolved before launch
        return max(1, min(slot.config.max_context or slot.artifact.context_length, 1 << 20))

    def estimate(self, slot: Slot, metadata: CachedMetadata) -> MemoryEstimate:
        """Full memory estimate of one generation from the artifact's GGUF header."""
        snapshot = self.cache.snapshot(metadata.artifact_digest)
        ggufs = [f for f in metadata.files if f.path.endswith(".gguf")]
        facts = read_gguf_header(snapshot / ggufs[0].path) if ggufs else None
        return estimate_memory(
            weights_bytes=metadata.total_size_bytes,
            facts=facts,
            seq_len=self._ctx_size(slot),
            concurrency=slot.config.max_concurrency,
            kv_quant=slot.config.kv_quant,
            safety_margin=self.safety_margin,
            format_quant=metadata.quant,
        )

    def backoff(self, slot: Slot) -> LaunchBackoff:
        """The slot's launch and restart backoff (its config, unless the manager's)."""
        if self.backoff_override is not None:
            return self.backoff_override
        config = slot.config
        return LaunchBackoff(
            base_s=config.restart_backoff_initial_ms / 1000,
            max_s=config.restart_backoff_max_ms / 1000,
            max_attempts=config.max_launch_attempts,
        )

    def _jittered(self, delay_s: float) -> float:
        """Equal jitter: half the delay fixed, half random (spreads restarts apart)."""
        return delay_s / 2 + delay_s / 2 * self.jitter()

    def observe_generation(
        self, deployment: str, *, generation: int, pid: int | None, start_ticks: str | None
    ) -> bool:
        """Whether a journaled launch still describes a live engine of ours: the slot runs
        that generation, its child is that pid with those start ticks, and it is
        routable. After a host restart this is false, and the launch runs again."""
        slot = self.slots.get(deployment)
        if slot is None or slot.generation != generation or not slot.routable():
            return False
        process = slot.process
        assert process is not None  # noqa: S101 - routable slots have a process
        return (
            process.pid == pid
            and process.record.start_ticks == start_ticks
            and process_start_ticks(process.pid) == start_ticks
        )

    async def launch_generation(
        self, slot: Slot, *, executable: Path, job_id: str, generation: int | None = None
    ) -> int:
        """Start a new generation of ``slot`` and wait until it is ready; its port.

        Idempotency: a live, ready engine of this slot is reused; concurrent callers
        serialize on the slot, and the second finds it ready. Launches across deployments
        run at most ``max_parallel_prepares`` at once. A launch waits out the slot's restart
        backoff first. Early exits retry with the backoff (jittered); exhaustion (or a
        non-retryable failure) retains ``crash_loop``; a lost port retries at once on a new
        one. ``generation`` restarts a stopped generation under its own number (a failed
        ``recreate`` rollout restoring the prior engine). A cancelled launch (a stop
        superseded it) stops its child and leaves the slot ``stopped``.

        Raises:
            EngineError: ``crash_loop`` (or the non-retryable launch error),
                ``start_timeout`` (no ``/health`` within ``start_timeout_ms``),
                ``artifact_not_ready``.
            AdmissionRejected: ``insufficient_capacity`` when the estimate does not fit,
                even after waiting for busy generations to go idle.
        """
        async with slot.launching, self.prepares:
            return await self._launch_locked(
                slot, executable=executable, job_id=job_id, generation=generation
            )

    async def _launch_locked(
        self, slot: Slot, *, executable: Path, job_id: str, generation: int | None
    ) -> int:
        if slot.routable():
            assert slot.port is not None  # noqa: S101 - a routable slot has a port
            return slot.port
        if slot.crash is not None:
            raise EngineError(slot.crash.last_error, code="crash_loop")
        metadata = self.cache.read_metadata(slot.artifact.digest) if slot.artifact else None
        if metadata is None:
            raise EngineError("the artifact is not in the cache", code="artifact_not_ready")
        if slot.process is not None:  # a dead or foreign-held generation: clear it first
            await self._release_generation(slot)
        slot.metadata = metadata
        slot.executable = executable
        slot.job_id = job_id
        await self._set_state(slot, DeploymentState.PREPARING, job_id=job_id)
        wait_s = slot.not_before - self.clock.now()
        if wait_s > 0:
            logger.info("%s: relaunch in %.2f s (restart backoff)", slot.deployment, wait_s)
            await self.clock.sleep(wait_s)
        estimate = self.estimate(slot, metadata)
        slot.generation = generation or await self.runtime_store.next_generation(slot.deployment)
        key = ResidencyKey(slot.deployment, slot.generation)
        try:
            await self._reserve(slot, key, estimate)
        except AdmissionRejected as exc:
            await self._set_state(
                slot, DeploymentState.FAILED, reason_code=exc.code, error=exc.message
            )
            raise
        slot.estimate = estimate
        try:
            process, port = await self._spawn_until_ready(slot, metadata, executable, job_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.residency.release(key)
                self._capacity_changed()
                slot.estimate = None
                if slot.state == DeploymentState.PREPARING:  # cancelled: a stop won
                    await self._set_state(slot, DeploymentState.STOPPED, reason_code="superseded")
            raise
        slot.process = process
        slot.port = port
        slot.health_misses = 0
        slot.timeouts = 0
        if slot.lease is None:
            slot.lease = self.cache.lease(metadata.artifact_digest)
        slot.gate.resume()
        slot.gate.mark_idle()
        await self._set_state(slot, DeploymentState.READY, job_id=job_id)
        self._watch_exit(slot, process, slot.generation)
        _pulse(slot)
        return port

    async def _reserve(self, slot: Slot, key: ResidencyKey, estimate: MemoryEstimate) -> None:
        """Reserve memory for ``key``; evict idle victims; wait for busy ones (swap wait).

        Raises:
            AdmissionRejected: ``insufficient_capacity`` (with ``retry_after_ms``) when it
                cannot fit, or a busy generation stayed busy past the queue timeout.
        """
        timeout_s = slot.config.queue_timeout_ms / 1000
        started = self.clock.now()
        held: list[Slot] = []
        waited = False
        try:
            while True:
                self._tick += 1
                try:
                    # Protection comes from the slot's state (preparing) through
                    # ``_protected``, so a swap can tell a transient hold from a pin.
                    plan = self.residency.reserve(
                        key, estimate=estimate, devices=(0,), protected=False, tick=self._tick
                    )
                    break
                except AdmissionRejected as exc:
                    blockers = self._busy_blockers(key, estimate)
                    left = timeout_s - (self.clock.now() - started)
                    if not blockers or left <= 0:
                        raise reject(
                            AdmissionReason.INSUFFICIENT_CAPACITY,
                            exc.message
                            + (
                                f"; waited {self.clock.now() - started:.1f} s for "
                                f"{', '.join(b.deployment for b in blockers)} to go idle"
                                if blockers
                                else ""
                            ),
                            deployment=slot.deployment,
                            retry_after_ms=max(1000, round(timeout_s * 1000)),
                        ) from None
                    for blocker in blockers:
                        # Hold only a generation that is serving: a starting one must let
                        # its first waiters in, or it would be evicted before it served.
                        serving = blocker.state == DeploymentState.READY and blocker.gate.active
                        if serving and blocker not in held:
                            blocker.gate.hold()
                            held.append(blocker)
                    waited = True
                    slot.swap_waiting = True
                    # Woken when a gate goes idle, a reservation is freed or a state
                    # changes; re-checked at least every SWAP_RECHECK_S so that a blocker
                    # that starts serving gets held.
                    changed = self._capacity
                    with anyio.move_on_after(min(left, SWAP_RECHECK_S)):
                        await changed.wait()
            for victim in plan.victims:
                victim_slot = self.slots.get(victim.key.deployment)
                if victim_slot is not None and victim_slot.generation == victim.key.generation:
                    await self._evict(victim_slot, job_id=slot.job_id)
        finally:
            for blocker in held:
                blocker.gate.unhold()
            slot.swap_waiting = False
            if waited:
                self.tallies.swap_waits.observe(self.clock.now() - started)

    def _busy_blockers(self, key: ResidencyKey, estimate: MemoryEstimate) -> list[Slot]:
        """The busy or transient (preparing, draining) generations whose eviction would make
        ``key`` fit once they settle (empty: it would not fit even then -- pinned, or too
        large -- and waiting cannot help)."""
        self._ignore_busy = True
        try:
            plan = self.residency.plan(ReservationRequest(key=key, estimate=estimate, devices=(0,)))
        except AdmissionRejected:
            return []
        finally:
            self._ignore_busy = False
        blockers = []
        for victim in plan.victims:
            found = self.slots.get(victim.key.deployment)
            if found is not None and found.generation == victim.key.generation:
                blockers.append(found)
        return blockers

    async def _spawn_until_ready(
        self, slot: Slot, metadata: CachedMetadata, executable: Path, job_id: str
    ) -> tuple[EngineProcess, int]:
        backoff = self.backoff(slot)
        start_timeout_s = slot.config.start_timeout_ms / 1000
        if self.ready_timeout_s is not None:
            start_timeout_s = min(start_timeout_s, self.ready_timeout_s)
        first_failure: int | None = None
        attempt = 0
        port_retries = 0
        while True:
            attempt += 1
            port = free_port()
            request = LaunchRequest(
                deployment=slot.deployment,
                generation=slot.generation,
                metadata=metadata,
                snapshot=self.cache.snapshot(metadata.artifact_digest),
                port=port,
                ctx_size=self._ctx_size(slot) * slot.config.max_concurrency,
                max_concurrency=slot.config.max_concurrency,
                kv_quant=str(slot.config.kv_quant),
                extra_args=tuple(slot.config.extra_args),
            )
            try:
                process = await launch(
                    plan_llama_launch(request, executable=executable),
                    log_path=self.layout.root
                    / "logs"
                    / f"{slot.deployment}-g{slot.generation}.log",
                    owned_dir=self.owned_dir,
                    label=f"{slot.deployment}/{slot.generation}",
                    identity=self.identity,
                    ready_timeout_s=start_timeout_s,
                )
                return process, port
            except EngineError as exc:
                if exc.code == "engine_port_lost" and port_retries < PORT_RETRIES:
                    port_retries += 1
                    attempt -= 1
                    logger.warning(
                        "%s: port %d was taken; retrying on another", slot.deployment, port
                    )
                    continue
                now = wall_clock_ms()
                first_failure = first_failure or now
                if exc.code == "engine_readiness_timeout":
                    slot.failures += 1
                    await self._set_state(
                        slot,
                        DeploymentState.FAILED,
                        reason_code="start_timeout",
                        error=f"the engine did not answer /health within "
                        f"{start_timeout_s:g} s (start_timeout_ms): {exc.message}",
                    )
                    raise EngineError(
                        f"{slot.deployment}: the engine was not ready within "
                        f"{start_timeout_s:g} s; it was stopped",
                        code="start_timeout",
                        remediation="Raise proxy.model_host.deployments."
                        f"{slot.deployment}.start_timeout_ms or check the engine log; the "
                        "next request or a reset retries.",
                        details={"deployment": slot.deployment, "log": exc.details.get("log")},
                    ) from exc
                if exc.retryable and attempt < backoff.max_attempts:
                    logger.warning(
                        "%s: launch %d failed (%s); retrying", slot.deployment, attempt, exc.code
                    )
                    await self.clock.sleep(self._jittered(backoff.delay(attempt)))
                    continue
                slot.crash = CrashLoop(
                    attempts=attempt,
                    reason=exc.code,
                    last_error=exc.message,
                    stderr_tail=str(exc.details.get("stderr_tail") or ""),
                    first_failure_at_ms=first_failure,
                    last_failure_at_ms=now,
                    job_id=job_id,
                )
                await self._set_state(
                    slot,
                    DeploymentState.FAILED,
                    reason_code="crash_loop",
                    error=f"{exc.code} after {attempt} launch(es): {exc}",
                )
                raise EngineError(
                    str(exc),
                    code="crash_loop",
                    remediation="Fix the cause, then reset the deployment.",
                ) from exc

    def _watch_exit(self, slot: Slot, process: EngineProcess, generation: int) -> None:
        """Stop routing the moment the child exits (not at the next health probe)."""
        if self._group is None:
            return

        async def watch() -> None:
            status = await process.wait_exit()
            if slot.process is process and slot.generation == generation:
                await self._engine_lost(
                    slot,
                    generation,
                    f"the engine exited with status {status}: {process.stderr_tail(15)}",
                )

        self._group.start_soon(watch)

    async def _engine_lost(self, slot: Slot, generation: int, message: str) -> None:
        """A ready generation died or stopped answering: fail it, free what it held, and
        set the restart backoff (the next request relaunches it after that)."""
        if slot.generation != generation or slot.state != DeploymentState.READY:
            return
        slot.failures += 1
        backoff = self.backoff(slot)
        slot.not_before = self.clock.now() + self._jittered(backoff.delay(slot.failures))
        await self._set_state(
            slot, DeploymentState.FAILED, reason_code="engine_health_failed", error=message
        )
        await self._release_generation(slot)
        _pulse(slot)

    async def _release_generation(self, slot: Slot) -> None:
        """Stop the slot's engine (if any) and free its reservation, lease and port."""
        process, slot.process = slot.process, None
        if process is not None:
            with anyio.CancelScope(shield=True):
                await process.shutdown(
                    grace_s=self._remaining_s(min(self.shutdown_deadline_s, 10.0)),
                    kill_wait_s=2.0 if self._closing_at is not None else 5.0,
                )
        if slot.generation:
            self.residency.release(ResidencyKey(slot.deployment, slot.generation))
            self._capacity_changed()
        if slot.lease is not None:
            slot.lease.release()
            slot.lease = None
        slot.port = None
        slot.estimate = None

    async def _evict(self, slot: Slot, *, job_id: str | None) -> None:
        """Stop an idle generation to make room; its gate (and any held queue) stays."""
        if slot.state not in (DeploymentState.READY, DeploymentState.FAILED):
            await self._release_generation(slot)
            return
        previous = slot.state
        await self._set_state(slot, DeploymentState.DRAINING, job_id=job_id)
        await self._release_generation(slot)
        if previous == DeploymentState.FAILED:
            await self._set_state(slot, DeploymentState.FAILED, reason_code=slot.reason_code)
        else:
            await self._set_state(slot, DeploymentState.STOPPED, reason_code="evicted")
        _pulse(slot)

    async def drain_slot(
        self, slot: Slot, *, job_id: str | None = None, reason: str | None = None
    ) -> dict[str, object]:
        """Refuse new work, cancel the queue, wait for active requests (up to the shutdown
        deadline), stop the engine. A failed deployment stays failed.

        Idempotency: draining a stopped deployment only settles its state.
        """
        previous = slot.state
        retained = (slot.reason_code, slot.last_error)
        await self._set_state(slot, DeploymentState.DRAINING, job_id=job_id, reason_code=reason)
        report = await slot.gate.drain(deadline_s=self._remaining_s(self.shutdown_deadline_s))
        await self._release_generation(slot)
        if previous == DeploymentState.FAILED:
            await self._set_state(
                slot, DeploymentState.FAILED, reason_code=retained[0], error=retained[1]
            )
        else:
            keep = None if reason in (None, "stop", "drain") else reason
            await self._set_state(slot, DeploymentState.STOPPED, job_id=job_id, reason_code=keep)
        slot.gate.resume()
        _pulse(slot)
        return {
            "active_at_start": report.active_at_start,
            "cancelled_queued": report.cancelled_queued,
            "remaining_active": report.remaining_active,
            "timed_out": report.timed_out,
        }

    async def reset_slot(self, slot: Slot, *, job_id: str | None = None) -> None:
        """Clear a retained failure so the deployment may launch again (backoff too).

        Raises:
            SbproxyError: ``prepare_failed`` unless the deployment has failed; ``draining``
                while it is preparing or draining.
        """
        if slot.state in (DeploymentState.PREPARING, DeploymentState.DRAINING):
            raise SbproxyError(f"{slot.deployment} is {slot.state.value}", code="draining")
        if slot.state != DeploymentState.FAILED:
            raise SbproxyError(
                f"reset requires a retained failure; {slot.deployment} is {slot.state.value}",
                code="prepare_failed",
            )
        slot.crash = None
        slot.failures = 0
        slot.not_before = 0.0
        await self._set_state(slot, DeploymentState.CONFIGURED, job_id=job_id)
        slot.gate.resume()

    # -- reload staging (runtime/reload.py calls these; it writes no slot itself) ---------

    def begin_staging(self) -> None:
        """Start staging a reload's generations: every current reservation is protected
        from eviction until :meth:`end_staging`."""
        self.staged = {}
        self.recreated = []
        self.protect_all = True

    def end_staging(self) -> None:
        """Stop protecting every reservation (the staged slots stay staged)."""
        self.protect_all = False

    def stage(self, deployment: str, config: DeploymentConfig, artifact: ResolvedArtifact) -> Slot:
        """A new, not yet routed slot for ``deployment`` (a changed or added definition)."""
        slot = new_slot(deployment, config)
        slot.gate.on_idle = self._capacity_changed
        slot.artifact = artifact
        self.staged[deployment] = slot
        return slot

    async def recreate_stop(self, slot: Slot, *, job_id: str) -> None:
        """Drain and stop a live generation a ``recreate`` rollout replaces, remembering
        whether it was ready (a rollback restarts it)."""
        was_ready = slot.routable()
        await self.drain_slot(slot, job_id=job_id)
        self.recreated.append((slot, was_ready))

    async def roll_back(self) -> list[str]:
        """Undo a staging: stop the staged engines, restart the generations a ``recreate``
        stopped (under their own generation numbers); the deployments discarded."""
        with anyio.CancelScope(shield=True):
            staged, self.staged = self.staged, {}
            recreated, self.recreated = self.recreated, []
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
        self,
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
        staged, self.staged = self.staged, {}
        self.recreated = []
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
                    slots[deployment] = new_slot(deployment, candidate.deployments[deployment])
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
            evicted = self.slots.get(victim.key.deployment)
            if evicted is not None and evicted.generation == victim.key.generation:
                await self.drain_slot(evicted, job_id=job_id)

    async def record_revision(self, *, content_digest: str, desired: Mapping[str, Any]) -> int:
        """Record the committed desired state (a new revision only when it changed)."""
        latest = await self.runtime_store.latest_revision()
        if latest is None or latest.content_digest != content_digest:
            self.revision = await self.runtime_store.commit_revision(
                content_digest=content_digest, desired=dict(desired)
            )
        else:  # the same desired deployments (routes or keys may differ): no new revision
            self.revision = latest.revision
        return self.revision

    # -- requests --------------------------------------------------------------------------

    async def acquire(self, deployment: str, *, priority: PriorityClass) -> Upstream:
        """Admit one request to ``deployment``, starting or healing its engine if needed.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            AdmissionRejected: ``draining``, ``crash_loop``, ``engine_unhealthy``,
                ``queue_full``, ``queue_timeout`` or ``insufficient_capacity`` (with
                ``retry_after_ms``).
        """
        slot = self.slot(deployment)
        timeout_s = slot.config.queue_timeout_ms / 1000
        with anyio.move_on_after(timeout_s) as scope:
            while True:
                slot = self.slot(deployment)
                self._refuse_now(slot)
                if not slot.routable():
                    if str(slot.config.cold_start) == "reject":
                        raise reject(
                            AdmissionReason.ENGINE_UNHEALTHY,
                            f"{deployment} has no ready replica (cold_start: reject)",
                            deployment=deployment,
                            retry_after_ms=1000,
                        )
                    self.request_load(deployment)
                    slot.waiting += 1  # keeps the generation from being evicted meanwhile
                    try:
                        while not slot.routable():
                            await slot.ready.wait()
                            self._refuse_failed(slot)
                    finally:
                        slot.waiting -= 1
                permit = await slot.gate.admit(priority)
                if slot.routable() and self.slots.get(deployment) is slot:
                    break
                permit.release()  # evicted or replaced while it queued: start over
        if scope.cancelled_caught:
            if slot.swap_waiting:  # its launch still waits for a busy generation
                raise reject(
                    AdmissionReason.INSUFFICIENT_CAPACITY,
                    f"{deployment} waited {timeout_s:g} s for a busy resident model to go "
                    "idle so that it could be swapped in",
                    deployment=deployment,
                    retry_after_ms=max(1000, slot.config.queue_timeout_ms),
                )
            raise reject(
                AdmissionReason.QUEUE_TIMEOUT,
                f"{deployment} did not become ready within {timeout_s:g} s",
                deployment=deployment,
            )
        self._tick += 1
        if slot.generation:
            self.residency.touch(ResidencyKey(slot.deployment, slot.generation), self._tick)
        config = slot.config
        return Upstream(
            deployment=deployment,
            generation=slot.generation,
            base_url=f"http://127.0.0.1:{slot.port}",
            permit=permit,
            request_timeout_s=config.request_timeout_ms / 1000,
            first_token_timeout_s=config.first_token_timeout_ms / 1000,
            stall_timeout_s=config.stall_timeout_ms / 1000,
            on_outcome=lambda generation, timed_out: self.record_outcome(
                deployment, generation, timed_out=timed_out
            ),
        )

    def _refuse_now(self, slot: Slot) -> None:
        if slot.state == DeploymentState.DRAINING or slot.gate.draining:
            raise reject(
                AdmissionReason.DRAINING,
                f"{slot.deployment} is draining",
                deployment=slot.deployment,
            )
        if slot.crash is not None:
            raise reject(
                AdmissionReason.CRASH_LOOP,
                f"{slot.deployment} is crash-looped: {slot.crash.last_error}",
                deployment=slot.deployment,
            )

    def _refuse_failed(self, slot: Slot) -> None:
        """After a wake-up: refuse when the load this request waited for failed."""
        if slot.crash is not None:
            self._refuse_now(slot)
        if slot.state == DeploymentState.DRAINING:
            self._refuse_now(slot)
        if slot.state != DeploymentState.FAILED:
            return
        if slot.reason_code == AdmissionReason.INSUFFICIENT_CAPACITY.value:
            raise reject(
                AdmissionReason.INSUFFICIENT_CAPACITY,
                slot.last_error or "the deployment does not fit",
                deployment=slot.deployment,
                retry_after_ms=max(1000, slot.config.queue_timeout_ms),
            )
        raise reject(
            AdmissionReason.ENGINE_UNHEALTHY,
            slot.last_error or "the engine failed",
            deployment=slot.deployment,
        )

    def record_outcome(self, deployment: str, generation: int, *, timed_out: bool) -> None:
        """Count one request's end at the engine of ``deployment``/``generation``:
        ``unhealthy_after`` consecutive timeouts drain the generation and relaunch it after
        the restart backoff; a request that ended in time resets the count and the backoff.
        """
        slot = self.slots.get(deployment)
        if slot is None or slot.generation != generation:
            return
        if not timed_out:
            slot.timeouts = 0
            slot.failures = 0
            return
        slot.timeouts += 1
        if (
            slot.timeouts >= slot.config.unhealthy_after
            and slot.state == DeploymentState.READY
            and not slot.restarting
        ):
            slot.restarting = True
            self.background(lambda: self._restart_unhealthy(slot, generation))

    async def _restart_unhealthy(self, slot: Slot, generation: int) -> None:
        """Mark the generation unhealthy, drain it and relaunch after the backoff."""
        try:
            if slot.generation != generation or slot.state != DeploymentState.READY:
                return
            slot.failures += 1
            delay = self._jittered(self.backoff(slot).delay(slot.failures))
            slot.not_before = self.clock.now() + delay
            message = (
                f"{slot.timeouts} consecutive requests timed out at generation {generation}; "
                f"it is restarted in {delay:.1f} s"
            )
            logger.warning("%s: %s", slot.deployment, message)
            await self._set_state(
                slot, DeploymentState.FAILED, reason_code="engine_unhealthy", error=message
            )
            await self.stop(slot.deployment, reason="engine_unhealthy")
            self.request_load(slot.deployment, reason="restart")
        finally:
            slot.restarting = False

    # -- maintenance -----------------------------------------------------------------------

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
        for slot in list(self.slots.values()):
            process, generation, port = slot.process, slot.generation, slot.port
            if slot.state != DeploymentState.READY or process is None or port is None:
                continue
            health = await process.probe(f"http://127.0.0.1:{port}/health")
            owned = health == "ready" and await anyio.to_thread.run_sync(process.listens_on, port)
            if slot.process is not process or slot.generation != generation:
                continue  # changed while probing
            if health == "stopped":
                await self._engine_lost(
                    slot, generation, f"the engine exited: {process.stderr_tail(15)}"
                )
            elif owned:
                slot.health_misses = 0
            else:
                slot.health_misses += 1
                if slot.health_misses >= HEALTH_MISSES:
                    why = (
                        f"port {port} is held by another process"
                        if health == "ready"
                        else "the engine stopped answering /health"
                    )
                    await self._engine_lost(slot, generation, why)
            keep_alive = slot.config.keep_alive_secs
            if (
                slot.state == DeploymentState.READY
                and not self.queue(slot.deployment).pending
                and keep_alive_expired(slot.gate, keep_alive, self.clock.now())
            ):
                await self.stop(slot.deployment, reason="keep_alive")

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
            slots = [s for s in (*self.slots.values(), *self.staged.values()) if s.process]
            with anyio.move_on_after(max(0.0, end - anyio.current_time())):
                async with anyio.create_task_group() as group:
                    for slot in slots:
                        group.start_soon(self._drain_for_shutdown, slot)
            self.kill_engines()
            for slot in slots:
                await self._release_generation(slot)

    async def _drain_for_shutdown(self, slot: Slot) -> None:
        try:
            await self.drain_slot(slot)
        except SbproxyError as exc:  # an engine that will not die is killed right after
            logger.error("%s: shutdown drain failed: %s", slot.deployment, exc)

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
        for slot in (*self.slots.values(), *self.staged.values()):
            if slot.process is not None and slot.process.alive():
                slot.process.kill()
                killed.append(slot.process.pid)
        return killed


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


def new_slot(deployment: str, config: DeploymentConfig) -> Slot:
    """A ``configured`` slot for one deployment definition, with its admission gate."""
    return Slot(
        deployment=deployment,
        config=config,
        gate=AdmissionGate(
            deployment,
            max_active=config.max_concurrency,
            max_queue=config.max_queue_depth,
            queue_timeout_s=config.queue_timeout_ms / 1000,
        ),
    )


def desired_of(compiled: CompiledConfig) -> dict[str, Any]:
    """The desired deployments of ``compiled`` as JSON objects by id."""
    return {k: v.model_dump(mode="json") for k, v in compiled.deployments.items()}


def desired_digest(desired: Mapping[str, object]) -> str:
    """SHA-256 hex of the RFC 8785 canonical JSON of desired deployments (stable across key
    order and a JSON round trip)."""
    return hashlib.sha256(rfc8785.dumps(dict(desired))).hexdigest()  # type: ignore[arg-type]
