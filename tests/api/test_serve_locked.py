"""``sbproxy serve --locked`` as a real process: drift refuses to start, a match serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.api.test_serve import write_config
from tests.model_host.engines.support import free_port

TIMEOUT_S = 60
LOCK_NAME = "sbproxy-models.lock"


def sbproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )


def refused(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_serve_locked_exits_2_on_drift_without_listening(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    locked = sbproxy("models", "lock", "-f", str(config))
    assert locked.returncode == 0, locked.stderr

    # Locked but never pulled: the artifact is missing from the cache.
    done = sbproxy("serve", "-f", str(config), "--locked", "--no-watch")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "listening" not in done.stderr
    assert f"drifted from {tmp_path / LOCK_NAME}" in done.stderr
    assert "tiny:q4_k_m missing: sha256:" in done.stderr
    assert refused(gateway_port) and refused(admin_port)


def test_serve_locked_without_a_lockfile_exits_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, free_port(), free_port())
    done = sbproxy("serve", "-f", str(config), "--locked", "--no-watch")
    assert done.returncode == 2
    assert "lockfile_not_found" in done.stderr
    assert str(tmp_path / LOCK_NAME) in done.stderr
    assert "listening" not in done.stderr


def test_serve_locked_starts_when_the_lock_matches(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    assert sbproxy("models", "lock", "-f", str(config)).returncode == 0
    pulled = sbproxy("models", "pull", "-f", str(config))
    assert pulled.returncode == 0, pulled.stderr
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config), "--locked"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert f"gateway listening on http://127.0.0.1:{gateway_port}" in line, line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def test_a_locked_server_refuses_a_reload_that_drifts_and_accepts_one_that_does_not(
    tmp_path: Path,
) -> None:
    import json

    import httpx

    from tests.api.test_serve import PASSWORD

    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    assert sbproxy("models", "lock", "-f", str(config)).returncode == 0
    assert sbproxy("models", "pull", "-f", str(config)).returncode == 0
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config), "--locked", "--no-watch"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    reload_url = f"http://127.0.0.1:{admin_port}/admin/reload"
    try:
        assert process.stderr is not None
        assert "listening" in process.stderr.readline()
        assert "listening" in process.stderr.readline()
        same = httpx.post(reload_url, auth=("admin", PASSWORD), timeout=30)
        assert same.status_code == 200, same.text

        # The lock now pins other bytes for the served model: the file no longer matches it.
        lock_path = tmp_path / LOCK_NAME
        lock = json.loads(lock_path.read_text())
        lock["models"][0]["files"][0]["sha256"] = "0" * 64
        lock_path.write_text(json.dumps(lock))
        drifted = httpx.post(reload_url, auth=("admin", PASSWORD), timeout=30)
        assert drifted.status_code == 409, drifted.text
        body = drifted.json()
        assert body["code"] == "lock_drift"
        assert "tiny:q4_k_m digest_mismatch" in body["error"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
            if process.stderr is not None:
                process.stderr.close()
