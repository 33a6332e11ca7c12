"""SIGKILL of the host in the middle of a warm start, then a restart: the deployment
converges to the committed state, the load job finishes under its original id, and no
engine process survives the crash."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from sbproxy.workflows import process_start_ticks

ROOT = Path(__file__).resolve().parents[3]


def host(root: Path, *, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBPROXY_FAULT")}
    if fault:
        env["SBPROXY_FAULT_POINTS"] = fault
    return subprocess.run(
        [sys.executable, "-m", "tests.model_host.runtime.hostproc", str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def load_jobs(root: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(root / "cache" / "jobs" / "journal.db") as raw:
        return list(raw.execute("SELECT id, status, attempt FROM jobs WHERE kind = 'load'"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        "step:launch:before",
        "engine.spawned",
        "step:launch:after",
        "step:launch:committed",
    ],
)
def test_killed_warm_start_converges_after_restart(tmp_path: Path, fault: str) -> None:
    killed = host(tmp_path, fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ((job_id, status, _),) = load_jobs(tmp_path)
    assert status == "running"
    owned = tmp_path / "cache" / "engines" / "owned"
    orphans = [int(p.name.split("-")[0]) for p in owned.glob("*.json")] if owned.is_dir() else []

    restarted = host(tmp_path)
    assert restarted.returncode == 0, restarted.stderr
    result = json.loads(restarted.stdout.splitlines()[-1])
    assert result["state"] == "ready"
    assert result["job_id"] == job_id
    assert result["job_status"] == "succeeded"
    assert result["request_status"] == 200  # the engine it reports answers
    assert result["live_engines"] == 1  # that one, and no other
    assert load_jobs(tmp_path) == [(job_id, "succeeded", 2)]
    # Engines die with their host; the restarted host reaped what the crash left.
    for pid in orphans:
        assert process_start_ticks(pid) is None
    assert process_start_ticks(result["engine_pid"]) is None  # stopped by the clean shutdown
    if fault != "step:launch:before":
        assert result["generation"] >= 2  # the killed run had taken generation 1


def reload_host(
    root: Path, phase: str, *, fault: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBPROXY_FAULT")}
    if fault:
        env["SBPROXY_FAULT_POINTS"] = fault
    return subprocess.run(
        [sys.executable, "-m", "tests.model_host.runtime.reloadproc", str(root), phase],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def reload_jobs(root: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(root / "cache" / "jobs" / "journal.db") as raw:
        return list(raw.execute("SELECT id, status FROM jobs WHERE kind = 'reload'"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    ["reload.recreate.stopped", "step:rollout:after", "step:rollout:committed", "reload.committed"],
)
def test_killed_recreate_rollout_converges_after_restart(tmp_path: Path, fault: str) -> None:
    killed = reload_host(tmp_path, "apply", fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    before = json.loads(killed.stdout.splitlines()[0])
    ((job_id, status),) = reload_jobs(tmp_path)
    assert status == "running"
    owned = tmp_path / "cache" / "engines" / "owned"
    orphans = [int(p.name.split("-")[0]) for p in owned.glob("*.json")] if owned.is_dir() else []

    restarted = reload_host(tmp_path, "resume")
    assert restarted.returncode == 0, restarted.stderr
    result = json.loads(restarted.stdout.splitlines()[-1])
    # The interrupted reload finished under its original id, on its second attempt.
    assert result["jobs"] == [[job_id, "succeeded", 2]]
    assert result["state"] == "ready"
    assert result["extra_args"] == ["--seed", "7"]  # the committed (edited) definition
    assert result["generation"] > before["generation"]
    assert result["revision"] >= 2
    # No engine of the killed host survives: neither the old generation nor a staged one.
    for pid in {before["engine_pid"], *orphans}:
        assert process_start_ticks(pid) is None
    assert process_start_ticks(result["engine_pid"]) is None  # stopped by the clean shutdown
