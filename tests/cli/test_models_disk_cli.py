"""``sbproxy models`` on a full disk, and partial downloads: listed, counted, resumed.

Every verb runs as a real ``sbproxy`` process on a real cache root, against a real local
HF-shaped mirror (``HfMirror``). Full file systems are real tmpfs mounts where this process
may mount (see ``tests/support/small_fs.py``); each such case has a twin that needs no mount.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest

from sbproxy.model_host.artifacts.space import JOURNAL_RESERVE_BYTES
from sbproxy.model_host.flows import PullInput
from sbproxy.store import JobStatus
from sbproxy.workflows import arm, disarm_all
from tests.catalog.builders import COMMIT, document, entry, variant, write
from tests.model_host.artifacts.support import make_artifact, pull
from tests.support.hf_server import HfMirror
from tests.support.small_fs import fill, small_filesystem

ROOT = Path(__file__).resolve().parents[2]
SBPROXY = Path(sys.executable).parent / "sbproxy"
TIMEOUT_S = 90
REPO = "acme/disk-GGUF"
MIB = 1024 * 1024
SMALL = hashlib.shake_256(b"small").digest(300_000)
BIG = hashlib.shake_256(b"big").digest(16 * MIB)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def one_file(name: str, variant_id: str, data: bytes, *, size: int | None = None) -> Any:
    files = [
        {"path": name, "sha256": sha256(data), "size_bytes": len(data) if size is None else size}
    ]
    return entry(variant(variant_id, source=f"hf:{REPO}", files=files, min_memory_bytes=1024))


class Site:
    """A cache root, an operator catalog, and the mirror that serves its files."""

    def __init__(self, tmp: Path, hub: HfMirror, *, colossal_bytes: int = 1) -> None:
        self.tmp = tmp
        self.hub = hub
        self.cache = tmp / "cache"
        models = {
            "small": one_file("small.gguf", "q4_k_m", SMALL),
            "big": one_file("big.gguf", "q8_0", BIG),
            # Declared larger than any disk here: its space check fails before any request.
            "colossal": one_file("colossal.gguf", "q4_k_m", b"never served", size=colossal_bytes),
        }
        self.catalog = write(tmp / "catalog.yaml", document(models=models))

    def env(self, **extra: str) -> dict[str, str]:
        dropped = ("SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "SBPROXY_FAULT_POINTS")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env = {k: v for k, v in env.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
        env["HF_ENDPOINT"] = self.hub.url
        env.update(extra)
        return env

    def argv(self, verb: str, *args: str) -> list[str]:
        catalog = () if verb in ("prune", "partials") else ("--catalog-file", str(self.catalog))
        return [str(SBPROXY), "models", verb, *args, "--cache-dir", str(self.cache), *catalog]

    def run(self, verb: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(verb, *args),
            cwd=ROOT,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )

    def json(self, verb: str, *args: str, code: int = 0) -> dict[str, Any]:
        done = self.run(verb, *args, "--format", "json")
        assert done.returncode == code, done.stdout + done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        payload: dict[str, Any] = json.loads(done.stdout)
        assert payload["schema_version"] == 1
        assert payload["command"] == f"models.{verb}"
        return payload

    def jobs(self) -> list[tuple[str, str, str | None]]:
        with closing(sqlite3.connect(self.cache / "jobs" / "journal.db")) as raw:
            return list(raw.execute("SELECT id, status, error_code FROM jobs ORDER BY id"))

    def gets(self, path: str) -> list[tuple[int, int | None]]:
        return [
            (r.status, r.range_start)
            for r in self.hub.requests
            if r.method == "GET" and r.file == path
        ]

    def partial_dir(self) -> Path:
        (directory,) = (self.cache / "partials").iterdir()
        return directory


@pytest.fixture
def hub() -> Iterator[HfMirror]:
    with HfMirror() as mirror:
        mirror.add_file(REPO, COMMIT, "small.gguf", SMALL)
        mirror.add_file(REPO, COMMIT, "big.gguf", BIG)
        yield mirror


def disk_full_line(stderr: str) -> str:
    """The one stderr line that reports the failure (the others are the job's events)."""
    lines = [line for line in stderr.splitlines() if line.startswith("sbproxy models pull:")]
    assert len(lines) == 1, stderr
    return lines[0]


# --- the cache file system ------------------------------------------------------------------


def test_pull_into_a_nearly_full_cache_fails_with_one_line_and_the_figures(
    tmp_path: Path, hub: HfMirror
) -> None:
    site = Site(tmp_path, hub)
    with small_filesystem(site.cache, size_bytes=32 * MIB):
        fill(site.cache, leave_bytes=8 * MIB)
        needed = len(BIG) + JOURNAL_RESERVE_BYTES
        text = site.run("pull", "big")
        assert text.returncode == 1, text.stderr
        assert "Traceback" not in text.stderr
        line = disk_full_line(text.stderr)
        assert "failed (job " in line
        assert ": disk_full: " in line
        assert f"not enough space on the file system of {site.cache / 'partials'}" in line
        assert f"needs {needed} more bytes, " in line
        assert "bytes are free" in line

        payload = site.json("pull", "big", code=1)
        (row,) = payload["artifacts"]
        assert row["error"]["code"] == "disk_full"
        assert f"needs {needed} more bytes, " in row["error"]["message"]
        assert row["snapshot_path"] is None
        assert [status for _, status, _ in site.jobs()] == ["failed", "failed"]
        assert site.gets("big.gguf") == []  # refused before the first request


def test_a_pull_larger_than_the_disk_fails_fast_everywhere(tmp_path: Path, hub: HfMirror) -> None:
    """No mount needed: the catalog declares a file larger than this disk's free space."""
    colossal = shutil.disk_usage(tmp_path).free * 2
    site = Site(tmp_path, hub, colossal_bytes=colossal)
    text = site.run("pull", "colossal")
    assert text.returncode == 1
    assert "Traceback" not in text.stderr
    line = disk_full_line(text.stderr)
    assert ": disk_full: " in line
    assert f"needs {colossal + JOURNAL_RESERVE_BYTES} more bytes, " in line
    payload = site.json("pull", "colossal", code=1)
    assert payload["artifacts"][0]["error"]["code"] == "disk_full"
    assert hub.requests == []
    assert [(status, code) for _, status, code in site.jobs()] == [("failed", "disk_full")] * 2


# --- the journal's file system ----------------------------------------------------------------


def test_a_full_journal_file_system_is_a_clean_error_and_the_job_resumes_later(
    tmp_path: Path, hub: HfMirror
) -> None:
    """The journal alone on a real 1 MiB tmpfs (``<cache>/jobs``), filled mid-download."""
    site = Site(tmp_path, hub)
    hub.entry(REPO, COMMIT, "big.gguf").throttle_bps = 4 * MIB
    jobs_dir = site.cache / "jobs"
    with small_filesystem(jobs_dir, size_bytes=MIB):
        process = subprocess.Popen(
            site.argv("pull", "big", "--format", "json"),
            cwd=ROOT,
            env=site.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not any(p.stat().st_size > 2 * MIB for p in site.cache.glob("partials/*/*.part")):
                assert process.poll() is None and time.monotonic() < deadline, "no download"
                time.sleep(0.02)
            filler = fill(jobs_dir)
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 1, stdout + stderr
        assert "Traceback" not in stderr
        payload = json.loads(stdout)
        assert payload["ok"] is False
        error = payload["error"]
        journal = str(jobs_dir / "journal.db")
        assert error["code"] == "disk_full"
        assert error["path"] == journal
        assert error["needed_bytes"] == 4096
        assert isinstance(error["free_bytes"], int)
        assert "e3q8" not in stdout + stderr
        line = disk_full_line(stderr)
        assert f"the job journal {journal} cannot be written" in line
        (job_id, status, code) = site.jobs()[0]
        assert (status, code) == ("running", None)  # resumable: nothing could be recorded

        filler.unlink()
        parts = list(site.cache.glob("partials/*/big.gguf.part"))
        kept = parts[0].stat().st_size if parts else None
        hub.clear()
        payload = site.json("pull", "big")
        (row,) = payload["artifacts"]
        assert row["job_id"] == job_id
        assert row["error"] is None
        assert site.jobs() == [(job_id, "succeeded", None)]
        if kept is not None:  # the download had not finished when the journal filled
            assert site.gets("big.gguf") == [(206, kept)]


# --- partial downloads: listed, counted, resumed --------------------------------------------


def test_a_killed_pull_is_listed_counted_and_resumed_from_its_length(
    tmp_path: Path, hub: HfMirror
) -> None:
    site = Site(tmp_path, hub)
    small = site.json("pull", "small")["artifacts"][0]
    # Killed at its 4th body write, long before its first timed checkpoint (2 s): the resume
    # state still counts 0 durable bytes, the file holds three blocks.
    killed = site.run("pull", "big", "--format", "json", SBPROXY_FAULT_POINTS="download.write=4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    job_id = next(job for job, status, _ in site.jobs() if status == "running")
    directory = site.partial_dir()
    part = directory / "big.gguf.part"
    held = part.stat().st_size
    state = json.loads((directory / "big.gguf.part.resume.json").read_text())
    assert state["completed_bytes"] == 0 < held < len(BIG)
    partial_bytes = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

    listing = site.json("partials")
    assert listing["total_bytes"] == partial_bytes
    assert listing["partials"] == [
        {
            "artifact_digest": directory.name,
            "model": "big",
            "variant": "q8_0",
            "bytes": partial_bytes,
            "owned": True,
            "job_id": job_id,
            "job_status": "running",
            "job_owner_alive": False,
            "files": [{"path": "big.gguf", "bytes": held, "expected_bytes": len(BIG)}],
        }
    ]
    text = site.run("partials")
    assert text.returncode == 0, text.stderr
    assert f"big:q8_0 sha256:{directory.name}" in text.stdout
    assert f"job {job_id} running, its process is gone (the next pull resumes it)" in text.stdout
    assert f"  big.gguf: {held} of {len(BIG)} bytes" in text.stdout

    blobs = len(SMALL)
    preview = site.json("prune", "--dry-run")
    assert (preview["before_bytes"], preview["reclaimed_bytes"]) == (blobs + partial_bytes, 0)
    assert preview["abandoned_partials"] == 0  # its pull is unfinished: kept
    # A budget that holds the partial but not the partial and the small artifact together:
    # gc counts the partial, so it collects the small artifact to stay in budget.
    budget = partial_bytes + blobs // 2
    report = site.json("gc", "--budget-gib", f"{(budget + 1) / 2**30:.15f}")
    assert report["before_bytes"] == blobs + partial_bytes
    assert report["deleted_artifacts"] == [small["artifact_digest"]]
    assert report["after_bytes"] == partial_bytes
    assert report["budget_unsatisfied_bytes"] == 0
    assert part.stat().st_size == held  # the owned partial is kept

    hub.clear()
    resumed = site.json("pull", "big")["artifacts"][0]
    assert resumed["job_id"] == job_id
    assert resumed["error"] is None
    assert site.gets("big.gguf") == [(206, held)]
    assert Path(resumed["snapshot_path"], "big.gguf").read_bytes() == BIG
    assert site.json("partials") == {
        "schema_version": 1,
        "command": "models.partials",
        "cache_root": str(site.cache),
        "total_bytes": 0,
        "partials": [],
    }
    assert site.run("partials").stdout.strip() == f"no partial downloads in {site.cache}"


def test_remove_stale_takes_a_killed_pulls_partial_and_refuses_a_live_one(
    tmp_path: Path, hub: HfMirror
) -> None:
    """A real pull process: alive, ``models remove --stale`` refuses it; SIGKILLed, its
    stale job is cancelled for good and its partial deleted; the next pull starts afresh."""
    site = Site(tmp_path, hub)
    hub.entry(REPO, COMMIT, "big.gguf").throttle_bps = MIB  # 16 s for the whole file
    live = subprocess.Popen(
        site.argv("pull", "big", "--format", "json"),
        cwd=ROOT,
        env=site.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(p.stat().st_size > 0 for p in site.cache.glob("partials/*/big.gguf.part")):
            assert live.poll() is None and time.monotonic() < deadline, "no download"
            time.sleep(0.02)
        (job_id,) = [job for job, status, _ in site.jobs() if status == "running"]

        refused = site.json("remove", "big", "--stale", code=2)["error"]
        assert (refused["code"], refused["reason"]) == ("removal_blocked", "running")
        assert (
            f"its pull job {job_id} is running in the live process {live.pid}" in (refused["error"])
        )
        assert "--stale takes only a pull whose process is gone" in refused["error"]
        assert live.poll() is None  # untouched: still downloading
        assert site.partial_dir().is_dir()
    finally:
        live.kill()  # SIGKILL: no cleanup, the job stays running under a dead owner
        live.wait()
    assert live.returncode == -signal.SIGKILL
    directory = site.partial_dir()
    held = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    assert held > 0
    assert (job_id, "running", None) in site.jobs()

    # Without --stale the removal still refuses, and says what --stale would do.
    plain = site.json("remove", "big", code=2)["error"]
    assert plain["reason"] == "running"
    assert f"was left running by process {live.pid}, which is gone (stale)" in plain["error"]
    assert "sbproxy models remove big --variant q8_0 --stale" in plain["remediation"]
    listed = site.run("partials").stdout
    assert "`sbproxy models remove big --variant q8_0 --stale` cancels it" in listed

    removed = site.json("remove", "big", "--stale")
    assert removed["cancelled_pulls"] == [job_id]
    assert (removed["removed"], removed["reclaimed_bytes"]) == (False, held)
    assert not directory.exists()
    assert (job_id, "cancelled", None) in site.jobs()
    assert site.json("partials")["partials"] == []
    text = site.run("remove", "big", "--stale").stdout.strip()
    assert text == "big is not cached"  # idempotent

    # Cancelled is final: the next pull is a new job, from byte 0, and completes.
    hub.entry(REPO, COMMIT, "big.gguf").throttle_bps = None
    hub.clear()
    (row,) = site.json("pull", "big")["artifacts"]
    assert row["error"] is None and row["job_id"] != job_id
    assert site.gets("big.gguf") == [(200, None)]
    assert Path(row["snapshot_path"], "big.gguf").read_bytes() == BIG
    assert (job_id, "cancelled", None) in site.jobs()


def test_an_abandoned_partial_is_listed_without_an_owner_and_pruned(
    tmp_path: Path, hub: HfMirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull that failed (here a full disk, injected) leaves a partial no job owns."""
    site = Site(tmp_path, hub)
    artifact = make_artifact({"big.gguf": BIG}, source=f"hf:{REPO}", revision=COMMIT, model="big")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    part = site.cache / "partials" / artifact.digest / "big.gguf.part"

    def no_space() -> None:
        if part.stat().st_size <= 3 * MIB:
            arm("download.write", action=no_space)
            return
        raise OSError(28, "No space left on device")

    arm("download.write", action=no_space)
    try:
        failed = anyio.run(pull, site.cache, PullInput(artifact=artifact))
    finally:
        disarm_all()
    assert failed.status == JobStatus.FAILED
    assert failed.error is not None and failed.error.code == "disk_full"
    partial_bytes = sum(p.stat().st_size for p in part.parent.rglob("*") if p.is_file())

    (entry_,) = site.json("partials")["partials"]
    assert entry_["owned"] is False
    assert (entry_["job_id"], entry_["job_status"]) == (failed.id, "failed")
    assert entry_["job_owner_alive"] is None
    assert entry_["bytes"] == partial_bytes
    text = site.run("partials").stdout
    assert f"job {failed.id} failed (abandoned: prune or gc deletes it" in text

    preview = site.json("prune", "--dry-run")
    assert preview["abandoned_partials"] == 1
    assert preview["reclaimed_bytes"] == partial_bytes
    pruned = site.json("prune")
    assert (pruned["before_bytes"], pruned["reclaimed_bytes"]) == (partial_bytes, partial_bytes)
    assert site.json("partials")["partials"] == []
