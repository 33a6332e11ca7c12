"""Crash test: SIGKILL at every step boundary, restart, and the same job finishes correctly.

The boundaries of each step: ``before`` it runs, ``after`` its side effect (output not yet
journaled) and ``committed`` (output journaled, next step not begun).
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

ROOT = Path(__file__).resolve().parents[2]


def run_flow(tmp: Path, *, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SBPROXY_FAULT_POINTS"}
    if fault:
        env["SBPROXY_FAULT_POINTS"] = fault
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.workflows.crashflow",
            str(tmp / "journal.db"),
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
    tmp_path: Path, uninterrupted: dict[str, Any], index: int, when: str
) -> None:
    killed = run_flow(tmp_path, fault=f"step:s{index}:{when}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    first_id = job_id_of(killed.stdout)

    resumed = run_flow(tmp_path)
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
