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

import functools
import hashlib
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
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
from sbproxy.model_host.engines import (
    reap_orphans,
)
from sbproxy.model_host.runtime._command_verbs import CommandsMixin
from sbproxy.model_host.runtime._launch import LaunchMixin
from sbproxy.model_host.runtime._staging import StagingMixin
from sbproxy.model_host.runtime.admission import (
    AdmissionReason,
    Permit,
    keep_alive_expired,
    reject,
)
from sbproxy.model_host.runtime.clock import Clock, MonotonicClock
from sbproxy.model_host.runtime.commands import CommandQueue
from sbproxy.model_host.runtime.memory import MemoryEstimate, estimate_memory, read_gguf_header
from sbproxy.model_host.runtime.residency import Residency, ResidencyKey
from sbproxy.model_host.runtime.slot import (
    IllegalTransition,
    RuntimeTallies,
    Slot,
    UnknownDeployment,
    Upstream,
    new_slot,
)
from sbproxy.model_host.runtime.state import (
    DEPLOYMENT_TRANSITIONS,
    DeploymentState,
    DeploymentStatus,
    LaunchBackoff,
    bounded,
)
from sbproxy.store import RuntimeStore
from sbproxy.workflows import WorkerIdentity, WorkflowEngine

__all__ = [
    "RUNTIME_JOB_KINDS",
    "IllegalTransition",
    "RuntimeManager",
    "RuntimeTallies",
    "Slot",
    "UnknownDeployment",
    "Upstream",
    "artifact_request",
    "deployment_digest",
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


class RuntimeManager(CommandsMixin, LaunchMixin, StagingMixin):
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
        # Command submissions under way (``adopt_runtime_jobs`` skips a pass that overlaps
        # one: the submitted job is in the journal before it is in its command's lane).
        self._submits_started = 0
        self._submits_in_flight = 0
        self._group: anyio.abc.TaskGroup | None = None
        self._capacity = anyio.Event()
        self._closing_at: float | None = None
        self.slots: dict[str, Slot] = {}
        for deployment_id, deployment in compiled.deployments.items():
            self._adopt_slot(new_slot(deployment_id, deployment, clock=self.clock.now))
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

    def _protected(self, key: ResidencyKey, *, transient: bool = True) -> bool:
        """Whether ``key``'s generation may not be evicted now: staged, pinned, or (with
        ``transient``, the normal rule) busy, preparing or draining."""
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
        settling = busy or slot.state in (DeploymentState.PREPARING, DeploymentState.DRAINING)
        return slot.config.pinned or (transient and settling)

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
            extra={
                "engine_pid": slot.process.pid if slot.routable() and slot.process else None,
                "keep_alive_expires_in_s": self._keep_alive_left_s(slot),
            },
        )

    def _keep_alive_left_s(self, slot: Slot) -> float | None:
        """Seconds until an idle ready deployment's keep-alive stops it (on the manager's
        clock); ``None`` while it is busy, not ready, or has no keep-alive."""
        keep_alive = slot.config.keep_alive_secs
        gate = slot.gate
        released = gate.last_released_at
        if keep_alive is None or released is None or not slot.routable():
            return None
        if gate.active or gate.queued:
            return None
        return round(max(0.0, keep_alive - (self.clock.now() - released)), 1)

    def status(self) -> list[DeploymentStatus]:
        """Every deployment's status (a frozen snapshot), sorted by id."""
        return [self._status_of(s) for s in sorted(self.slots.values(), key=lambda s: s.deployment)]

    def snapshot(self, deployment: str) -> DeploymentStatus:
        """One deployment's status now (frozen).

        Raises:
            UnknownDeployment: ``unknown_deployment``.
        """
        return self._status_of(self.slot(deployment))

    def _artifact_of(self, deployment: str) -> ResolvedArtifact | None:
        slot = self.slot(deployment)
        if slot.artifact is not None:
            return slot.artifact
        try:
            return self.resolve_config(slot.config, self.catalog)
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
        slot = self.slot(deployment)
        limit = slot.config.max_output_tokens
        context = slot.config.max_context
        if context is None:
            artifact = self._artifact_of(deployment)
            context = artifact.context_length if artifact is not None else None
        return max(1, min(limit, context)) if context else limit

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
        adopted as commands in their original order and finish under their ids (and later
        ones -- a ``jobs retry`` -- within :data:`ADOPT_POLL_S`); then
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
        # A dead host's running jobs go back to the queue first, so the adoption below sees
        # them as they are (and ends those no deployment here declares at once).
        await self.engine.recover()
        await self.adopt_runtime_jobs()
        for slot in self.slots.values():
            if slot.config.warm:
                self.request_load(slot.deployment, reason="warm")
            elif str(slot.config.pull) == "on_boot":
                deployment = slot.deployment
                self.start_contained(
                    functools.partial(self._verify_on_boot, deployment),
                    what=f"the on_boot verification of {deployment}",
                )
        self.start_contained(self._maintenance, what="the maintenance loop")
        self.start_contained(self._adoption, what="the runtime job adoption loop")

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
        self._refuse_now(slot)
        # The common case -- a ready engine with a free slot and nobody queued -- is
        # admitted without waiting, so it needs no deadline (a cancel scope and a timer per
        # request cost more than the rest of admission).
        permit = slot.gate.try_admit() if slot.routable() else None
        if permit is None:
            slot, permit = await self._admit_waiting(deployment, priority)
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

    async def _admit_waiting(self, deployment: str, priority: PriorityClass) -> tuple[Slot, Permit]:
        """Admission that may wait (a cold or starting engine, a full gate), within the
        deployment's ``queue_timeout_ms``; the slot admitted to and its permit.

        Raises:
            AdmissionRejected: as :meth:`acquire`.
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
                    "idle so that it could be swapped in; retry later",
                    deployment=deployment,
                    retry_after_ms=max(1000, slot.config.queue_timeout_ms),
                    retryable=True,  # busy, not too big: the swap fits once that model idles
                )
            raise reject(
                AdmissionReason.QUEUE_TIMEOUT,
                f"{deployment} did not become ready within {timeout_s:g} s",
                deployment=deployment,
            )
        return slot, permit

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
        if slot.crash is not None or slot.state == DeploymentState.DRAINING:
            self._refuse_now(slot)
        if slot.state != DeploymentState.FAILED:
            return
        if slot.reason_code == AdmissionReason.INSUFFICIENT_CAPACITY.value:
            raise reject(
                AdmissionReason.INSUFFICIENT_CAPACITY,
                slot.last_error or "the deployment does not fit",
                deployment=slot.deployment,
                retry_after_ms=max(1000, slot.config.queue_timeout_ms),
                retryable=slot.capacity_retryable,
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

    async def _adoption(self) -> None:
        """Take queued runtime jobs this host does not hold yet (``adopt_runtime_jobs``)."""
        from sbproxy.model_host.runtime._command_verbs import ADOPT_POLL_S

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
        for slot in list(self.slots.values()):
            process, generation, port = slot.process, slot.generation, slot.port
            if slot.state != DeploymentState.READY or process is None or port is None:
                continue
            # Ownership first: /health goes only to a socket our child holds, never to a
            # process that took the port.
            holder = await anyio.to_thread.run_sync(process.port_holder, port)
            health = "stopped" if not process.alive() else "unhealthy"
            if holder == "ours":
                health = await process.probe(f"http://127.0.0.1:{port}/health")
            if slot.process is not process or slot.generation != generation:
                continue  # changed while probing
            if health == "stopped":
                await self._engine_lost(
                    slot, generation, f"the engine exited: {process.stderr_tail(15)}"
                )
            elif health == "ready":
                slot.health_misses = 0
            else:
                slot.health_misses += 1
                if slot.health_misses >= HEALTH_MISSES:
                    why = (
                        f"port {port} is held by another process"
                        if holder == "foreign"
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
