"""The runtime manager: the one owner of live deployment state.

It holds, per deployment, the admission gate, the current generation (engine process,
loopback port, artifact lease, memory reservation), the lifecycle state and the retained
failure. Everything that changes that state goes through its methods; slow work (pulls,
engine acquisition, launches, drains) runs in durable jobs (``runtime/jobs.py``) whose steps
call back into the manager, so a crash at any point is followed by a restart that finishes
the job under its original id and converges to the committed desired state.

Cold starts coalesce: concurrent requests for one cold deployment share one ``load`` job
(idempotency key ``load:<deployment>``) and wait for it within their queue timeout. A ready
engine that dies is noticed by the maintenance loop (health probes every second) and is
relaunched on the next request, unless launches keep failing: after the backoff's attempts
the deployment is retained in ``crash_loop`` until ``reset``.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
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
    Permit,
    keep_alive_expired,
    reject,
)
from sbproxy.model_host.runtime.memory import MemoryEstimate, estimate_memory, read_gguf_header
from sbproxy.model_host.runtime.residency import Residency, ResidencyKey
from sbproxy.model_host.runtime.state import (
    CrashLoop,
    DeploymentState,
    DeploymentStatus,
    LaunchBackoff,
    bounded,
)
from sbproxy.store import RuntimeStore, wall_clock_ms
from sbproxy.workflows import WorkerIdentity, WorkflowEngine

__all__ = [
    "RuntimeManager",
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


class UnknownDeployment(SbproxyError):
    """No deployment has this id (``unknown_deployment``)."""

    default_code = "unknown_deployment"


@dataclass
class Slot:
    """Live state of one deployment (replica 0: this runtime is single-node)."""

    deployment: str
    config: DeploymentConfig
    gate: AdmissionGate
    state: DeploymentState = DeploymentState.CONFIGURED
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
    ready: anyio.Event = field(default_factory=anyio.Event)
    loading: bool = False
    launching: anyio.Lock = field(default_factory=anyio.Lock)


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


class RuntimeManager:
    """Owner of every deployment's live state (see the module docstring).

    Args:
        compiled: The desired state.
        layout: The cache root (artifacts, engines, journal, logs).
        catalog: The catalog deployments resolve against.
        engine: The workflow engine whose resources include this manager.
        runtime_store: Generations and committed revisions.
        worker: This worker's profile (accelerator, memory).
        backoff: Launch retry policy.
        ready_timeout_s: How long an engine may take to answer ``/health``.
        health_interval_s: Maintenance tick period.
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
        ready_timeout_s: float = 300.0,
        health_interval_s: float = 1.0,
    ) -> None:
        self.compiled = compiled
        self.layout = layout
        self.cache = ArtifactCache(layout)
        self.catalog = catalog
        self.engine = engine
        self.runtime_store = runtime_store
        self.worker = worker
        self.backoff = backoff or LaunchBackoff()
        self.ready_timeout_s = ready_timeout_s
        self.health_interval_s = health_interval_s
        self.identity = WorkerIdentity.current()
        host = compiled.model_host
        self.shutdown_deadline_s = (host.shutdown_deadline_ms if host else 30_000) / 1000
        self.safety_margin = host.safety_margin if host else 0.10
        # Engine launches of different deployments run at once up to this limit
        # (``max_parallel_prepares``, reference default 2); more wait their turn.
        # Checks a configuration file's candidate before a file reload plans it (`serve
        # --locked` refuses one that drifts from the lockfile); raising refuses the reload.
        self.config_guard: Callable[[CompiledConfig], Awaitable[None]] | None = None
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
        self.slots: dict[str, Slot] = {
            deployment_id: new_slot(deployment_id, deployment)
            for deployment_id, deployment in compiled.deployments.items()
        }
        # Reload bookkeeping (runtime/reload.py): staged generations not yet routed, the
        # candidates of reloads in flight by content digest, the callbacks a commit runs
        # (the gateway swaps its routes and keys), and whether a reload is protecting every
        # current reservation from eviction while it stages.
        self.staged: dict[str, Slot] = {}
        self.recreated: list[tuple[Slot, bool]] = []
        self.candidates: dict[str, CompiledConfig] = {}
        self.on_commit: list[Callable[[CompiledConfig], None]] = []
        self.protect_all = False
        self.reload_lock = anyio.Lock()
        self.revision: int | None = None

    # -- lookup ----------------------------------------------------------------------------

    def slot(self, deployment: str) -> Slot:
        """The slot of ``deployment``.

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

    def _protected(self, key: ResidencyKey) -> bool:
        if self.protect_all:
            return True
        slot = self.slots.get(key.deployment)
        staged = self.staged.get(key.deployment)
        if staged is not None and staged.generation == key.generation:
            return True
        if slot is None or slot.generation != key.generation:
            return False
        busy = slot.gate.active > 0 or slot.gate.queued > 0
        return (
            busy
            or slot.config.pinned
            or slot.state in (DeploymentState.PREPARING, DeploymentState.DRAINING)
        )

    def status(self) -> list[DeploymentStatus]:
        """Every deployment's status, sorted by id."""
        out = []
        for slot in sorted(self.slots.values(), key=lambda s: s.deployment):
            out.append(
                DeploymentStatus(
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
                    port=slot.port,
                    reason_code=slot.reason_code,
                    job_id=slot.job_id,
                    last_error=slot.last_error,
                )
            )
        return out

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        """Reap orphan engines, commit the desired revision, start converging to it.

        Deployments with ``warm: true`` get a ``load`` job (joining an unfinished one from
        before a crash, which then finishes under its original id); ``pull: on_boot``
        deployments get their artifact verified by a pull job. The maintenance loop starts.
        """
        self._group = group
        report = await anyio.to_thread.run_sync(reap_orphans, self.owned_dir)
        if report.killed:
            logger.warning("reaped orphan engines: %s", report.killed)
        desired = desired_of(self.compiled)
        self.revision = await self.runtime_store.commit_revision(
            content_digest=desired_digest(desired), desired=desired
        )
        for slot in self.slots.values():
            if slot.config.warm:
                self.begin_load(slot.deployment)
            elif str(slot.config.pull) == "on_boot":
                group.start_soon(self._verify_on_boot, slot.deployment)
        group.start_soon(self._maintenance)

    @property
    def owned_dir(self) -> Path:
        """Ownership records of the engines this host started."""
        return self.layout.engines / "owned"

    def run_in_background(self, job_id: str) -> None:
        """Run a job on the manager's task group; :meth:`shutdown` lets it settle first."""
        self.background(lambda: self.engine.run_job(job_id))

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

    def begin_load(self, deployment: str) -> None:
        """Start (or join) the ``load`` job of ``deployment`` in the background."""
        slot = self.slot(deployment)
        if slot.loading or self._group is None:
            return
        slot.loading = True
        # Counted like any background work: shutdown waits for it even after a reload
        # retired this slot from ``slots``.
        self.background(lambda: self._run_load(deployment))

    async def _run_load(self, deployment: str) -> None:
        from sbproxy.model_host.runtime.jobs import submit_load

        slot = self.slot(deployment)
        try:
            job = await submit_load(self, deployment)
            slot.job_id = job.id
            final = await self.engine.run_job(job.id)
            if final.error is not None and slot.state != DeploymentState.FAILED:
                self._fail(slot, final.error.code, final.error.message)
        except Exception as exc:
            logger.exception("load of %s failed", deployment)
            self._fail(slot, getattr(exc, "code", "prepare_failed"), str(exc))
        finally:
            slot.loading = False
            if slot.state != DeploymentState.READY:
                slot.ready.set()  # wake waiters: they re-check the state
                slot.ready = anyio.Event()

    async def _verify_on_boot(self, deployment: str) -> None:
        from sbproxy.model_host.runtime.jobs import pull_for

        slot = self.slot(deployment)
        try:
            await pull_for(self, slot, intent="startup")
        except SbproxyError as exc:
            self._fail(slot, exc.code, str(exc))

    # -- steps of the durable jobs (runtime/jobs.py) ---------------------------------------

    def resolve(self, slot: Slot) -> ResolvedArtifact:
        """Resolve the deployment's exact artifact on this worker."""
        slot.artifact = self.resolve_config(slot.config, self.catalog)
        return slot.artifact

    def resolve_config(self, config: DeploymentConfig, catalog: Catalog) -> ResolvedArtifact:
        """Resolve one deployment definition against ``catalog`` on this worker.

        Raises:
            ResolutionError: ``unknown_catalog_model``, ``unknown_catalog_variant``, ...
            NoCompatibleVariantError: ``no_compatible_variant``.
        """
        return resolve_artifact(catalog, artifact_request(config), self.worker).artifact

    def _fail(self, slot: Slot, code: str, message: str) -> None:
        slot.state = DeploymentState.FAILED
        slot.reason_code = code
        slot.last_error = bounded(message)

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

    async def launch_generation(
        self, slot: Slot, *, executable: Path, job_id: str, generation: int | None = None
    ) -> int:
        """Start a new generation of ``slot`` and wait until it is ready; its port.

        Idempotency: a live, ready engine of this slot is reused; concurrent callers (a load
        job and a resumed reload) serialize on the slot, and the second finds it ready.
        Launches across deployments run at most ``max_parallel_prepares`` at once.
        Launch failures retry with the backoff; exhaustion (or a non-retryable failure)
        retains ``crash_loop``. ``generation`` restarts a stopped generation under its own
        number (a failed ``recreate`` rollout restoring the prior engine); by default a new
        generation number is taken from the store.

        Raises:
            EngineError: ``crash_loop`` (or the non-retryable launch error).
            AdmissionRejected: ``insufficient_capacity`` when the estimate does not fit.
        """
        async with slot.launching, self.prepares:
            return await self._launch_locked(
                slot, executable=executable, job_id=job_id, generation=generation
            )

    async def _launch_locked(
        self, slot: Slot, *, executable: Path, job_id: str, generation: int | None
    ) -> int:
        if (
            slot.process is not None
            and slot.process.alive()
            and slot.state == DeploymentState.READY
        ):
            assert slot.port is not None  # noqa: S101 - a ready slot has a port
            return slot.port
        if slot.crash is not None:
            raise EngineError(slot.crash.last_error, code="crash_loop")
        metadata = self.cache.read_metadata(slot.artifact.digest) if slot.artifact else None
        if metadata is None:
            raise EngineError("the artifact is not in the cache", code="artifact_not_ready")
        slot.metadata = metadata
        slot.executable = executable
        slot.state = DeploymentState.PREPARING
        slot.job_id = job_id
        estimate = self.estimate(slot, metadata)
        slot.generation = generation or await self.runtime_store.next_generation(slot.deployment)
        key = ResidencyKey(slot.deployment, slot.generation)
        self._tick += 1
        plan = self.residency.reserve(
            key, estimate=estimate, devices=(0,), protected=True, tick=self._tick
        )
        for victim in plan.victims:
            victim_slot = self.slots.get(victim.key.deployment)
            if victim_slot is not None and victim_slot.generation == victim.key.generation:
                await self.stop_engine(victim_slot, reason="evicted")
        slot.estimate = estimate
        first_failure: int | None = None
        for attempt in range(1, self.backoff.max_attempts + 1):
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
                    ready_timeout_s=self.ready_timeout_s,
                )
            except EngineError as exc:
                now = wall_clock_ms()
                first_failure = first_failure or now
                if exc.retryable and attempt < self.backoff.max_attempts:
                    logger.warning(
                        "%s: launch %d failed (%s); retrying", slot.deployment, attempt, exc.code
                    )
                    await anyio.sleep(self.backoff.delay(attempt))
                    continue
                self.residency.release(key)
                slot.estimate = None
                slot.crash = CrashLoop(
                    attempts=attempt,
                    reason=exc.code,
                    last_error=exc.message,
                    stderr_tail=str(exc.details.get("stderr_tail") or ""),
                    first_failure_at_ms=first_failure,
                    last_failure_at_ms=now,
                    job_id=job_id,
                )
                self._fail(slot, "crash_loop", f"{exc.code} after {attempt} launch(es): {exc}")
                raise EngineError(
                    str(exc),
                    code="crash_loop",
                    remediation="Fix the cause, then reset the deployment.",
                ) from exc
            slot.process = process
            slot.port = port
            if slot.lease is None:
                slot.lease = self.cache.lease(metadata.artifact_digest)
            slot.state = DeploymentState.READY
            slot.reason_code = None
            slot.last_error = None
            slot.health_misses = 0
            slot.gate.resume()
            slot.gate.mark_idle()
            self.residency.set_protected(key, False)
            slot.ready.set()
            return port
        raise AssertionError("unreachable")  # pragma: no cover

    async def stop_engine(self, slot: Slot, *, reason: str = "stopped") -> None:
        """Stop the slot's engine and free its reservation and lease.

        Idempotency: stopping a slot without an engine only settles its state.
        """
        process, slot.process = slot.process, None
        if process is not None:
            await process.shutdown(grace_s=min(self.shutdown_deadline_s, 10.0))
        if slot.generation:
            self.residency.release(ResidencyKey(slot.deployment, slot.generation))
        if slot.lease is not None:
            slot.lease.release()
            slot.lease = None
        slot.port = None
        slot.estimate = None
        if slot.state != DeploymentState.FAILED:
            slot.state = DeploymentState.STOPPED
            slot.reason_code = None if reason == "stopped" else reason
        slot.ready = anyio.Event()

    async def drain(self, slot: Slot) -> dict[str, object]:
        """Refuse new work, cancel the queue, wait for active requests, stop the engine."""
        previous = slot.state
        slot.state = DeploymentState.DRAINING
        report = await slot.gate.drain(deadline_s=self.shutdown_deadline_s)
        await self.stop_engine(slot)
        if previous == DeploymentState.FAILED:
            slot.state = DeploymentState.FAILED
        slot.gate.resume()
        return {
            "active_at_start": report.active_at_start,
            "cancelled_queued": report.cancelled_queued,
            "remaining_active": report.remaining_active,
            "timed_out": report.timed_out,
        }

    def reset(self, slot: Slot) -> None:
        """Clear a retained failure so the deployment may launch again.

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
        slot.state = DeploymentState.CONFIGURED
        slot.reason_code = None
        slot.last_error = None
        slot.gate.resume()

    # -- requests --------------------------------------------------------------------------

    async def acquire(self, deployment: str, *, priority: PriorityClass) -> Upstream:
        """Admit one request to ``deployment``, starting or healing its engine if needed.

        Raises:
            UnknownDeployment: ``unknown_deployment``.
            AdmissionRejected: ``draining``, ``crash_loop``, ``engine_unhealthy``,
                ``queue_full``, ``queue_timeout`` or ``insufficient_capacity``.
        """
        slot = self.slot(deployment)
        timeout_s = slot.config.queue_timeout_ms / 1000
        if slot.state == DeploymentState.DRAINING or slot.gate.draining:
            raise reject(
                AdmissionReason.DRAINING, f"{deployment} is draining", deployment=deployment
            )
        if slot.crash is not None:
            raise reject(
                AdmissionReason.CRASH_LOOP,
                f"{deployment} is crash-looped: {slot.crash.last_error}",
                deployment=deployment,
            )
        if slot.state != DeploymentState.READY or slot.process is None or not slot.process.alive():
            if str(slot.config.cold_start) == "reject":
                raise reject(
                    AdmissionReason.ENGINE_UNHEALTHY,
                    f"{deployment} has no ready replica (cold_start: reject)",
                    deployment=deployment,
                    retry_after_ms=1000,
                )
            self.begin_load(deployment)
            with anyio.move_on_after(timeout_s) as scope:
                while slot.state != DeploymentState.READY:
                    await slot.ready.wait()
                    if slot.state == DeploymentState.FAILED or slot.crash is not None:
                        reason = (
                            AdmissionReason.CRASH_LOOP
                            if slot.crash is not None
                            else AdmissionReason.ENGINE_UNHEALTHY
                        )
                        raise reject(
                            reason, slot.last_error or "the engine failed", deployment=deployment
                        )
            if scope.cancelled_caught:
                raise reject(
                    AdmissionReason.QUEUE_TIMEOUT,
                    f"{deployment} did not become ready within {timeout_s:g} s",
                    deployment=deployment,
                )
        permit = await slot.gate.admit(priority)
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

    def record_outcome(self, deployment: str, generation: int, *, timed_out: bool) -> None:
        """Count one request's end at the engine of ``deployment``/``generation``."""
        # Placeholder wiring; the supervision policy lands with the runtime owner.
        logger.debug("%s/%s request ended (timed_out=%s)", deployment, generation, timed_out)

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
        """One maintenance pass: health probes of ready engines, keep-alive expiry."""
        now = time.monotonic()
        for slot in list(self.slots.values()):
            if slot.state != DeploymentState.READY or slot.process is None:
                continue
            health = await slot.process.probe(f"http://127.0.0.1:{slot.port}/health")
            if health == "ready":
                slot.health_misses = 0
            elif health == "stopped":
                tail = slot.process.stderr_tail(15)
                await self.stop_engine(slot)
                self._fail(slot, "engine_health_failed", f"the engine exited: {tail}")
                slot.state = DeploymentState.FAILED
            else:
                slot.health_misses += 1
                if slot.health_misses >= HEALTH_MISSES:
                    await self.stop_engine(slot)
                    self._fail(slot, "engine_health_failed", "the engine stopped answering /health")
            keep_alive = slot.config.keep_alive_secs
            if slot.state == DeploymentState.READY and keep_alive_expired(
                slot.gate, keep_alive, now
            ):
                from sbproxy.model_host.runtime.jobs import submit_drain

                job = await submit_drain(self, slot.deployment, reason="keep_alive")
                self.run_in_background(job.id)

    async def shutdown(self) -> None:
        """Let in-flight loads settle (up to the deadline), then drain every deployment and
        stop every engine. Unfinished jobs stay in the journal and resume at the next start."""
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.shutdown_deadline_s):
                while self._background or any(slot.loading for slot in self.slots.values()):
                    await anyio.sleep(0.05)
            for slot in self.slots.values():
                if slot.process is not None:
                    await self.drain(slot)


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
