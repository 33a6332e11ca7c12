"""Builders for artifact tests: catalog artifacts for given bytes, and a pull engine."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sbproxy.catalog import ArtifactFile, ArtifactFormat, EngineKind, ResolvedArtifact, Stability
from sbproxy.catalog import artifact_digest as compute_digest
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.flows import PullInput, pull_workflow, registry
from sbproxy.store import JobRecord
from sbproxy.workflows import LeaseSettings, WorkflowEngine

REPO = "acme/tiny-GGUF"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_artifact(
    files: dict[str, bytes],
    *,
    source: str = f"hf:{REPO}",
    revision: str = REVISION,
    fmt: ArtifactFormat = ArtifactFormat.GGUF,
    model: str = "tiny",
    variant: str = "q4_k_m",
) -> ResolvedArtifact:
    listed = tuple(
        ArtifactFile(path=path, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
        for path, data in files.items()
    )
    fields = {
        "catalog_revision": "test-1",
        "logical_model": model,
        "variant_id": variant,
        "format": fmt,
        "quant": "Q4_K_M",
        "source": source,
        "revision": revision,
        "files": listed,
    }
    return ResolvedArtifact(
        **fields,  # type: ignore[arg-type]
        digest=compute_digest(**fields),  # type: ignore[arg-type]
        engine=EngineKind.LLAMA_CPP,
        stability=Stability.PREVIEW,
        context_length=2048,
        min_memory_bytes=1,
    )


@asynccontextmanager
async def pull_engine(root: Path) -> AsyncIterator[tuple[WorkflowEngine, ArtifactCache]]:
    layout = CacheLayout(root=root)
    cache = ArtifactCache(layout)
    engine = await WorkflowEngine.open(
        layout.journal, registry, resources=[cache], lease=LeaseSettings(lease_s=5)
    )
    try:
        yield engine, cache
    finally:
        await engine.close()


async def pull(root: Path, request: PullInput) -> JobRecord:
    """Run one pull job to its end on a fresh engine over the cache at ``root``."""
    async with pull_engine(root) as (engine, _):
        submitted = await engine.submit(
            pull_workflow, request, idempotency_key=request.artifact.digest
        )
        return await engine.join(submitted.job.id)
