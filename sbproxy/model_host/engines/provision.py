"""Make an engine executable available: use what is there, or run the durable job that
acquires it (a source build or a pinned release download)."""

from __future__ import annotations

import platform
from functools import partial
from pathlib import Path

import anyio.to_thread

from sbproxy.config import EngineConfig
from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.engines.driver import Availability
from sbproxy.model_host.engines.errors import EngineError
from sbproxy.model_host.engines.llama_build import (
    BuildInput,
    BuildOutput,
    build_identity,
    engine_build_workflow,
)
from sbproxy.model_host.engines.llama_cpp import DEFAULT_TAG, detect_llama_cpp, release_pin_for
from sbproxy.model_host.engines.llama_release import (
    FetchInput,
    engine_fetch_workflow,
    release_identity,
)
from sbproxy.store import JobStatus
from sbproxy.workflows import WorkflowEngine

__all__ = ["provision_llama_cpp"]


async def provision_llama_cpp(
    config: EngineConfig | None, *, engine: WorkflowEngine, layout_root: Path
) -> Path:
    """The llama-server executable to launch, acquiring it first when needed.

    Args:
        config: ``engines.llama_cpp`` (``None``: defaults).
        engine: Runs the acquisition job (its journal and cache resources).
        layout_root: The cache root whose ``engines/`` holds acquired engines.

    Raises:
        EngineError: ``engine_blocked`` or ``engine_incompatible`` from detection, or the
            failed acquisition job's code (``engine_provision_failed``, ...).
    """
    layout = CacheLayout(root=layout_root)
    config = config or EngineConfig()
    # Detection runs `llama-server --version` (and hashes a pinned executable): off the loop.
    found = await anyio.to_thread.run_sync(partial(detect_llama_cpp, config, layout=layout))
    if found.availability == Availability.AVAILABLE and found.executable:
        return Path(found.executable)
    if found.availability != Availability.ACQUIRABLE:
        raise EngineError(
            f"llama.cpp is {found.availability.value}: {found.reason}",
            code="engine_blocked"
            if found.availability == Availability.BLOCKED
            else "engine_incompatible",
            remediation=found.remediation,
        )
    if found.source == "source_build":
        source = config.source
        if source is None or source.file is None:
            raise EngineError(
                "source builds need a local archive (engines.llama_cpp.source.file)",
                code="engine_blocked",
                remediation="Download the archive, pin its sha256 and set source.file.",
            )
        request = BuildInput(
            archive=source.file,
            sha256=source.sha256,
            strip_prefix=source.strip_prefix or "",
            acceleration="cuda" if config.acceleration == "cuda" else "cpu",
        )
        submitted = await engine.submit(
            engine_build_workflow,
            request,
            idempotency_key=f"engine_build:{build_identity(request)}",
            subject=f"engine:llama_cpp:{build_identity(request)}",
        )
    else:
        pin = release_pin_for(
            config.version or DEFAULT_TAG,
            system=platform.system(),
            machine=platform.machine(),
            acceleration=config.acceleration,
            sha256=config.sha256,
        )
        if pin is None:  # detection said acquirable; keep the two in step
            raise EngineError("no pinned release for this platform", code="engine_blocked")
        fetch = FetchInput(tag=pin.tag, infix=pin.infix, sha256=pin.sha256)
        submitted = await engine.submit(
            engine_fetch_workflow,
            fetch,
            idempotency_key=f"engine_fetch:{release_identity(fetch)}",
            subject=f"engine:llama_cpp:{release_identity(fetch)}",
        )
    job = await engine.join(submitted.job.id)
    if job.status != JobStatus.SUCCEEDED:
        error = job.error
        raise EngineError(
            f"acquiring llama.cpp failed (job {job.id}): {error.message if error else job.status}",
            code=error.code if error else "engine_provision_failed",
            details={"job_id": job.id},
        )
    return Path(BuildOutput.model_validate(job.output).executable)
