"""A stream the client reads to its end is no disconnect: `sbproxy serve` with the real
llama-server and the real SmolLM2 chat GGUF, and the real ``openai`` client streaming chat
completions with ``stream_options.include_usage``. The client stops at ``data: [DONE]`` and
closes its connection, which often happens before the engine's own end of the chunked body
has reached the gateway; each of the streams must still be logged 200, counted in no
disconnect, and kept in the activity ring as 200 with its usage.

Twenty streams, two at a time, because the race is one of timing: the real llama-server
writes ``[DONE]`` and the end of its chunked body as two sends about 60 µs apart (measured
here), and before the relay stopped reading at ``[DONE]`` a client that closed inside that
window was logged ``499 client_disconnected``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.e2e.served import PASSWORD, poll, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]

STREAMS = 20
MODEL = "smollm2-135m-instruct"


def test_streams_read_to_their_end_are_logged_200_and_never_as_disconnects(
    tmp_path: Path, llama_server: Path, smol_cache: Path
) -> None:
    config, gateway, admin = write_config(
        tmp_path,
        llama_server=llama_server,
        cache=smol_cache,
        deployment="smol",
        model=MODEL,
        variant="q4_1",
        max_concurrency=2,
    )
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            # Successful answers are logged too (by default only abnormal ends are).
            env={**os.environ, "SBPROXY_ACCESS_LOG": "all"},
        )
    admin_http = httpx.Client(
        base_url=f"http://127.0.0.1:{admin}", auth=("admin", PASSWORD), timeout=5
    )

    def status() -> dict[str, Any]:
        body: dict[str, Any] = admin_http.get("/admin/model-host/status").json()
        deployment: dict[str, Any] = body["deployments"][0]
        return deployment

    def ready() -> bool:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            return bool(status()["state"] == "ready")
        except httpx.HTTPError:
            return False

    usages: list[tuple[int, int]] = []
    try:
        poll(ready, timeout_s=180, what="the deployment became ready")
        with openai.OpenAI(
            base_url=f"http://localhost:{gateway}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:

            def one(index: int) -> tuple[int, int]:
                stream = client.chat.completions.create(
                    model="smol",
                    messages=[{"role": "user", "content": f"Say hello, number {index}."}],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(stream)  # up to [DONE]; the client then closes the response
                usage = chunks[-1].usage
                assert usage is not None, chunks[-1]
                assert any(c.choices and c.choices[0].delta.content for c in chunks)
                return usage.prompt_tokens, usage.completion_tokens

            # Two at a time (the deployment's max_concurrency): while one stream ends, the
            # other keeps the gateway busy, which widens the window the race needs.
            with ThreadPoolExecutor(max_workers=2) as pool:
                usages.extend(pool.map(one, range(STREAMS)))
        poll(lambda: status()["active_requests"] == 0, timeout_s=5, what="the permits came back")
        metrics = admin_http.get("/metrics").text
        activity = admin_http.get("/admin/ui/activity", params={"n": STREAMS}).text
    finally:
        admin_http.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()[-4000:]
    assert "sbproxy_gateway_client_disconnects_total{" not in metrics, metrics
    access = [line for line in log.read_text().splitlines() if "sbproxy.api.access" in line]
    chats = [line for line in access if "POST /v1/chat/completions" in line]
    assert len(chats) == STREAMS, access
    assert all(" 200 deployment=smol " in line for line in chats), chats
    assert not any("client_disconnected" in line for line in chats), chats
    assert all(prompt > 0 and 0 < completion <= 12 for prompt, completion in usages), usages
    # The console's Activity page: one row per stream, each with the status logged.
    assert activity.count('data-status="200"') == STREAMS, activity
    assert 'data-status="499"' not in activity
