"""Four processes submit and run 200 jobs against one journal."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = 4
UNIQUE = 45
SHARED = 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_four_processes_run_every_job_exactly_once(
    tmp_path: Path, journal_location: Path | str
) -> None:
    journal = journal_location
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.workflows.contention",
                str(journal),
                str(tmp_path),
                str(index),
                str(PROCESSES),
                str(UNIQUE),
                str(SHARED),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(PROCESSES)
    ]
    outputs = [child.communicate(timeout=200) for child in children]
    for child, (_, stderr) in zip(children, outputs, strict=True):
        assert child.returncode == 0, stderr
        assert "database is locked" not in stderr
    submitted = [entry for stdout, _ in outputs for entry in json.loads(stdout.splitlines()[-1])]

    # Idempotency keys deduplicated the concurrent submissions of the shared keys.
    shared = [entry for entry in submitted if entry["key"].startswith("shared-")]
    assert len(shared) == PROCESSES * SHARED
    for key in {entry["key"] for entry in shared}:
        ids = {entry["id"] for entry in shared if entry["key"] == key}
        assert len(ids) == 1, key
        assert sum(entry["created"] for entry in shared if entry["key"] == key) == 1

    if isinstance(journal, str):
        with psycopg.connect(journal) as pg:
            statuses = Counter(str(status) for (status,) in pg.execute("SELECT status FROM jobs"))
    else:
        with sqlite3.connect(journal) as raw:
            statuses = Counter(status for (status,) in raw.execute("SELECT status FROM jobs"))
    total = PROCESSES * UNIQUE + SHARED
    assert total == 200
    assert statuses == Counter({"succeeded": total})

    runs = Counter(line.split()[0] for line in (tmp_path / "effects").read_text().splitlines())
    assert len(runs) == total
    assert set(runs.values()) == {1}, [job for job, count in runs.items() if count != 1]
    runners = {line.split()[1] for line in (tmp_path / "effects").read_text().splitlines()}
    assert len(runners) > 1  # the work was actually shared between processes
