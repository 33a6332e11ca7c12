"""A full disk, anywhere, is a clean ``disk_full``; a pull resumes from its partial's length.

The cache's file system: a pull checks for room before it downloads (sizes less what the
partials hold, plus the journal's reserve) and a disk that fills meanwhile fails the job with
the path, the bytes needed and the bytes free, keeping the partial for the next pull. The
journal's: a write SQLite cannot make is ``disk_full`` (never the driver's own code) and the
job stays resumable. Each runs on a real small tmpfs where this process may mount one, and
with the same failure injected (a fault point raising ``ENOSPC``, SQLite's "database or disk
is full" raised under the driver) everywhere.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest

from sbproxy.catalog import ArtifactFile, ArtifactFormat, EngineKind, ResolvedArtifact, Stability
from sbproxy.catalog import artifact_digest as compute_digest
from sbproxy.errors import sole_error
from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.artifacts.space import JOURNAL_RESERVE_BYTES
from sbproxy.model_host.flows import PullInput, pull_workflow
from sbproxy.model_host.flows.pull import FileTask, bytes_to_fetch
from sbproxy.store import JobStatus
from sbproxy.workflows import arm, disarm_all
from tests.model_host.artifacts.support import REPO, REVISION, make_artifact, pull, pull_engine
from tests.support.hf_server import HfMirror
from tests.support.journal_faults import JournalFull
from tests.support.small_fs import fill, small_filesystem

pytestmark = pytest.mark.anyio

MIB = 1024 * 1024
FILE = "model.gguf"


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    disarm_all()
    yield
    disarm_all()


def payload(seed: str, size: int) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(size)


def gets(mirror: HfMirror) -> list[tuple[int, int | None]]:
    return [(r.status, r.range_start) for r in mirror.requests if r.method == "GET"]


def part_of(root: Path, artifact: ResolvedArtifact, path: str = FILE) -> Path:
    return root / "partials" / artifact.digest / f"{path}.part"


def url_of(mirror: HfMirror, path: str = FILE) -> str:
    return f"{mirror.url}/{REPO}/resolve/{REVISION}/{path}"


def write_partial(
    mirror: HfMirror, part: Path, data: bytes, *, completed: int, size: int, sha256: str
) -> None:
    """A partial holding ``data`` whose resume state counts ``completed`` bytes durable."""
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(data)
    state = {
        "schema_version": 1,
        "url": url_of(mirror),
        "etag": mirror.entry(REPO, REVISION, FILE).etag,
        "expected_sha256": sha256,
        "expected_size": size,
        "completed_bytes": completed,
    }
    part.with_name(f"{FILE}.part.resume.json").write_text(json.dumps(state))


def declared_artifact(size: int) -> ResolvedArtifact:
    """An artifact whose one file the catalog says is ``size`` bytes (nothing serves it)."""
    fields: dict[str, Any] = {
        "catalog_revision": "test-1",
        "logical_model": "huge",
        "variant_id": "q4_k_m",
        "format": ArtifactFormat.GGUF,
        "quant": "Q4_K_M",
        "source": f"hf:{REPO}",
        "revision": REVISION,
        "files": (ArtifactFile(path=FILE, sha256="ab" * 32, size_bytes=size),),
    }
    return ResolvedArtifact(
        **fields,
        digest=compute_digest(**fields),
        engine=EngineKind.LLAMA_CPP,
        stability=Stability.PREVIEW,
        context_length=2048,
        min_memory_bytes=1,
    )


def fail_past(part: Path, threshold: int) -> None:
    """Arm ``download.write`` to raise ``ENOSPC`` once ``part`` holds more than ``threshold``
    bytes (it re-arms itself until then)."""

    def check() -> None:
        if part.stat().st_size <= threshold:
            arm("download.write", action=check)
            return
        raise OSError(errno.ENOSPC, "No space left on device")

    arm("download.write", action=check)


def figure(pattern: str, text: str) -> int:
    """The integer ``pattern``'s one group finds in ``text`` (which must match)."""
    found = re.search(pattern, text)
    assert found is not None, text
    return int(found[1])


def jobs_in(root: Path) -> list[tuple[str, str, str | None]]:
    with closing(sqlite3.connect(root / "jobs" / "journal.db")) as raw:
        return list(raw.execute("SELECT id, status, error_code FROM jobs ORDER BY id"))


# --- the space check before a download ---------------------------------------------------


