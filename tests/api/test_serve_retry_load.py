"""``sbproxy jobs retry`` of a deployment's load while ``sbproxy serve`` runs: the server
takes the re-queued job at once (it does not wait for a restart), and the CLI says so."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port
from tests.support.cli import run_cli


def job_status(admin: str, job_id: str) -> str:
    job = httpx.get(f"{admin}/admin/model-host/jobs/{job_id}", auth=("admin", PASSWORD)).json()
    return str(job["job"]["status"])


def until_status(admin: str, job_id: str, wanted: set[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := job_status(admin, job_id)) not in wanted:
        assert time.monotonic() < deadline, f"job {job_id} is still {status}"
        time.sleep(0.1)
    return status


def test_a_retried_load_is_run_by_the_running_server_at_once(tmp_path: Path) -> None:
    admin_port = free_port()
    config = write_config(tmp_path, free_port(), admin_port)
    document = yaml.safe_load(config.read_text())
    document["proxy"]["model_host"]["deployments"]["tiny"]["pull"] = "manual"
    config.write_text(yaml.safe_dump(document))
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stderr=stderr,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        while "admin listening" not in log.read_text():
            assert server.poll() is None, log.read_text()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=0.1)
        load = httpx.post(
            f"{admin}/admin/model-host/load", json={"deployment": "tiny"}, auth=("admin", PASSWORD)
        ).json()
        job_id = load["job_id"]
        assert until_status(admin, job_id, {"failed"}, 30) == "failed"  # manual: not cached
        pulled = run_cli("models", "pull", "-f", str(config))  # the operator pulls it
        assert pulled.returncode == 0, pulled.stderr
        retried = run_cli("jobs", "retry", job_id, "-f", str(config))
        assert retried.returncode == 0, retried.stderr
        assert f"(pid {server.pid}) resumes it" in retried.stdout
        # Taken by the server within seconds, not at its next start.
        assert until_status(admin, job_id, {"succeeded", "failed"}, 10) == "succeeded"
        status = httpx.get(f"{admin}/admin/model-host/status", auth=("admin", PASSWORD)).json()
        assert status["deployments"][0]["state"] == "ready"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
