"""The ``sbproxy jobs`` verbs on a PostgreSQL journal named by ``$SBPROXY_JOURNAL_URL``:
they list, show and cancel its jobs, never print the password, and a server that is gone is
one line, ``journal_unavailable``, exit 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio

from sbproxy.store import Database, JobStore
from tests.support.postgres import PostgresServer


def jobs(url: str, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "jobs", *args, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SBPROXY_JOURNAL_URL": url, "PYTHONWARNINGS": "ignore"},
    )


def _one_queued_job(url: str) -> str:
    async def submit() -> str:
        database = await Database.open(url)
        try:
            store = JobStore(database)
            job = await store.submit(kind="gc", workflow_version=1, input_json="{}")
            return job.job.id
        finally:
            await database.close()

    return anyio.run(submit)


def test_jobs_verbs_read_the_postgres_journal(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    job_id = _one_queued_job(url)
    with_password = url.replace("@", ":pw-xyz@")

    listed = jobs(with_password, tmp_path / "cache", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    payload = json.loads(listed.stdout)
    assert [job["id"] for job in payload["jobs"]] == [job_id]
    assert payload["journal"] == url  # host, port and database; no password
    assert "pw-xyz" not in listed.stdout + listed.stderr
    assert not (tmp_path / "cache" / "jobs" / "journal.db").exists()

    shown = jobs(with_password, tmp_path / "cache", "show", job_id, "--format", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["job"]["status"] == "queued"

    cancelled = jobs(with_password, tmp_path / "cache", "cancel", job_id, "--format", "json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["job"]["status"] == "cancelled"


def test_an_unreachable_postgres_journal_is_exit_2_on_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgresql://sb:pw-xyz@127.0.0.1:{port}/jobs"
    done = jobs(url, tmp_path / "cache", "list")
    assert done.returncode == 2, done.stderr
    assert "pw-xyz" not in done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if "journal" in line]
    assert lines and f"127.0.0.1:{port}" in lines[0]
    assert "Traceback" not in done.stderr