async def test_a_pull_larger_than_the_free_space_fails_before_downloading(
    tmp_path: Path, mirror: HfMirror
) -> None:
    # Twice the free space and a GiB more: other tests share this file system and may free
    # space between this look and the pull's own (seen in CI: free + 1 then fitted).
    size = 2 * shutil.disk_usage(tmp_path).free + 2**30
    artifact = declared_artifact(size)
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "disk_full"
    message = job.error.message
    needed = size + JOURNAL_RESERVE_BYTES
    assert f"not enough space on the file system of {tmp_path / 'partials'}" in message
    assert f"pulling huge:q4_k_m (with {JOURNAL_RESERVE_BYTES} kept free" in message
    free = figure(rf"needs {needed} more bytes, (\d+) bytes are free", message)
    assert 0 < free < needed
    assert mirror.requests == []  # nothing was asked for, nothing written
    assert not (tmp_path / "partials" / artifact.digest).exists()


def test_the_bytes_to_fetch_are_the_sizes_less_what_partials_hold(tmp_path: Path) -> None:
    cache = ArtifactCache(CacheLayout(root=tmp_path))
    tasks = tuple(
        FileTask(digest="d" * 64, path=path, sha256="0" * 64, size_bytes=size)
        for path, size in (("a.gguf", 1000), ("sub/b.gguf", 500))
    )
    assert bytes_to_fetch(cache, tasks) == 1500
    part = cache.partial("d" * 64, "sub/b.gguf")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x" * 200)
    assert bytes_to_fetch(cache, tasks) == 1300
    part.write_bytes(b"x" * 900)  # more than the file: never counts as more than its size
    assert bytes_to_fetch(cache, tasks) == 1000


