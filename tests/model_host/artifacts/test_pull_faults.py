"""The pull workflow against a real local HF-compatible server, fault by fault."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbproxy.catalog import ArtifactFormat
from sbproxy.model_host.flows import PullInput, PullIntent
from sbproxy.store import JobStatus
from sbproxy.workflows import arm, disarm_all
from tests.model_host.artifacts.support import REPO, REVISION, make_artifact, pull
from tests.support.hf_server import HfMirror

pytestmark = pytest.mark.anyio

SIZE = 3_000_000


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    disarm_all()
    yield
    disarm_all()


def payload(seed: int = 1, size: int = SIZE) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "big")).digest(size)


def snapshot_bytes(root: Path, digest: str, path: str = "model.gguf") -> bytes:
    return (root / "snapshots" / digest / path).read_bytes()


def blobs(root: Path) -> list[Path]:
    directory = root / "blobs" / "sha256"
    return sorted(directory.iterdir()) if directory.is_dir() else []


def content_requests(mirror: HfMirror) -> list[tuple[int, int | None]]:
    return [(r.status, r.range_start) for r in mirror.requests if r.method == "GET"]


async def test_cut_stream_resumes_at_the_partial_offset(tmp_path: Path, mirror: HfMirror) -> None:
    data = payload()
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, cut_after=1_200_000)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert content_requests(mirror) == [(200, None), (206, 1_200_000)]
    assert mirror.requests[1].if_range == mirror.entry(REPO, REVISION, "model.gguf").etag
    assert snapshot_bytes(tmp_path, artifact.digest) == data
    assert job.output["transferred_bytes"] == SIZE - 1_200_000
    assert not (tmp_path / "partials" / artifact.digest).exists()


async def test_server_ignoring_range_restarts_cleanly_from_zero(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(2)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, cut_after=1_000_000, ignore_range=True)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert content_requests(mirror) == [(200, None), (200, 1_000_000)]
    assert snapshot_bytes(tmp_path, artifact.digest) == data


async def test_changed_etag_discards_the_partial(tmp_path: Path, mirror: HfMirror) -> None:
    data = payload(3)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(
        REPO, REVISION, "model.gguf", data, cut_after=900_000, etag_sequence=['"v1"', '"v2"']
    )
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    # The resume asked for the rest of "v1"; the upstream is now "v2": a full body replaced it.
    assert content_requests(mirror) == [(200, None), (200, 900_000)]
    assert mirror.requests[1].if_range == '"v1"'
    assert snapshot_bytes(tmp_path, artifact.digest) == data


async def test_416_at_a_complete_partial_finishes_without_download(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(4)
    artifact = make_artifact({"model.gguf": data})
    entry = mirror.add_file(REPO, REVISION, "model.gguf", data)
    part = tmp_path / "partials" / artifact.digest / "model.gguf.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(data)
    url = f"{mirror.url}/{REPO}/resolve/{REVISION}/model.gguf"
    state = {
        "schema_version": 1,
        "url": url,
        "etag": entry.etag,
        "expected_sha256": hashlib.sha256(data).hexdigest(),
        "expected_size": len(data),
        "completed_bytes": len(data),
    }
    part.with_name("model.gguf.part.resume.json").write_text(json.dumps(state))
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert content_requests(mirror) == [(416, len(data))]
    assert mirror.bytes_served() == 0
    assert snapshot_bytes(tmp_path, artifact.digest) == data


async def test_wrong_bytes_fail_with_digest_mismatch_and_publish_nothing(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(5)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, wrong_bytes=True)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "digest_mismatch"
    assert not (tmp_path / "snapshots" / artifact.digest).exists()
    assert not (tmp_path / "metadata" / f"{artifact.digest}.json").exists()
    assert list((tmp_path / "partials").rglob("*.part")) == []
    assert blobs(tmp_path) == []


async def test_disk_full_is_clear_keeps_the_cache_and_a_later_pull_succeeds(
    tmp_path: Path, mirror: HfMirror
) -> None:
    first_data, second_data = payload(6), payload(7)
    first = make_artifact({"model.gguf": first_data}, model="first")
    second = make_artifact({"model.gguf": second_data}, model="second", revision="r2" * 20)
    mirror.add_file(REPO, REVISION, "model.gguf", first_data)
    mirror.add_file(REPO, "r2" * 20, "model.gguf", second_data)
    assert (await pull(tmp_path, PullInput(artifact=first))).status == JobStatus.SUCCEEDED

    def no_space() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    arm("download.write", on_hit=2, action=no_space)
    failed = await pull(tmp_path, PullInput(artifact=second))
    assert failed.status == JobStatus.FAILED
    assert failed.error is not None
    assert failed.error.code == "disk_full"
    part = tmp_path / "partials" / second.digest / "model.gguf.part"
    assert f"not enough space on the file system of {part}" in failed.error.message
    assert re.search(
        r"downloading model\.gguf needs \d+ more bytes, \d+ bytes are free", failed.error.message
    )
    assert snapshot_bytes(tmp_path, first.digest) == first_data  # earlier content intact

    disarm_all()
    retried = await pull(tmp_path, PullInput(artifact=second))
    assert retried.status == JobStatus.SUCCEEDED, retried.error
    assert retried.id != failed.id
    assert snapshot_bytes(tmp_path, second.digest) == second_data


async def test_5xx_is_retried_then_succeeds(tmp_path: Path, mirror: HfMirror) -> None:
    data = payload(8)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, fail_statuses=[503, 502])
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert [status for status, _ in content_requests(mirror)] == [503, 502, 200]


async def test_persistent_5xx_fails_after_bounded_retries(tmp_path: Path, mirror: HfMirror) -> None:
    data = payload(9)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, fail_statuses=[503] * 50)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "http_status"
    assert "503" in job.error.message
    assert len(content_requests(mirror)) == 6  # FETCH_RETRY.max_attempts


async def test_timeouts_are_retried_then_fail_with_transport(
    tmp_path: Path, mirror: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SBPROXY_HTTP_READ_TIMEOUT_S", "0.2")
    data = payload(10, 10_000)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data, delay_s=1.0)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "transport"
    assert len([r for r in mirror.requests if r.method == "GET"]) == 6


async def test_token_is_sent_only_to_the_origin_and_never_stored(
    tmp_path: Path, mirror: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = "hf_TestTokenThatMustNeverBeStored12345"
    monkeypatch.setenv("HF_TOKEN", token)
    data = payload(11)
    artifact = make_artifact({"model.gguf": data})
    with HfMirror() as cdn:
        mirror.add_file(
            REPO,
            REVISION,
            "model.gguf",
            data,
            require_token=token,
            redirect_to=cdn,
            cut_after=500_000,
        )
        cdn.entry(REPO, REVISION, "model.gguf").cut_after = 700_000
        job = await pull(tmp_path, PullInput(artifact=artifact))
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert all(r.authorization == f"Bearer {token}" for r in mirror.requests)
        assert cdn.requests and not any(r.has_authorization for r in cdn.requests)
    assert snapshot_bytes(tmp_path, artifact.digest) == data
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


async def test_tampered_cache_hit_fails_closed_without_network(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(12)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    assert (await pull(tmp_path, PullInput(artifact=artifact))).status == JobStatus.SUCCEEDED
    mirror.clear()
    blob = tmp_path / "snapshots" / artifact.digest / "model.gguf"
    blob.chmod(0o644)
    with blob.open("r+b") as handle:
        handle.seek(1000)
        handle.write(b"\x00\x01\x02")
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "cache_corrupt"
    assert mirror.requests == []


async def test_cache_hit_is_a_new_job_with_no_transfer(tmp_path: Path, mirror: HfMirror) -> None:
    data = payload(13)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    first = await pull(tmp_path, PullInput(artifact=artifact))
    mirror.clear()
    second = await pull(tmp_path, PullInput(artifact=artifact))
    assert second.status == JobStatus.SUCCEEDED
    assert second.id != first.id
    assert second.output["cache_hit"] is True
    assert mirror.requests == []


async def test_manual_policy_refuses_a_runtime_miss_and_explicit_overrides(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(14)
    artifact = make_artifact({"model.gguf": data})
    mirror.add_file(REPO, REVISION, "model.gguf", data)
    refused = await pull(
        tmp_path,
        PullInput(artifact=artifact, pull_policy="manual", intent=PullIntent.RUNTIME),
    )
    assert refused.status == JobStatus.FAILED
    assert refused.error is not None
    assert refused.error.code == "manual_artifact_missing"
    assert "sbproxy models pull tiny --variant q4_k_m" in refused.error.message
    assert mirror.requests == []
    explicit = await pull(tmp_path, PullInput(artifact=artifact, pull_policy="manual"))
    assert explicit.status == JobStatus.SUCCEEDED
    # A verified hit satisfies a later runtime need, even with the network off.
    hit = await pull(
        tmp_path,
        PullInput(artifact=artifact, pull_policy="manual", intent=PullIntent.RUNTIME, offline=True),
    )
    assert hit.status == JobStatus.SUCCEEDED
    assert len(mirror.requests) == 1


async def test_offline_miss_is_refused_and_file_sources_still_work(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload(15)
    remote = make_artifact({"model.gguf": data})
    refused = await pull(tmp_path, PullInput(artifact=remote, offline=True))
    assert refused.status == JobStatus.FAILED
    assert refused.error is not None
    assert refused.error.code == "offline_artifact_missing"
    assert mirror.requests == []

    local_dir = tmp_path / "local"
    local_dir.mkdir()
    (local_dir / "model.gguf").write_bytes(data)
    local = make_artifact({"model.gguf": data}, source=f"file:{local_dir}", model="local")
    done = await pull(tmp_path / "cache", PullInput(artifact=local, offline=True))
    assert done.status == JobStatus.SUCCEEDED, done.error
    assert snapshot_bytes(tmp_path / "cache", local.digest) == data


async def test_file_source_refuses_symlinks(tmp_path: Path) -> None:
    data = payload(16, 1000)
    real = tmp_path / "real.gguf"
    real.write_bytes(data)
    local_dir = tmp_path / "src"
    local_dir.mkdir()
    (local_dir / "model.gguf").symlink_to(real)
    artifact = make_artifact({"model.gguf": data}, source=f"file:{local_dir}")
    job = await pull(tmp_path / "cache", PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "invalid_source"
    assert "symbolic link" in job.error.message


async def test_artifacts_sharing_a_blob_download_it_once(tmp_path: Path, mirror: HfMirror) -> None:
    shared = payload(17, 400_000)
    own = payload(18, 1000)
    first = make_artifact({"model.gguf": shared}, model="first")
    second = make_artifact({"model.gguf": shared, "extra.gguf": own}, model="second")
    mirror.add_file(REPO, REVISION, "model.gguf", shared)
    mirror.add_file(REPO, REVISION, "extra.gguf", own)
    assert (await pull(tmp_path, PullInput(artifact=first))).status == JobStatus.SUCCEEDED
    mirror.clear()
    assert (await pull(tmp_path, PullInput(artifact=second))).status == JobStatus.SUCCEEDED
    assert [r.path.rsplit("/", 1)[-1] for r in mirror.requests] == ["extra.gguf"]
    first_file = tmp_path / "snapshots" / first.digest / "model.gguf"
    second_file = tmp_path / "snapshots" / second.digest / "model.gguf"
    assert first_file.samefile(second_file)  # one blob, hard-linked twice


async def test_pickle_needs_opt_in_and_a_clean_scan(tmp_path: Path, mirror: HfMirror) -> None:
    evil = b"cos\nsystem\n(S'echo pwned'\ntR."
    benign = b"ctorch._utils\n_rebuild_tensor_v2\n."
    bad = make_artifact({"weights.bin": evil}, fmt=ArtifactFormat.PICKLE, model="evil")
    good = make_artifact({"weights.bin": benign}, fmt=ArtifactFormat.PICKLE, model="good")
    refused = await pull(tmp_path, PullInput(artifact=good))
    assert refused.status == JobStatus.FAILED
    assert refused.error is not None
    assert refused.error.code == "pickle_refused"
    assert mirror.requests == []

    mirror.add_file(REPO, REVISION, "weights.bin", evil)
    unsafe = await pull(tmp_path, PullInput(artifact=bad, allow_pickle=True))
    assert unsafe.status == JobStatus.FAILED
    assert unsafe.error is not None
    assert unsafe.error.code == "pickle_unsafe"
    assert not (tmp_path / "snapshots" / bad.digest).exists()
    assert blobs(tmp_path) == []

    with HfMirror() as other:
        os.environ["HF_ENDPOINT"] = other.url
        other.add_file(REPO, REVISION, "weights.bin", benign)
        ok = await pull(tmp_path, PullInput(artifact=good, allow_pickle=True))
    assert ok.status == JobStatus.SUCCEEDED, ok.error
    metadata = json.loads((tmp_path / "metadata" / f"{good.digest}.json").read_text())
    assert metadata["pickle_allowed"] is True
    assert metadata["trust"] == "verified"


async def test_import_of_a_wrong_file_over_a_cached_artifact_is_refused(tmp_path: Path) -> None:
    data = payload(19, 5000)
    source = tmp_path / "src"
    source.mkdir()
    (source / "model.gguf").write_bytes(data)
    artifact = make_artifact({"model.gguf": data}, source=f"file:{source}")
    assert (
        await pull(tmp_path / "cache", PullInput(artifact=artifact))
    ).status == JobStatus.SUCCEEDED
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(payload(20, 5000))
    job = await pull(
        tmp_path / "cache", PullInput(artifact=artifact, local_files={"model.gguf": str(wrong)})
    )
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "digest_mismatch"
