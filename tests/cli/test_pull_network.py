"""A pull that cannot reach its host says which host, why, and what to do next."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from sbproxy.model_host.artifacts.download import unreachable
from tests.model_host.engines.support import free_port


def test_the_reason_is_named() -> None:
    named = unreachable("https://hf.example/x", socket.gaierror(-2, "Name or service not known"))
    assert "cannot reach hf.example (its name does not resolve)" in named.message
    refused = unreachable("http://127.0.0.1:9/x", ConnectionRefusedError(111, "refused"))
    assert "cannot reach 127.0.0.1:9 (the connection was refused)" in refused.message
    assert refused.retryable
    assert refused.details["host"] == "127.0.0.1:9"


def test_a_pull_with_no_route_names_the_host_and_the_next_steps(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "HF_"))},
        "SBPROXY_CACHE_DIR": str(tmp_path / "cache"),
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
    }
    done = subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", "models", "pull", "smollm2-135m-instruct",
         "--format", "json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (row,) = json.loads(done.stdout)["artifacts"]
    message = row["error"]["message"]
    assert f"cannot reach 127.0.0.1:{port} (the connection was refused)" in message
    for step in ("HF_ENDPOINT", "--offline", "sbproxy models import"):
        assert step in message
