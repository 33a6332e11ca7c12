"""Crash test: SIGKILL at every step boundary, restart, and the same job finishes correctly.

The boundaries of each step: ``before`` it runs, ``after`` its side effect (output not yet
journaled) and ``committed`` (output journaled, next step not begun).

A job whose process dies at the same point on every run is recovered a bounded number of
times, then ends ``failed`` (``recovery_exhausted``) instead of being retried forever; an
operator's ``sbproxy jobs retry`` revives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sbproxy.workflows import DEFAULT_MAX_RECOVERIES

ROOT = Path(__file__).resolve().parents[2]
SBPROXY = Path(sys.executable).parent / "sbproxy"


def run_flow(
    tmp: Path, *, fault: str | None = None, journal: Path | str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SBPROXY_FAULT_POINTS"}
    if fault:
        env["SBPROXY_FAULT_POINTS"] = fault
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.workflows.crashflow",
            str(journal or tmp / "journal.db"),
            str(tmp / "effects"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def job_id_of(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if line.startswith("job "))
    return line.split()[1]


def final_job(stdout: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(stdout.splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("clean")
    done = run_flow(tmp)
    assert done.returncode == 0, done.stderr
    effects = Counter((tmp / "effects").read_text().split())
    assert effects == Counter({f"s{i}": 1 for i in range(1, 6)})
    return final_job(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after", "committed"])
@pytest.mark.parametrize("index", [1, 2, 3, 4, 5])
def test_job_survives_sigkill_at_every_step_boundary(
    tmp_path: Path,
    journal_location: Path | str,
    uninterrupted: dict[str, Any],
    index: int,
    when: str,
) -> None:
    killed = run_flow(tmp_path, fault=f"step:s{index}:{when}", journal=journal_location)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first_id = job_id_of(killed.stdout)

    resumed = run_flow(tmp_path, journal=journal_location)
    assert resumed.returncode == 0, resumed.stderr
    assert job_id_of(resumed.stdout) == first_id
    job = final_job(resumed.stdout)
    assert job["id"] == first_id
    assert job["status"] == "succeeded"
    assert job["output"] == uninterrupted["output"]
    assert job["attempt"] == 2

    effects = Counter((tmp_path / "effects").read_text().split())
    for step_index in range(1, 6):
        expected = 1
        if step_index == index and when == "after":
            expected = 2  # the side effect happened, its output was not yet journaled
        # "committed": the output was journaled, so the resumed run replays it (once).
        assert effects[f"s{step_index}"] == expected, (step_index, effects)


@pytest.mark.slow
def test_a_job_that_kills_its_process_every_time_ends_recovery_exhausted_until_retried(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    cache = tmp_path / "cache"
    journal = cache / "jobs" / "journal.db"
    # The first run and each of the recoveries the engine allows die in s3, before its
    # side effect: no step completes after s2, so the count is never reset.
    for _ in range(1 + DEFAULT_MAX_RECOVERIES):
        killed = run_flow(tmp_path, fault="step:s3:before", journal=journal)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    job_id = job_id_of(killed.stdout)

    # The next process, still armed to die there, is refused a fourth recovery: it ends the
    # job instead of running it, and lives.
    ended = run_flow(tmp_path, fault="step:s3:before", journal=journal)
    assert ended.returncode == 0, ended.stderr
    job = final_job(ended.stdout)
    assert (job["id"], job["status"], job["attempt"], job["recoveries"]) == (
        job_id,
        "failed",
        1 + DEFAULT_MAX_RECOVERIES,
        DEFAULT_MAX_RECOVERIES,
    )
    assert job["error"]["code"] == "recovery_exhausted"
    message = job["error"]["message"]
    assert f"recovered {DEFAULT_MAX_RECOVERIES} times without completing a step" in message
    assert "last step 's3' (#2, running, begun 4 times)" in message
    assert Counter((tmp_path / "effects").read_text().split()) == Counter({"s1": 1, "s2": 1})

    # `jobs retry` revives it with a fresh count; the next run finishes it after s2.
    retry = ["jobs", "retry", job_id, "--detach", "--format", "json", "--cache-dir", str(cache)]
    retried = subprocess.run(
        [str(SBPROXY), *retry],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "SBPROXY_FAULT_POINTS"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert retried.returncode == 0, retried.stderr
    requeued = json.loads(retried.stdout)["job"]
    assert (requeued["status"], requeued["recoveries"]) == ("queued", 0)
    resumed = run_flow(tmp_path, journal=journal)
    assert resumed.returncode == 0, resumed.stderr
    job = final_job(resumed.stdout)
    assert (job["id"], job["status"], job["attempt"]) == (job_id, "succeeded", 5)
    assert job["output"] == uninterrupted["output"]
    effects = Counter((tmp_path / "effects").read_text().split())
    assert effects == Counter({f"s{i}": 1 for i in range(1, 6)})
