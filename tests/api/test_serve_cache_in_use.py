"""One serving host per cache: a second ``sbproxy serve`` on a cache another one serves is
refused at start with one line naming the first one's pid, and the first is left alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from tests.api.test_serve import write_config
from tests.model_host.engines.support import free_port


def serve(config: Path, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )


def wait_listening(process: subprocess.Popen[str], log: Path) -> None:
    for _ in range(600):  # a minute at most
        if "gateway listening" in log.read_text():
            return
        assert process.poll() is None, log.read_text()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
    raise AssertionError(log.read_text())


def second_config(first: Path, root: Path) -> Path:
    """The first host's configuration on other ports (same cache)."""
    document = yaml.safe_load(first.read_text())
    document["proxy"]["http_bind_port"] = free_port()
    document["proxy"]["admin"]["port"] = free_port()
    path = root / "second.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_a_second_host_on_the_same_cache_is_refused_and_the_first_keeps_serving(
    tmp_path: Path,
) -> None:
    gateway_port = free_port()
    config = write_config(tmp_path, gateway_port, free_port())
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = serve(config, first_log)
    second: subprocess.Popen[str] | None = None
    try:
        wait_listening(first, first_log)
        second = serve(second_config(config, tmp_path), second_log)
        second.wait(timeout=60)
        err = second_log.read_text()
        assert second.returncode == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert "cache_in_use" in lines[0]
        assert f"pid {first.pid}" in lines[0]
        assert "Traceback" not in err
        assert first.poll() is None
        answer = httpx.post(
            f"http://localhost:{gateway_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        # The lock went with the first host: the next one starts.
        second = serve(second_config(config, tmp_path), second_log)
        wait_listening(second, second_log)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
