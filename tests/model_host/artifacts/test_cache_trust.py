"""Nothing unverified is published: reused blobs are re-hashed, edited markers are corrupt.

A blob already in the store is trusted for its size only until a pull re-hashes it; the
ready marker and the snapshot's ``artifact.json`` must describe the artifact they belong to.
Real files, a real journal and a real local HF-compatible server.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sbproxy.model_host.flows import PullInput
from sbproxy.store import JobRecord, JobStatus
from tests.model_host.artifacts.support import REPO, REVISION, make_artifact, pull, pull_engine
from tests.support.hf_server import HfMirror

pytestmark = pytest.mark.anyio


def payload(seed: int, size: int = 200_000) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "big")).digest(size)


def damage(path: Path) -> None:
    """Flip bytes in place: same size, different content (what a size check cannot see)."""
    path.chmod(0o644)
    with path.open("r+b") as handle:
        handle.seek(100)
        original = handle.read(4)
        handle.seek(100)
        handle.write(bytes(b ^ 0xFF for b in original))


def blob_of(root: Path, data: bytes) -> Path:
    return root / "blobs" / "sha256" / hashlib.sha256(data).hexdigest()


def assert_corrupt(job: JobRecord, *fragments: str) -> None:
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "cache_corrupt", job.error
    for fragment in fragments:
        assert fragment in job.error.message


async def test_a_damaged_shared_blob_is_not_published_for_another_artifact(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(1)
    first = make_artifact({"model.gguf": data}, model="first")
    second = make_artifact({"model.gguf": data}, model="second")
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    assert (await pull(tmp_path, PullInput(artifact=first))).status == JobStatus.SUCCEEDED
    damage(blob_of(tmp_path, data))
    mirror.clear()

    job = await pull(tmp_path, PullInput(artifact=second))
    assert_corrupt(job, str(blob_of(tmp_path, data)), "nothing was published")
    assert not (tmp_path / "metadata" / f"{second.digest}.json").exists()
    assert not (tmp_path / "snapshots" / second.digest).exists()
    assert mirror.requests == []  # failed closed: no silent repair from the network


async def test_republishing_after_a_lost_marker_re_hashes_the_blobs(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(2)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    assert (await pull(tmp_path, PullInput(artifact=artifact))).status == JobStatus.SUCCEEDED
    marker = tmp_path / "metadata" / f"{artifact.digest}.json"

    marker.unlink()  # intact blobs: the snapshot is rebuilt from verified bytes
    rebuilt = await pull(tmp_path, PullInput(artifact=artifact))
    assert rebuilt.status == JobStatus.SUCCEEDED, rebuilt.error
    assert (tmp_path / "snapshots" / artifact.digest / "model.gguf").read_bytes() == data

    marker.unlink()
    damage(blob_of(tmp_path, data))
    assert_corrupt(await pull(tmp_path, PullInput(artifact=artifact)), "SHA-256")
    assert not marker.exists()


async def test_an_import_over_a_damaged_blob_fails_closed(tmp_path: Path) -> None:
    data = payload(3)
    source = tmp_path / "src"
    source.mkdir()
    (source / "model.gguf").write_bytes(data)
    first = make_artifact({"model.gguf": data}, source=f"file:{source}", model="first")
    cache = tmp_path / "cache"
    assert (await pull(cache, PullInput(artifact=first))).status == JobStatus.SUCCEEDED
    damage(blob_of(cache, data))

    second = make_artifact({"model.gguf": data}, model="second")
    job = await pull(
        cache,
        PullInput(artifact=second, local_files={"model.gguf": str(source / "model.gguf")}),
    )
    assert_corrupt(job, str(blob_of(cache, data)))
    assert not (cache / "metadata" / f"{second.digest}.json").exists()


@pytest.mark.parametrize("where", ["metadata", "artifact.json"])
async def test_an_edited_identity_is_corrupt(tmp_path: Path, mirror: HfMirror, where: str) -> None:
    data = payload(4)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    assert (await pull(tmp_path, PullInput(artifact=artifact))).status == JobStatus.SUCCEEDED
    if where == "metadata":
        described = tmp_path / "metadata" / f"{artifact.digest}.json"
    else:
        described = tmp_path / "snapshots" / artifact.digest / "artifact.json"
    document = json.loads(described.read_text())
    document["variant_id"] = "q8_0"
    described.chmod(0o644)
    described.write_text(json.dumps(document))
    mirror.clear()

    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert_corrupt(job, "does not describe")
    assert mirror.requests == []


async def test_the_repair_advice_for_a_shared_damaged_blob_names_every_sharer_and_works(
    tmp_path: Path, mirror: HfMirror
) -> None:
    from sbproxy.model_host.flows import GcInput, RemoveInput, prune_workflow, remove_workflow

    data = payload(5)
    first = make_artifact({"model.gguf": data}, model="first")
    second = make_artifact({"model.gguf": data}, model="second")
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    for artifact in (first, second):
        assert (await pull(tmp_path, PullInput(artifact=artifact))).status == JobStatus.SUCCEEDED
    damage(blob_of(tmp_path, data))

    job = await pull(tmp_path, PullInput(artifact=first))
    assert_corrupt(job)
    assert job.error is not None
    advice = job.error.message
    assert "second:q4_k_m" in advice and "sbproxy models prune" in advice

    async with pull_engine(tmp_path) as (engine, _):
        for key, request in (
            ("r1", RemoveInput(digest=first.digest)),
            ("r2", RemoveInput(digest=second.digest)),
        ):
            submitted = await engine.submit(remove_workflow, request, idempotency_key=key)
            assert (await engine.join(submitted.job.id)).status == JobStatus.SUCCEEDED
        submitted = await engine.submit(prune_workflow, GcInput(budget_bytes=0))
        assert (await engine.join(submitted.job.id)).status == JobStatus.SUCCEEDED
    repaired = await pull(tmp_path, PullInput(artifact=first))
    assert repaired.status == JobStatus.SUCCEEDED, repaired.error
    assert (tmp_path / "snapshots" / first.digest / "model.gguf").read_bytes() == data
