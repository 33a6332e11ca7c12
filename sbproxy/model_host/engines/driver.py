"""The engine driver contract: detect, provision, plan a launch, launch, probe, stop.

Drivers are pure planners plus provisioning: ``detect`` says whether an engine can run here
(``available | acquirable | incompatible | blocked``, with a reason and a remediation),
``plan_launch`` turns a :class:`LaunchRequest` into argv and environment, and the generic
:func:`launch` starts the plan as a supervised child (``process.py``) and waits for it to
be ready. A launch only ever receives a verified snapshot path; no driver accepts a
repository reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import anyio

from sbproxy.model_host.artifacts import CachedMetadata
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.process import EngineProcess, spawn_engine
from sbproxy.workflows import WorkerIdentity, fault_point

__all__ = [
    "Availability",
    "Detection",
    "LaunchPlan",
    "LaunchRequest",
    "check_snapshot",
    "launch",
]


class Availability(StrEnum):
    """Whether an engine can run on this worker before anything is provisioned."""

    AVAILABLE = "available"
    ACQUIRABLE = "acquirable"
    INCOMPATIBLE = "incompatible"
    BLOCKED = "blocked"


@dataclass(frozen=True)
class Detection:
    """What a driver found.

    Attributes:
        kind: ``llama_cpp`` or ``vllm``.
        availability: See :class:`Availability`.
        reason: One sentence on why.
        remediation: What to do when it is not available.
        source: How it would be obtained: ``path`` (configured), ``PATH``, ``cache`` (built or
            downloaded earlier), ``release``, ``source_build``, ``uv`` or ``container``.
        executable: The executable when one exists.
        version: Its version text when known.
    """

    kind: str
    availability: Availability
    reason: str
    remediation: str | None = None
    source: str | None = None
    executable: str | None = None
    version: str | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON view (``sbproxy engines list``)."""
        return {
            "engine": self.kind,
            "availability": self.availability.value,
            "reason": self.reason,
            "remediation": self.remediation,
            "source": self.source,
            "executable": self.executable,
            "version": self.version,
        }


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a driver needs to plan one engine generation.

    Attributes:
        deployment: Deployment id.
        generation: Generation number (> 0).
        metadata: The verified artifact's ready marker.
        snapshot: Absolute path of its published snapshot.
        port: Loopback port the engine must listen on.
        ctx_size: Context length in tokens.
        max_concurrency: Parallel request slots.
        kv_quant: auto, f16, fp8, int8 or int4.
        accelerator: cpu, cuda or metal.
        devices: Selected device indexes (empty on CPU).
        extra_args: Allowlisted operator flags (already validated by the configuration).
        gpu_memory_bytes: Admitted memory estimate on the selected device (vLLM).
        device_memory_bytes: Total memory of the selected device (vLLM).
        chat_template: A template name the catalog pins for chat requests (llama.cpp
            ``--chat-template``); ``None`` when the weights carry their own, or the model
            does not chat.
        threads: CPU threads the engine computes with (llama.cpp ``--threads``, >= 1);
            ``None`` leaves the engine's default (every core).
        rpc_servers: The loopback ``(host, port)`` of each RPC worker's tunnel when the
            model is split over hosts (llama.cpp ``--rpc``, ``engines/rpc.py``); empty for a
            generation on this host alone.
    """

    deployment: str
    generation: int
    metadata: CachedMetadata
    snapshot: Path
    port: int
    ctx_size: int
    max_concurrency: int
    kv_quant: str = "auto"
    accelerator: str = "cpu"
    devices: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    gpu_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    chat_template: str | None = None
    threads: int | None = None
    rpc_servers: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LaunchPlan:
    """A ready-to-spawn engine: argv (no shell), environment and health URL path."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    port: int = 0


def check_snapshot(request: LaunchRequest) -> None:
    """Refuse anything but a verified, absolute snapshot whose files are where metadata says.

    Raises:
        EngineError: ``artifact_not_ready`` otherwise; rejected devices for the accelerator
            give ``engine_incompatible``.
    """
    if request.metadata.trust != "verified":
        raise EngineError("the artifact is not verified", code="artifact_not_ready")
    if not request.snapshot.is_absolute():
        raise EngineError("the verified snapshot path must be absolute", code="artifact_not_ready")
    if request.snapshot.name != request.metadata.artifact_digest:
        raise EngineError(
            "the snapshot directory does not match the artifact digest", code="artifact_not_ready"
        )
    for item in request.metadata.files:
        path = request.snapshot / item.path
        resolved = path.resolve()
        if not resolved.is_relative_to(request.snapshot.resolve()) or not path.is_file():
            raise EngineError(
                f"{item.path} is not a file of the snapshot", code="artifact_not_ready"
            )
    if request.generation <= 0 or request.port <= 0 or request.max_concurrency <= 0:
        raise EngineError("generation, port and max_concurrency must be positive")
    if request.threads is not None and request.threads <= 0:
        raise EngineError("threads must be positive")
    if len(set(request.devices)) != len(request.devices):
        raise EngineError("selected devices must be unique", code="engine_incompatible")
    if request.accelerator == "cpu" and request.devices:
        raise EngineError("a CPU launch takes no devices", code="engine_incompatible")
    if request.accelerator == "metal" and len(request.devices) != 1:
        raise EngineError("a Metal launch takes exactly one device", code="engine_incompatible")
    if request.accelerator == "cuda" and not request.devices:
        raise EngineError("a CUDA launch needs at least one device", code="engine_incompatible")


async def launch(
    plan: LaunchPlan,
    *,
    log_path: Path,
    owned_dir: Path,
    label: str,
    identity: WorkerIdentity,
    ready_timeout_s: float = 300.0,
) -> EngineProcess:
    """Spawn ``plan`` as a supervised child and wait until its health URL answers 200.

    Raises:
        EngineError: ``engine_spawn_failed``, ``engine_early_exit`` (with the output tail),
            ``engine_port_lost`` (another process holds the port) or
            ``engine_readiness_timeout`` (the process is stopped first). A cancelled launch
            stops the child before the cancellation propagates.
    """
    process = await spawn_engine(
        plan.argv,
        env=plan.env,
        log_path=log_path,
        owned_dir=owned_dir,
        label=label,
        identity=identity,
    )
    fault_point("engine.spawned")
    try:
        await process.wait_ready(
            f"http://127.0.0.1:{plan.port}{plan.health_path}",
            timeout_s=ready_timeout_s,
            port=plan.port,
        )
    except BaseException:
        # Cancelled (a stop superseded this launch) or failed: never leave the child behind.
        with anyio.CancelScope(shield=True):
            await process.shutdown(grace_s=1.0)
        raise
    return process
