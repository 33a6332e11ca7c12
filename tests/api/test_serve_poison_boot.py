"""A warm deployment whose load kills ``sbproxy serve`` every time (issue 30, item 13).

Real host processes on one SQLite journal: deployment ``a`` (``warm: true``) has a fault
point armed that SIGKILLs the host in its ``launch`` step, so its load job dies with the
host on each start. ``docs/durable-jobs.md`` promises ``max_recoveries + 1`` runs: after
them the job ends ``recovery_exhausted``, and the host must then stay up with ``a`` held
``failed`` (that job's error shown) instead of starting a fresh load of ``a`` at every boot,
while deployment ``b`` serves. ``reset`` and a load bring ``a`` back once the fault is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sbproxy.workflows.engine import DEFAULT_MAX_RECOVERIES
from tests.api.test_serve import PASSWORD
from tests.api.test_serve_reload import admin_cli
from tests.model_host.engines.support import fake_llama_server, free_port
from tests.model_host.runtime.host import config_text, write_catalog

pytestmark = pytest.mark.slow

FAULT = "load.launch:a"  # jobs.launch_step's point for deployment a only
BOOT_S = 90  # generous: a start on a loaded shared machine


def write_served(root: Path, gateway: int, admin: int) -> Path:
    """``sb.yml`` with ``a`` (warm) and ``b`` (loaded by its first request) as models
    ``a-chat`` and ``b-chat`` on origin ``localhost``."""
    write_catalog(root)
    executable = fake_llama_server(root / "bin")
    tiny = {"model": "tiny", "variant": "q4_k_m"}
    document = yaml.safe_load(
        config_text(
            root,
            executable=executable,
            deployments={"a": {**tiny, "warm": True}, "b": dict(tiny)},
        )
    )
    document["proxy"].update(
        {"http_bind_port": gateway, "admin": {"enabled": True, "port": admin, "password": PASSWORD}}
    )
    document["origins"] = {
        "localhost": {
            "action": {
                "type": "ai_proxy",
                "providers": [
                    {
                        "name": f"local-{name}",
                        "provider_type": "managed_model",
                        "deployment": name,
                        "models": [f"{name}-chat"],
                    }
                    for name in ("a", "b")
                ],
            }
        }
    }
    path = root / "sb.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def env(*, armed: bool) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SBPROXY_FAULT")}
    base["PYTHONWARNINGS"] = "ignore"
    if armed:
        base["SBPROXY_FAULT_POINTS"] = FAULT
    return base


def start(config: Path, log: Path, *, armed: bool) -> subprocess.Popen[bytes]:
    with log.open("a") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config), "--no-watch"],
            stderr=stderr,
            env=env(armed=armed),
        )


@contextmanager
def serving(
    config: Path, log: Path, admin: str, *, armed: bool
) -> Iterator[subprocess.Popen[bytes]]:
    """A host that must come up (its admin answers) and stay up; stopped with SIGTERM."""
    server = start(config, log, armed=armed)
    try:
        until(lambda: answers(admin, server), f"the admin API (log: {log.read_text()[-3000:]})")
        yield server
        assert server.poll() is None, f"the host died: {server.returncode}"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def answers(admin: str, server: subprocess.Popen[bytes]) -> bool:
    assert server.poll() is None, f"the host died at start: {server.returncode}"
    try:
        return httpx.get(f"{admin}/status", auth=("admin", PASSWORD), timeout=5).is_success
    except httpx.TransportError:
        return False


def until(condition: Callable[[], bool], what: str, timeout_s: float = BOOT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def status(admin: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{admin}/status", auth=("admin", PASSWORD), timeout=10).json()
    return {row["deployment"]: row for row in body["deployments"]}


def chat(gateway: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )


def load_jobs(root: Path, deployment: str) -> list[tuple[str, str, str | None]]:
    """``(id, status, error code)`` of every load job of ``deployment``, oldest first."""
    with sqlite3.connect(root / "cache" / "jobs" / "journal.db") as raw:
        rows = raw.execute(
            "SELECT id, status, error_code FROM jobs WHERE kind = 'load' AND subject = ? "
            "ORDER BY created_at_ms, id",
            (f"deployment:{deployment}",),
        ).fetchall()
    return [(job_id, status, code) for job_id, status, code in rows]


def test_an_exhausted_boot_load_holds_its_deployment_failed_and_the_host_serves(
    tmp_path: Path,
) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_served(tmp_path, gateway_port, admin_port)
    gateway = f"http://localhost:{gateway_port}"
    admin = f"http://127.0.0.1:{admin_port}/admin/model-host"
    log = tmp_path / "serve.log"

    # The first start and each recovery run the load of a once more: max_recoveries + 1
    # runs, each killing the host in a's launch.
    for run in range(DEFAULT_MAX_RECOVERIES + 1):
        killed = start(config, log, armed=True)
        assert killed.wait(timeout=BOOT_S) == -signal.SIGKILL, (run, log.read_text()[-3000:])
    ((poison, status_before, _),) = load_jobs(tmp_path, "a")
    assert status_before == "running"  # its runner died with the host

    # The next start finds the job out of recoveries: it ends recovery_exhausted and the
    # host stays up (the fault is still armed) instead of loading a again.
    for _boot in range(2):
        with serving(config, log, admin, armed=True):
            rows = status(admin)
            assert rows["a"]["state"] == "failed"
            assert rows["a"]["reason_code"] == "recovery_exhausted"
            assert rows["a"]["job_id"] == poison
            assert "recovered 3 times" in rows["a"]["last_error"]
            assert load_jobs(tmp_path, "a") == [(poison, "failed", "recovery_exhausted")]
            served = chat(gateway, "b-chat")  # the rest of the host serves
            assert served.status_code == 200, served.text
            refused = chat(gateway, "a-chat")  # a request does not reload a either
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "crash_loop"
            assert "recovery_exhausted" in refused.json()["error"]["message"]
            assert load_jobs(tmp_path, "a") == [(poison, "failed", "recovery_exhausted")]
            shown = admin_cli(admin_port, "models", "ps")
            assert shown.returncode == 0, shown.stderr
            assert "recovery_exhausted" in shown.stdout
            assert f"a: recovery_exhausted (job {poison}): recovered 3 times" in shown.stdout

    # With the cause gone, the hold lasts (nothing tells the host) until reset and a load.
    with serving(config, log, admin, armed=False):
        assert status(admin)["a"]["reason_code"] == "recovery_exhausted"
        assert len(load_jobs(tmp_path, "a")) == 1
        reset = httpx.post(f"{admin}/reset", json={"deployment": "a"}, auth=("admin", PASSWORD))
        assert reset.status_code == 202, reset.text
        until(lambda: status(admin)["a"]["state"] == "configured", "the reset of a")
        loaded = admin_cli(admin_port, "models", "load", "a", "--wait", "--format", "json")
        assert loaded.returncode == 0, loaded.stderr
        assert json.loads(loaded.stdout)["state"] == "ready"
        answered = chat(gateway, "a-chat")
        assert answered.status_code == 200, answered.text
