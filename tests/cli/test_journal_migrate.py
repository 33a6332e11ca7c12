"""``sbproxy journal migrate --to URL``: a cache's SQLite journal copied into an empty
PostgreSQL journal in one transaction; refused while a job holds a live lease on the source,
and into a target that already holds jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio

from sbproxy.store import Database, ErrorInfo, JobStatus, JobStore, RuntimeStore
from tests.support.journals import fill_varied_journal
from tests.support.postgres import PostgresServer


def migrate(cache: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sbproxy.cli",
            "journal",
            "migrate",
            "--to",
            url,
            "--cache-dir",
            str(cache),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


async def _quiet_journal(path: Path) -> dict[str, str]:
    """A journal no process is running: a succeeded job (two steps), a failed one, a
    queued one, a generation and a committed revision."""
    database = await Database.open(path)
    store = JobStore(database)
    ids = {}
    try:
        for label in ("succeeded", "failed", "queued"):
            ids[label] = (
                await store.submit(kind="pull", workflow_version=1, input_json=f'{{"l":"{label}"}}')
            ).job.id
        for label in ("succeeded", "failed"):
            claimed = await store.claim(owner="w", lease_ms=60_000, job_id=ids[label])
            assert claimed is not None
            await store.begin_step(ids[label], owner="w", attempt=1, seq=0, name="fetch")
            error = ErrorInfo("boom", "it broke") if label == "failed" else None
            await store.end_step(
                ids[label], owner="w", attempt=1, seq=0, name="fetch", output_json="1", error=error
            )
            status = JobStatus.FAILED if error else JobStatus.SUCCEEDED
            await store.finish(ids[label], owner="w", attempt=1, status=status, error=error)
        runtime = RuntimeStore(database)
        await runtime.next_generation("chat")
        await runtime.commit_revision(content_digest="d1", desired={"chat": 1})
    finally:
        await database.close()
    return ids


def test_a_quiet_journal_is_copied_whole(tmp_path: Path, postgres_server: PostgresServer) -> None:
    cache = tmp_path / "cache"
    ids = anyio.run(_quiet_journal, cache / "jobs" / "journal.db")
    url = postgres_server.create_database()

    done = migrate(cache, url.replace("@", ":pw-xyz@"))
    assert done.returncode == 0, done.stderr
    assert "pw-xyz" not in done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["to"] == url
    assert report["rows"]["jobs"] == 3 and report["rows"]["steps"] == 2

    async def check() -> None:
        source = await Database.open(cache / "jobs" / "journal.db")
        target = await Database.open(url)
        try:
            before, after = JobStore(source), JobStore(target)
            for job_id in ids.values():
                old, new = await before.get(job_id), await after.get(job_id)
                assert old is not None and new is not None
                assert new.to_dict() == {**old.to_dict(), "node": new.node}
                assert await after.steps(job_id) == await before.steps(job_id)
                assert await after.events(job_id) == await before.events(job_id)
            # Event numbering goes on after the copied events; the queued job runs here.
            last = max([e.seq for j in ids.values() for e in await after.events(j)])
            claimed = await after.claim(owner="pg", lease_ms=60_000)
            assert claimed is not None and claimed.id == ids["queued"]
            assert (await after.events(ids["queued"]))[-1].seq > last
            revision = await RuntimeStore(target).latest_revision()
            assert revision is not None and dict(revision.desired) == {"chat": 1}
            assert await RuntimeStore(target).next_generation("chat") == 2
        finally:
            await source.close()
            await target.close()

    anyio.run(check)

    again = migrate(cache, url)
    assert again.returncode == 2, again.stderr
    assert "already holds jobs" in again.stderr


def test_a_journal_with_live_leases_is_refused(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    cache = tmp_path / "cache"
    ids = anyio.run(fill_varied_journal, cache / "jobs" / "journal.db")
    url = postgres_server.create_database()
    done = migrate(cache, url)
    assert done.returncode == 2, done.stderr
    assert "is in use" in done.stderr
    assert ids["running_live"] in done.stderr
    # Refused before the target was touched: not even its tables were made.
    assert postgres_server.psql("SELECT to_regclass('jobs') IS NULL", url.rsplit("/", 1)[1]) == "t"