async def test_the_space_check_counts_what_the_partial_already_holds(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """8 MiB on a 12 MiB file system already holding 6 MiB of it (from a pull killed before
    its first timed checkpoint): the 2 MiB left fit, and only they are fetched."""
    data = payload("counted", 8 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data)
    with small_filesystem(tmp_path / "cache", size_bytes=12 * MIB) as root:
        kept = 6 * MIB
        write_partial(
            mirror,
            part_of(root, artifact),
            data[:kept],
            completed=0,
            size=len(data),
            sha256=artifact.files[0].sha256,
        )
        assert shutil.disk_usage(root).free < len(data) + JOURNAL_RESERVE_BYTES
        job = await pull(root, PullInput(artifact=artifact))
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert gets(mirror) == [(206, kept)]
        assert (root / "snapshots" / artifact.digest / FILE).read_bytes() == data


# --- a disk that fills while the download runs -------------------------------------------


async def test_a_disk_that_fills_mid_download_fails_the_job_and_the_next_pull_resumes(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """Another writer takes every free byte of a real 16 MiB tmpfs during a 10 MiB download."""
    data = payload("fills", 10 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data, throttle_bps=4 * MIB)
    with small_filesystem(tmp_path / "cache", size_bytes=16 * MIB) as root:
        part = part_of(root, artifact)
        filler: list[Path] = []

        def take_the_rest() -> None:
            if part.stat().st_size <= 3 * MIB:
                arm("download.write", action=take_the_rest)
                return
            filler.append(fill(root))

        arm("download.write", action=take_the_rest)
        failed = await pull(root, PullInput(artifact=artifact))
        assert filler, "the disk was never filled"
        assert failed.status == JobStatus.FAILED  # the journal had room to record it
        assert failed.error is not None
        assert failed.error.code == "disk_full"
        assert f"not enough space on the file system of {part}" in failed.error.message
        assert re.search(
            r"downloading model\.gguf needs \d+ more bytes, \d+ bytes are free",
            failed.error.message,
        )
        assert "Traceback" not in failed.error.message
        kept = part.stat().st_size
        assert 2 * MIB < kept < len(data)  # what arrived, less the journal's megabyte
        assert f"the partial download keeps {kept} bytes" in failed.error.message

        filler[0].unlink()
        mirror.clear()
        retried = await pull(root, PullInput(artifact=artifact))
        assert retried.status == JobStatus.SUCCEEDED, retried.error
        assert gets(mirror) == [(206, kept)]
        assert (root / "snapshots" / artifact.digest / FILE).read_bytes() == data


async def test_an_injected_enospc_mid_download_keeps_the_partial_for_the_next_pull(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """The same as on a real full disk, with the write failing by a fault point."""
    data = payload("injected", 6 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data)
    part = part_of(tmp_path, artifact)
    fail_past(part, 3 * MIB)
    failed = await pull(tmp_path, PullInput(artifact=artifact))
    assert failed.status == JobStatus.FAILED
    assert failed.error is not None
    assert failed.error.code == "disk_full"
    kept = part.stat().st_size
    assert 2 * MIB < kept < len(data) - JOURNAL_RESERVE_BYTES
    message = failed.error.message
    needed = figure(r"downloading model\.gguf needs (\d+) more bytes", message)
    assert needed == len(data) - kept - JOURNAL_RESERVE_BYTES  # measured before the release
    assert [row[1:] for row in jobs_in(tmp_path)] == [("failed", "disk_full")]

    disarm_all()
    mirror.clear()
    retried = await pull(tmp_path, PullInput(artifact=artifact))
    assert retried.status == JobStatus.SUCCEEDED, retried.error
    assert gets(mirror) == [(206, kept)]


# --- the journal's file system -------------------------------------------------------------


async def test_a_full_journal_fails_with_our_code_and_leaves_the_job_resumable(
    tmp_path: Path, mirror: HfMirror
) -> None:
    data = payload("journal", 8 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data, throttle_bps=2 * MIB)
    part = part_of(tmp_path, artifact)
    async with pull_engine(tmp_path) as (engine, _):
        journal = JournalFull(engine.store)

        def journal_fills() -> None:
            if part.stat().st_size <= 3 * MIB:
                arm("download.write", action=journal_fills)
                return
            journal.on = True

        arm("download.write", action=journal_fills)
        submitted = await engine.submit(
            pull_workflow, PullInput(artifact=artifact), idempotency_key=artifact.digest
        )
        with pytest.raises(Exception) as raised:  # an ExceptionGroup or the error itself
            await engine.join(submitted.job.id)
        error = sole_error(raised.value)
        assert error is not None, raised.value
        assert error.code == "disk_full"
        assert error.details["path"] == str(tmp_path / "jobs" / "journal.db")
        assert error.details["needed_bytes"] == 4096
        assert isinstance(error.details["free_bytes"], int)
        assert "e3q8" not in str(error)
        assert journal.failures > 0
    # Nothing of the failure could be recorded: the job is still running, to resume. The
    # partial (on the journal's file system) gave its last MiB back for the journal.
    assert jobs_in(tmp_path) == [(submitted.job.id, "running", None)]
    kept = part.stat().st_size
    assert 0 < kept < len(data) - 2 * MIB

    disarm_all()
    mirror.clear()
    async with pull_engine(tmp_path) as (engine, _):
        # This process still "owns" it: its lease lapses (5 s here) and it is taken over.
        with anyio.fail_after(30):
            finished = await engine.join(submitted.job.id)
    assert finished.status == JobStatus.SUCCEEDED, finished.error
    assert finished.attempt == 2
    assert gets(mirror) == [(206, kept)]


# --- resuming from the partial ---------------------------------------------------------------


async def test_a_partial_past_its_last_checkpoint_resumes_from_its_length(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """Killed before its first timed checkpoint: the state says 0 bytes, the file holds more."""
    data = payload("unsynced", 3 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data)
    held = 1_234_567
    write_partial(
        mirror,
        part_of(tmp_path, artifact),
        data[:held],
        completed=0,
        size=len(data),
        sha256=artifact.files[0].sha256,
    )
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert gets(mirror) == [(206, held)]
    assert job.output["transferred_bytes"] == len(data) - held
    assert (tmp_path / "snapshots" / artifact.digest / FILE).read_bytes() == data


async def test_a_partial_with_wrong_bytes_is_caught_at_the_end_and_refetched(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """Unsynced bytes a power loss left wrong: the final SHA-256 refuses, the file is refetched
    from 0 once, and only the right bytes are published."""
    data = payload("wrong", 3 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data)
    held = 2 * MIB
    damaged = bytearray(data[:held])
    damaged[held - 10 : held] = bytes(10)
    write_partial(
        mirror,
        part_of(tmp_path, artifact),
        bytes(damaged),
        completed=MIB,
        size=len(data),
        sha256=artifact.files[0].sha256,
    )
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.SUCCEEDED, job.error
    assert gets(mirror) == [(206, held), (200, None)]
    assert (tmp_path / "snapshots" / artifact.digest / FILE).read_bytes() == data


async def test_wrong_bytes_from_byte_zero_are_still_a_digest_mismatch(
    tmp_path: Path, mirror: HfMirror
) -> None:
    """A resumed download whose refetch is wrong too ends ``digest_mismatch``: no loop."""
    data = payload("upstream", 2 * MIB)
    artifact = make_artifact({FILE: data})
    mirror.add_file(REPO, REVISION, FILE, data, wrong_bytes=True)
    write_partial(
        mirror,
        part_of(tmp_path, artifact),
        data[:MIB],
        completed=0,
        size=len(data),
        sha256=artifact.files[0].sha256,
    )
    job = await pull(tmp_path, PullInput(artifact=artifact))
    assert job.status == JobStatus.FAILED
    assert job.error is not None
    assert job.error.code == "digest_mismatch"
    assert gets(mirror) == [(206, MIB), (200, None)]
    assert not part_of(tmp_path, artifact).exists()
