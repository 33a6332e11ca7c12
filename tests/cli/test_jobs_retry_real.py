"""``sbproxy jobs retry`` as real CLI processes: a failed pull retried from the CLI runs
here with everything a pull needs (the artifact cache), as ``models pull`` would."""

from __future__ import annotations

import json
from pathlib import Path

from tests.model_host.runtime.host import write_catalog
from tests.support.cli import run_cli


def test_a_failed_pull_retried_from_the_cli_runs_here_and_succeeds(tmp_path: Path) -> None:
    catalog = write_catalog(tmp_path)
    source = tmp_path / "source" / "tiny.gguf"
    data = source.read_bytes()
    source.unlink()  # the source is unreachable for the first run
    cache = str(tmp_path / "cache")
    pulled = run_cli(
        "models", "pull", "tiny", "--variant", "q4_k_m", "--catalog-file", str(catalog),
        "--cache-dir", cache, "--format", "json",
    )  # fmt: skip
    assert pulled.returncode == 1, pulled.stderr
    job_id = json.loads(pulled.stdout)["artifacts"][0]["job_id"]
    source.write_bytes(data)  # the operator fixed the source
    retried = run_cli("jobs", "retry", job_id, "--cache-dir", cache, "--format", "json")
    assert retried.returncode == 0, retried.stderr
    payload = json.loads(retried.stdout)
    assert (payload["job"]["status"], payload["ran_here"]) == ("succeeded", True)
    assert "missing_resource" not in retried.stderr
    again = run_cli(
        "models", "pull", "tiny", "--variant", "q4_k_m", "--catalog-file", str(catalog),
        "--cache-dir", cache, "--format", "json",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["artifacts"][0]["cache_hit"] is True
