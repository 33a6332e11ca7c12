"""Stale jobs in ``sbproxy jobs``: a running job whose owner died or whose lease lapsed is
marked stale by ``list`` and ``show`` (text and JSON: its age, why, last step, owner, and what
resumes it), and ``watch`` says so instead of waiting silently, then follows the resumed run.

The owner is really dead: a ``tests.cli.jobflows`` process SIGKILLed at a fault point. The
lapsed lease is stamped on another boot's clock, so no test waits for time to pass.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import anyio
import pytest

from sbproxy.store import Database, JobStore, LeaseTime
from sbproxy.workflows import WorkerIdentity
from tests.cli.test_jobs_cli import (
    ROOT,
    SBPROXY,
    TIMEOUT_S,
    Cache,
    clean_env,
    drain,
    envelope,
    job_id_of,
    lines_of,
    popen,
)

BY_SERVER = "resumed by a running `sbproxy serve` on this cache"


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    return Cache(tmp_path / "cache")


def killed_in_publish(cache: Cache) -> str:
    """A ``slow-download`` job whose process was SIGKILLed as its ``publish`` step began."""
    doomed = {**clean_env(), "SBPROXY_FAULT_POINTS": "step:publish:before"}
    done = subprocess.run(
        cache.flow_command("run", "slow-download", str(cache.workdir)),
        cwd=ROOT,
        env=doomed,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return job_id_of(done.stdout.splitlines()[0])


def test_list_and_show_mark_a_job_whose_owner_died_as_stale(cache: Cache) -> None:
    job_id = killed_in_publish(cache)

    listed = cache.jobs("list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    (job,) = envelope(listed.stdout, "jobs.list")["jobs"]
    assert job["status"] == "running"
    stale = job["stale"]
    assert stale["age_ms"] >= 0
    assert {k: v for k, v in stale.items() if k != "age_ms"} == {
        "reason": "owner_gone",
        "owner": job["lease_owner"],
        "last_step": {"seq": 2, "name": "publish", "status": "running", "attempts": 1},
        "resume": BY_SERVER,
    }
    owner = job["lease_owner"]

    text = cache.invoke("list").stdout.splitlines()
    (row,) = [line for line in text if line.startswith(job_id)]
    assert "running (stale)" in row
    note = f"stale {job_id} (slow-download): silent for "
    (line,) = [line for line in text if line.startswith(note)]
    assert line.endswith(
        f": its owner {owner} is gone; last step publish (#2, running); {BY_SERVER}"
    )

    shown = envelope(cache.jobs("show", job_id, "--format", "json").stdout, "jobs.show")
    assert shown["job"]["stale"] == {**stale, "age_ms": shown["job"]["stale"]["age_ms"]}
    lines = cache.invoke("show", job_id).stdout.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("  stale      ")]
    assert re.fullmatch(
        rf"  stale      silent for \S+: its owner {re.escape(owner)} is gone; "
        r"last step publish \(#2, running\)",
        lines[at],
    )
    assert lines[at + 1] == f"             {BY_SERVER}"

    # Resumed, it is an ordinary job again.
    cache.flow("resume", job_id)
    (job,) = envelope(cache.jobs("list", "--format", "json").stdout, "jobs.list")["jobs"]
    assert (job["status"], job["stale"]) == ("succeeded", None)
    assert "stale" not in cache.invoke("list").stdout


def test_a_lapsed_lease_is_stale_though_its_owner_cannot_be_proven_dead(cache: Cache) -> None:
    async def setup() -> tuple[str, str]:
        database = await Database.open(cache.journal)
        try:
            # Renewed on another boot's clock: lapsed for this one, whatever the time.
            before_reboot = JobStore(database, lease_clock=lambda: LeaseTime("old-boot", 1_000))
            lapsed = await before_reboot.submit(
                kind="pull", workflow_version=1, input_json="{}", subject="artifact:sha256:ab"
            )
            # An owner on an unknown boot is never proven dead: only the lease says stale.
            claimed = await before_reboot.claim(
                owner="unknown-boot/1/1/gone", lease_ms=60_000, job_id=lapsed.job.id
            )
            assert claimed is not None
            live = await JobStore(database).submit(kind="gc", workflow_version=1, input_json="{}")
            held = await JobStore(database).claim(
                owner=WorkerIdentity.current().owner, lease_ms=600_000, job_id=live.job.id
            )
            assert held is not None
            return lapsed.job.id, live.job.id
        finally:
            await database.close()

    lapsed_id, live_id = anyio.run(setup)
    listed = cache.invoke("list", "--format", "json")
    assert listed.exit_code == 0, listed.stderr
    jobs = {job["id"]: job for job in envelope(listed.stdout, "jobs.list")["jobs"]}
    assert jobs[live_id]["stale"] is None  # a live owner under a live lease
    stale = jobs[lapsed_id]["stale"]
    assert (stale["reason"], stale["owner"], stale["last_step"]) == (
        "lease_expired",
        "unknown-boot/1/1/gone",
        None,
    )
    assert stale["resume"] == (
        "resumed by the next `sbproxy models pull` (or `models import`) of this artifact "
        "or by a running `sbproxy serve` on this cache"
    )
    text = cache.invoke("list").stdout
    assert (
        f"stale {lapsed_id} (pull): silent for " in text
        and ": the lease of unknown-boot/1/1/gone lapsed; no step begun; resumed by the next"
        in text
    )
    assert f"stale {live_id}" not in text


def test_watch_says_a_stale_job_is_stale_and_follows_the_run_that_resumes_it(
    cache: Cache,
) -> None:
    job_id = killed_in_publish(cache)
    watch_command = [str(SBPROXY), "jobs", "watch", job_id, "--cache-dir", str(cache.root)]
    with popen(watch_command) as watch:
        try:
            assert watch.stderr is not None and watch.stdout is not None
            stderr = lines_of(watch.stderr)
            seen: list[str] = []
            while not (seen and ": stale, " in seen[-1]):
                line = stderr.get(timeout=TIMEOUT_S)
                assert line is not None, seen  # the watch ended without saying anything
                seen.append(line)
            notice = seen[-1]
            cache.flow("resume", job_id)  # what the notice says will resume it
            rest = list(drain(stderr))
            stdout = watch.stdout.read()
            assert watch.wait(timeout=TIMEOUT_S) == 0, rest
        finally:
            watch.kill()
    # The backlog first (the killed run up to its publish step), then the notice, once.
    assert f"{job_id}: step publish started" in seen[:-1]
    assert re.fullmatch(
        rf"{job_id}: stale, silent for \S+: its owner \S+ is gone; last step publish "
        rf"\(#2, running\); {re.escape(BY_SERVER)} \(still watching\)",
        notice,
    )
    assert not any(": stale, " in line for line in rest)
    assert f"{job_id}: queued (owner_gone)" in rest
    assert rest[-1] == f"{job_id}: succeeded"
    assert stdout.startswith(f"{job_id}: succeeded")
