"""Launches and relaunches: :class:`Launches` takes a deployment from its artifact in the
cache to a ready generation -- backoff, generation number, devices, memory estimate,
reservation (``swaps.py``), engine start (``spawner.py``) -- one launch per deployment at a
time, at most ``max_parallel_prepares`` across deployments."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio

from sbproxy.config import CompiledConfig
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.engines import EngineError
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.memory import MemoryEstimate, estimate_memory, read_gguf_header
from sbproxy.model_host.runtime.residency import select_devices
from sbproxy.model_host.runtime.retire import Retirement
from sbproxy.model_host.runtime.spawner import Spawner, ctx_size
from sbproxy.model_host.runtime.swaps import Swaps
from sbproxy.store import journal_fault

__all__ = ["Launches"]

logger = logging.getLogger(__name__)


class Launches:
    """Launches of generations. Owns the prepare limiter (``max_parallel_prepares``) and
    the devices each recent generation ran on, by deployment (the last two), so that
    restarting a stopped generation under its own number keeps them."""

    def __init__(
        self,
        context: RuntimeContext,
        *,
        retirement: Retirement,
        swaps: Swaps,
        spawner: Spawner,
    ) -> None:
        self._context = context
        self._retirement = retirement
        self._swaps = swaps
        self._spawner = spawner
        self._placed: dict[str, dict[int, tuple[int, ...]]] = {}
        # Engine launches of different deployments run at once up to this limit
        # (``max_parallel_prepares``, reference default 2); more wait their turn.
        host = context.compiled.model_host
        self.prepares = anyio.CapacityLimiter(host.max_parallel_prepares if host else 2)

    def take_policies(self, compiled: CompiledConfig) -> None:
        """Take a committed configuration's ``max_parallel_prepares`` at once."""
        host = compiled.model_host
        if host is not None:
            self.prepares.total_tokens = host.max_parallel_prepares

    def estimate(
        self, found: Deployment, metadata: CachedMetadata, *, tensor_parallel: int = 1
    ) -> MemoryEstimate:
        """Memory estimate of one generation from the artifact's GGUF header, per device
        when split across ``tensor_parallel`` devices; for a split this host leads over
        several hosts' RPC workers, the share its placement reserved here."""
        split = self._context.splits.get(found.deployment)
        if split is not None:
            # Led here, run on the RPC workers: this host holds its share only.
            return MemoryEstimate.from_total(split.reserved_bytes)
        snapshot = self._context.cache.snapshot(metadata.artifact_digest)
        ggufs = [f for f in metadata.files if f.path.endswith(".gguf")]
        facts = read_gguf_header(snapshot / ggufs[0].path) if ggufs else None
        return estimate_memory(
            weights_bytes=metadata.total_size_bytes,
            facts=facts,
            seq_len=ctx_size(found),
            concurrency=found.config.max_concurrency,
            kv_quant=found.config.kv_quant,
            safety_margin=self._context.safety_margin,
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
        host_devices = self._context.devices
        residency = self._context.residency
        free = {index: residency.free_bytes(index) for index in host_devices.indexes()}
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
            host_devices.accelerator.value,
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
        context = self._context
        if found.routable():
            assert found.port is not None  # noqa: S101 - a routable deployment has a port
            return found.port
        if found.crash is not None:
            raise EngineError(found.crash.last_error, code="crash_loop")
        artifact = found.artifact
        metadata = context.cache.read_metadata(artifact.digest) if artifact else None
        if metadata is None:
            raise EngineError("the artifact is not in the cache", code="artifact_not_ready")
        if found.process is not None:  # a dead or foreign-held generation: clear it first
            await self._retirement.release_generation(found)
        found.begin_launch(metadata, executable, job_id)
        # From here on whatever ends the launch early -- a cancel (a stop won), the journal
        # away at the generation number, a failed spawn -- leaves no ``preparing`` behind:
        # the job's next run (a resume) starts the launch afresh.
        reserved = False
        try:
            await context.publish()
            wait_s = found.not_before - context.clock.now()
            if wait_s > 0:
                logger.info("%s: relaunch in %.2f s (restart backoff)", found.deployment, wait_s)
                await context.clock.sleep(wait_s)
            await context.launch_hold.wait(found.deployment)
            found.numbered(
                generation or await context.runtime_store.next_generation(found.deployment)
            )
            try:
                devices = self._select_devices(found)
                estimate = self.estimate(found, metadata, tensor_parallel=len(devices))
                await self._swaps.reserve(found, found.key, estimate, devices)
            except AdmissionRejected as exc:
                found.refused_capacity(exc.code, exc.message, retryable=exc.retryable)
                await context.publish()
                raise
            found.reserved(estimate)
            reserved = True
            split = context.splits.get(found.deployment)
            if split is not None and split.probe is not None:
                await split.probe()
            process, port = await self._spawner.spawn_until_ready(found, metadata, executable)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                if reserved:
                    context.residency.release(found.key)
                    context.capacity_changed()
                code = exc.code if isinstance(exc, SbproxyError) and journal_fault(exc) else None
                found.launch_abandoned(reason=code)
                await context.publish()
            raise
        found.launched(process, port, context.cache.lease(metadata.artifact_digest))
        context.split_launched[found.deployment] = split.placement if split else None
        # Requests that find this engine gone later need a new load, not this one.
        context.lanes.queue(found.deployment).close_joins()
        await context.publish()
        self._retirement.watch_exit(found, process, found.generation)
        return port
