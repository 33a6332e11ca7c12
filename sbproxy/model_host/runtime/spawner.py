"""Starting one generation's engine: :class:`Spawner` builds its launch (port, devices,
context size) and retries failed attempts as the launch policy says, until one is ready or
the failure is retained (``start_timeout``, ``crash_loop``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from sbproxy.catalog import Accelerator
from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.engines import EngineError, LaunchRequest
from sbproxy.model_host.runtime.context import RuntimeContext
from sbproxy.model_host.runtime.deployment import Deployment
from sbproxy.model_host.runtime.launcher import Engine, LaunchSpec
from sbproxy.model_host.runtime.policy import (
    Attempts,
    Verdict,
    after_failed_spawn,
    start_timeout_s,
)
from sbproxy.model_host.runtime.state import CrashLoop
from sbproxy.store import wall_clock_ms

__all__ = ["Spawner", "ctx_size"]

logger = logging.getLogger(__name__)


def ctx_size(found: Deployment) -> int:
    """The context length of one slot of ``found``'s engine, in tokens (its
    ``max_context``, else the artifact's; at most 2**20)."""
    assert found.artifact is not None  # noqa: S101 - resolved before launch
    return max(1, min(found.config.max_context or found.artifact.context_length, 1 << 20))


def _sets_threads(extra_args: Iterable[str]) -> bool:
    """Whether the operator's engine flags already set llama.cpp's thread count."""
    return any(arg in ("-t", "--threads") or arg.startswith("--threads=") for arg in extra_args)


def _pinned_template(deployment: Deployment) -> str | None:
    """The chat template name the catalog pins for the deployment's artifact, if any."""
    artifact = deployment.artifact
    template = artifact.chat_template if artifact is not None else "embedded"
    return None if template in ("embedded", "none") else template


class Spawner:
    """Launch attempts of one generation. ``free_port`` picks each attempt's loopback port
    (a lost port retries at once on a new one)."""

    def __init__(self, context: RuntimeContext, *, free_port: Callable[[], int]) -> None:
        self._context = context
        self._free_port = free_port

    def _launch_spec(
        self, found: Deployment, metadata: CachedMetadata, executable: Path, timeout_s: float
    ) -> LaunchSpec:
        config = found.config
        split = self._context.splits.get(found.deployment)
        request = LaunchRequest(
            deployment=found.deployment,
            generation=found.generation,
            metadata=metadata,
            snapshot=self._context.cache.snapshot(metadata.artifact_digest),
            port=self._free_port(),
            ctx_size=ctx_size(found) * config.max_concurrency,
            max_concurrency=config.max_concurrency,
            kv_quant=str(config.kv_quant),
            extra_args=tuple(config.extra_args),
            chat_template=_pinned_template(found),
            rpc_servers=split.endpoints if split is not None else (),
            **self._device_request(found),
        )
        return LaunchSpec(
            request=request,
            executable=executable,
            log_path=self._context.layout.engine_log(found.deployment, found.generation),
            label=f"{found.deployment}/{found.generation}",
            ready_timeout_s=timeout_s,
        )

    def _device_request(self, found: Deployment) -> dict[str, Any]:
        """The launch fields that place an engine on its devices: the host's accelerator;
        on an accelerator the reserved devices, the estimate and the smallest device's
        memory; on a CPU host split into several devices, the threads of the shares it
        holds."""
        host_devices = self._context.devices
        accelerator = host_devices.accelerator
        devices = self._context.reserved_devices(found)
        if accelerator is Accelerator.CPU:
            shares = len(host_devices.devices)
            if shares <= 1 or _sets_threads(found.config.extra_args):
                return {"accelerator": "cpu"}
            per_share = max(1, (os.cpu_count() or 1) // shares)
            return {"accelerator": "cpu", "threads": per_share * max(1, len(devices))}
        totals = [d.total_bytes for i in devices if (d := host_devices.get(i)) is not None]
        return {
            "accelerator": accelerator.value,
            "devices": devices,
            "gpu_memory_bytes": found.estimate.total_bytes if found.estimate else None,
            "device_memory_bytes": min(totals) if totals else None,
        }

    async def spawn_until_ready(
        self, found: Deployment, metadata: CachedMetadata, executable: Path
    ) -> tuple[Engine, int]:
        """Launch attempts until one is ready, as :func:`after_failed_spawn` decides; the
        engine and its port.

        Raises:
            EngineError: ``start_timeout`` or ``crash_loop`` (retained on ``found``).
        """
        context = self._context
        backoff = context.backoff(found)
        timeout_s = start_timeout_s(found.config, context.ready_timeout_s)
        attempts = Attempts()
        while True:
            spec = self._launch_spec(found, metadata, executable, timeout_s)
            try:
                return await context.launcher.spawn(spec), spec.request.port
            except EngineError as exc:
                decision = after_failed_spawn(
                    attempts,
                    code=exc.code,
                    retryable=exc.retryable,
                    backoff=backoff,
                    sample=context.jitter(),
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
                    await context.clock.sleep(decision.delay_s)
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
            await self._context.publish()
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
        await self._context.publish()
        raise EngineError(
            str(exc), code="crash_loop", remediation="Fix the cause, then reset the deployment."
        ) from exc
