"""`sbproxy run` on the real engine and real models, as a new user meets it: the chat model
answers "Say hello." with a greeting that ends on its own, `sbproxy models ps` finds the run
with no flags, the printed Try: line answers, Ctrl-C stops everything; and the base model
refuses a chat with `chat_not_supported` while it completes text."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from sbproxy.workflows import process_start_ticks
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.model_host.engines.support import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]


@contextmanager
def running(
    model: str, *, llama_server: Path, cache: Path, home: Path
) -> Iterator[tuple[int, str, dict[str, str]]]:
    """``sbproxy run MODEL`` with ``cache`` as the user's default cache (its own HOME, no
    SBPROXY_* settings): ``(gateway port, banner, environment)``; Ctrl-C at the end."""
    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_", "SB_ADMIN", "XDG_"))
    }
    env |= {
        "HOME": str(home),
        "SBPROXY_CACHE_DIR": str(cache),
        "PATH": f"{llama_server.parent}:{env['PATH']}",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing may need the network
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "run", model, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
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
    try:
        yield port, "".join(lines), env
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert not list(Path("/tmp").glob(f"sbproxy-run-{process.pid}-*"))
    owned = cache / "engines" / "owned"
    for record in owned.glob("*.json") if owned.exists() else []:
        assert process_start_ticks(int(record.name.split("-")[0])) is None


def test_the_chat_model_greets_and_the_run_can_be_found(
    llama_server: Path, smol_cache: Path, tmp_path: Path
) -> None:
    model = "smollm2-135m-instruct"
    with running(model, llama_server=llama_server, cache=smol_cache, home=tmp_path) as (
        port,
        text,
        env,
    ):
        assert f"{model} is ready on http://127.0.0.1:{port}" in text, text
        assert re.search(r"Admin password: [0-9a-f]{64}", text)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local")
        reply = client.chat.completions.create(
            model=model, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
        )
        content = reply.choices[0].message.content or ""
        assert "hello" in content.lower(), content
        assert reply.choices[0].finish_reason == "stop"  # it ended on its own
        assert reply.model == model

        # A new shell: `models ps` finds the run with no flags.
        listed = subprocess.run(
            [sys.executable, "-m", "sbproxy.cli", "models", "ps", "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)["deployments"]
        assert row["state"] == "ready"

        # The printed Try: line answers, within a minute, with an answer that ends.
        (try_line,) = [line for line in text.splitlines() if line.startswith("Try: ")]
        started = time.monotonic()
        tried = subprocess.run(
            shlex.split(try_line.removeprefix("Try: ")),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert tried.returncode == 0, tried.stderr
        answer = json.loads(tried.stdout)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer["usage"]["completion_tokens"] <= 512  # max_output_tokens
        assert time.monotonic() - started < 60


def test_the_base_model_completes_text_and_refuses_a_chat(
    llama_server: Path, gemma_cache: Path, tmp_path: Path
) -> None:
    model = "gemma-3-270m"
    with running(model, llama_server=llama_server, cache=gemma_cache, home=tmp_path) as (
        port,
        text,
        _,
    ):
        assert f"{model} is ready on http://127.0.0.1:{port}" in text, text
        refused = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Say hello."}]},
            timeout=30,
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "chat_not_supported"
        completed = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": model, "prompt": "The capital of France is"},
            timeout=300,
        )
        assert completed.status_code == 200
        body = completed.json()
        assert body["choices"][0]["text"].strip()
        assert body["usage"]["completion_tokens"] <= 512  # bounded without max_tokens
