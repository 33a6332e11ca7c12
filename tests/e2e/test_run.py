"""`sbproxy run gemma-3-270m` on the real engine and the real model: ready banner, a chat
completion with the openai client, Ctrl-C drains and stops, the private config is gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from sbproxy.workflows import process_start_ticks
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.model_host.engines.support import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]


def test_run_serves_gemma_until_ctrl_c(llama_server: Path, gemma_cache: Path) -> None:
    port = free_port()
    env = {**os.environ, "PATH": f"{llama_server.parent}:{os.environ['PATH']}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "run", "gemma-3-270m", "--port", str(port),
         "--cache-dir", str(gemma_cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Try: curl"):
            break
    text = "".join(lines)
    try:
        assert f"gemma-3-270m is ready on http://127.0.0.1:{port}" in text, text
        assert f"export OPENAI_BASE_URL=http://127.0.0.1:{port}/v1" in text
        assert re.search(r"Admin password: [0-9a-f]{64}", text)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local")
        reply = client.chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=16,
        )
        assert reply.choices[0].message.content
        assert reply.model == "gemma-3-270m"
        temp_configs = list(Path("/tmp").glob(f"sbproxy-run-{process.pid}-*"))
        assert temp_configs and all(p.stat().st_mode & 0o077 == 0 for p in temp_configs)
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert not list(Path("/tmp").glob(f"sbproxy-run-{process.pid}-*"))
    owned = gemma_cache / "engines" / "owned"
    assert not owned.exists() or not list(owned.glob("*.json"))
    for record in owned.glob("*.json") if owned.exists() else []:
        assert process_start_ticks(int(record.name.split("-")[0])) is None
