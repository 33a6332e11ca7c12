"""Removal, collection and pruning of the cache, with their protections."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from sbproxy.catalog import ResolvedArtifact
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.flows import (
    GcInput,
    PullInput,
    RemoveInput,
    gc_workflow,
    prune_workflow,
    pull_workflow,
    remove_workflow,
)
from sbproxy.store import JobRecord, JobStatus
from sbproxy.workflows import WorkflowEngine
from tests.model_host.artifacts.support import make_artifact, pull_engine

pytestmark = pytest.mark.anyio


def data(seed: int, size: int = 10_000) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "big")).digest(size)


def local_artifact(root: Path, name: str, files: dict[str, bytes]) -> ResolvedArtifact:
    source = root / "sources" / name
    source.mkdir(parents=True)
    for path, content in files.items():
        (source / path).write_bytes(content)
    return make_artifact(files, source=f"file:{source}", model=name)


async def run(engine: WorkflowEngine, workflow: object, request: object, key: str) -> JobRecord:
    submitted = await engine.submit(workflow, request, idempotency_key=key)  # type: ignore[arg-type]
    return await engine.join(submitted.job.id)


async def publish(engine: WorkflowEngine, artifact: ResolvedArtifact) -> None:
    job = await run(engine, pull_workflow, PullInput(artifact=artifact), artifact.digest)
    assert job.status == JobStatus.SUCCEEDED, job.error


def aged(cache: ArtifactCache, artifact: ResolvedArtifact, last_accessed_ms: int) -> None:
    metadata = cache.read_metadata(artifact.digest)
    assert metadata is not None
    marker = cache.metadata_path(artifact.digest)
    marker.write_text(
        metadata.model_copy(update={"last_accessed_ms": last_accessed_ms}).model_dump_json()
    )


async def test_remove_is_exact_and_idempotent(tmp_path: Path) -> None:
    cache_root = tmp_path / "cache"
    async with pull_engine(cache_root) as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(1)})
        await publish(engine, artifact)
        first = await run(engine, remove_workflow, RemoveInput(digest=artifact.digest), "r1")
        assert first.status == JobStatus.SUCCEEDED
        assert first.output == {
            "artifact_digest": artifact.digest,
            "removed": True,
            "reclaimed_bytes": 10_000,
            "cancelled_pulls": [],
        }
        assert cache.lookup(artifact).kind == "missing"
        assert cache.blob_bytes() == 0
        again = await run(engine, remove_workflow, RemoveInput(digest=artifact.digest), "r2")
        assert again.output["removed"] is False


@pytest.mark.parametrize("reason", ["configured", "resident", "pinned"])
async def test_explicit_protection_blocks_removal(tmp_path: Path, reason: str) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(2)})
        await publish(engine, artifact)
        job = await run(
            engine,
            remove_workflow,
            RemoveInput(digest=artifact.digest, protected={artifact.digest: reason}),
            "r",
        )
        assert job.status == JobStatus.FAILED
        assert job.error is not None
        assert job.error.code == "removal_blocked"
        assert f"cannot be removed: {reason}" in job.error.message
        assert cache.lookup(artifact).kind == "ready"


async def test_a_live_lease_blocks_removal_until_released(tmp_path: Path) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(3)})
        await publish(engine, artifact)
        lease = cache.lease(artifact.digest)
        blocked = await run(engine, remove_workflow, RemoveInput(digest=artifact.digest), "r1")
        assert blocked.error is not None
        assert "cannot be removed: leased" in blocked.error.message
        lease.release()
        done = await run(engine, remove_workflow, RemoveInput(digest=artifact.digest), "r2")
        assert done.output["removed"] is True


async def test_an_active_pull_job_blocks_removal(tmp_path: Path) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(4)})
        await publish(engine, artifact)
        await engine.submit(
            pull_workflow,
            PullInput(artifact=artifact),
            idempotency_key=artifact.digest,
            subject=f"artifact:sha256:{artifact.digest}",
        )
        job = await run(engine, remove_workflow, RemoveInput(digest=artifact.digest), "r")
        assert job.error is not None
        assert "cannot be removed: queued" in job.error.message
        assert cache.lookup(artifact).kind == "ready"


async def test_removal_keeps_a_blob_another_artifact_shares(tmp_path: Path) -> None:
    shared = data(5)
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        first = local_artifact(tmp_path, "first", {"model.gguf": shared})
        second = local_artifact(tmp_path, "second", {"model.gguf": shared, "x.gguf": data(6)})
        await publish(engine, first)
        await publish(engine, second)
        job = await run(engine, remove_workflow, RemoveInput(digest=second.digest), "r")
        assert job.output["reclaimed_bytes"] == 10_000  # only x.gguf's blob was freed
        assert cache.blob_ok(hashlib.sha256(shared).hexdigest(), len(shared))
        assert (cache.snapshot(first.digest) / "model.gguf").read_bytes() == shared


async def test_gc_deletes_least_recently_used_first_and_skips_protected(tmp_path: Path) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifacts = [
            local_artifact(tmp_path, f"m{i}", {"model.gguf": data(10 + i)}) for i in range(4)
        ]
        for artifact in artifacts:
            await publish(engine, artifact)
        now = int(time.time() * 1000)
        for age, artifact in enumerate(artifacts):
            aged(cache, artifact, now - (10 - age) * 1000)  # m0 oldest ... m3 newest
        orphan = cache.blob("f" * 64)
        orphan.write_bytes(b"x" * 500)
        job = await run(
            engine,
            gc_workflow,
            GcInput(budget_bytes=20_000, protected={artifacts[0].digest: "pinned"}),
            "gc",
        )
        assert job.status == JobStatus.SUCCEEDED, job.error
        report = job.output
        assert report["before_bytes"] == 40_500
        assert report["deleted_artifacts"] == [artifacts[1].digest, artifacts[2].digest]
        assert report["skipped_artifacts"] == {artifacts[0].digest: "pinned"}
        assert report["after_bytes"] == 20_000
        assert report["reclaimed_bytes"] == 20_500
        assert report["budget_unsatisfied_bytes"] == 0
        assert not orphan.exists()
        assert [cache.lookup(a).kind for a in artifacts] == ["ready", "missing", "missing", "ready"]


async def test_gc_reports_an_unsatisfiable_budget(tmp_path: Path) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(20)})
        await publish(engine, artifact)
        lease = cache.lease(artifact.digest)
        try:
            job = await run(engine, gc_workflow, GcInput(budget_bytes=0), "gc")
        finally:
            lease.release()
        assert job.output["deleted_artifacts"] == []
        assert job.output["skipped_artifacts"] == {artifact.digest: "leased"}
        assert job.output["budget_unsatisfied_bytes"] == 10_000


async def test_prune_deletes_only_unreferenced_blobs(tmp_path: Path) -> None:
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        artifact = local_artifact(tmp_path, "a", {"model.gguf": data(30)})
        await publish(engine, artifact)
        orphan = cache.blob("e" * 64)
        orphan.write_bytes(b"y" * 1234)
        stale = cache.layout.snapshots / f".staging-{'d' * 64}-{os.getpid()}"
        stale.mkdir()
        job = await run(engine, prune_workflow, GcInput(budget_bytes=0), "prune")
        assert job.output == {"orphan_blobs": 1, "reclaimed_bytes": 1234, "abandoned_partials": 0}
        assert not orphan.exists()
        assert not stale.exists()
        assert cache.lookup(artifact).kind == "ready"


async def test_prune_keeps_blobs_of_an_unfinished_multi_file_pull(tmp_path: Path) -> None:
    from sbproxy.workflows import arm, disarm_all

    class Stop(BaseException):
        pass

    def stop() -> None:
        raise Stop

    files = {"a.gguf": data(40), "b.gguf": data(41)}
    artifact = local_artifact(tmp_path, "multi", files)
    arm("step:fetch:b.gguf:before", action=stop)
    try:
        async with pull_engine(tmp_path / "cache") as (engine, cache):
            submitted = await engine.submit(
                pull_workflow, PullInput(artifact=artifact), idempotency_key=artifact.digest
            )
            with pytest.raises(BaseExceptionGroup):
                await engine.join(submitted.job.id)
            first_blob = cache.blob(hashlib.sha256(files["a.gguf"]).hexdigest())
            assert first_blob.exists()
    finally:
        disarm_all()
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        job = await run(engine, prune_workflow, GcInput(budget_bytes=0), "prune")
        assert job.output["orphan_blobs"] == 0
        assert first_blob.exists()


async def test_prune_deletes_the_partials_of_a_failed_pull_and_what_only_they_kept(
    tmp_path: Path,
) -> None:
    from sbproxy.model_host.flows import prune_preview

    files = {"a.gguf": data(50), "b.gguf": data(51)}
    artifact = local_artifact(tmp_path, "broken", files)
    # b.gguf changes on disk after the catalog pinned it: the pull fails on it, after a.gguf
    # was already promoted into the blob store under the pull's manifest.
    (tmp_path / "sources" / "broken" / "b.gguf").write_bytes(data(52))
    first_blob_sha = hashlib.sha256(files["a.gguf"]).hexdigest()
    async with pull_engine(tmp_path / "cache") as (engine, cache):
        failed = await run(engine, pull_workflow, PullInput(artifact=artifact), artifact.digest)
        assert failed.status == JobStatus.FAILED
        assert failed.error is not None and failed.error.code == "digest_mismatch"
        partials = cache.layout.partials / artifact.digest
        assert partials.is_dir() and cache.blob(first_blob_sha).exists()

        preview = await prune_preview(cache, engine.store)
        assert (preview.orphan_blobs, preview.abandoned_partials) == (1, 1)
        assert partials.is_dir() and cache.blob(first_blob_sha).exists()  # a preview only

        job = await run(engine, prune_workflow, GcInput(budget_bytes=0), "prune")
        assert job.output["abandoned_partials"] == 1
        assert job.output["orphan_blobs"] == 1
        assert job.output["reclaimed_bytes"] == preview.reclaimed_bytes
        assert not partials.exists()
        assert not cache.blob(first_blob_sha).exists()
