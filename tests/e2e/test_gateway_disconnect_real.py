"""A client that leaves a plain completion stops the real engine: `sbproxy serve` with the
real llama-server and the real Gemma GGUF; a non-streaming completion that would generate
for half a minute or more; the client closes its connection once the engine is generating.
The admission permit comes back within a second, the engine's log shows the task cancelled
and its slot released well short of ``max_tokens``, and the next request is served at once
-- with one engine slot, it would otherwise wait for the first.

The engine is watched through its log, not its ``/slots`` route, once the client has left:
llama-server checks a waiting plain request's connection only after a second with no result
for *any* task, so polling ``/slots`` (each answer is a result) would itself keep the
abandoned generation running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.e2e.served import PASSWORD, poll, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]

MAX_TOKENS = 1500  # 20 s of generation at ~70 tokens/s, far more on a busy machine


def test_a_client_that_leaves_a_plain_completion_stops_the_real_engine(
    tmp_path: Path, llama_server: Path, gemma_cache: Path
) -> None:
    config, gateway, admin = write_config(
        tmp_path,
        llama_server=llama_server,
        cache=gemma_cache,
        deployment="gemma",
        model="gemma-3-270m",
        variant="q4_k_m",
        max_concurrency=1,
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
    resources = ExitStack()
    admin_http = resources.enter_context(
        httpx.Client(base_url=f"http://127.0.0.1:{admin}", auth=("admin", PASSWORD), timeout=5)
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

    try:
        poll(ready, timeout_s=180, what="the deployment became ready")
        deployment = status()
        engine = resources.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{deployment['port']}", timeout=5)
        )
        engine_log = gemma_cache / "logs" / f"gemma-g{deployment['generation']}.log"

        def generating() -> bool:
            (slot,) = engine.get("/slots").json()
            return bool(slot["is_processing"]) and slot["next_token"][0]["n_decoded"] >= 16

        body = json.dumps(
            {
                "model": "gemma",
                "prompt": "Count from one to one thousand, one number per line:\n",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            }
        ).encode()
        client = resources.enter_context(socket.create_connection(("127.0.0.1", gateway)))
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        poll(generating, timeout_s=30, what="the engine started generating")
        assert status()["active_requests"] == 1
        client.close()  # the client goes away while the engine generates

        freed_s = poll(
            lambda: status()["active_requests"] == 0, timeout_s=1, what="the permit came back"
        )

        def released() -> list[int]:
            text = engine_log.read_text()
            if "cancel task" not in text:
                return []
            return [int(n) for n in re.findall(r"stop processing: n_tokens = (\d+)", text)]

        stopped_s = poll(lambda: bool(released()), timeout_s=5, what="the engine stopped")
        (n_tokens,) = released()
        assert n_tokens < MAX_TOKENS // 2, "the engine ran on after the client left"

        # The engine's one slot is free again (read from the engine, not from a stopwatch: a
        # busy machine makes a follow-up slow without anything being held).
        (slot,) = engine.get("/slots").json()
        assert not slot["is_processing"], slot
        followed = httpx.post(
            f"http://localhost:{gateway}/v1/completions",
            json={"model": "gemma", "prompt": "Hello", "max_tokens": 8},
            timeout=30,
        )
        assert followed.status_code == 200, followed.text
        metrics = admin_http.get("/metrics").text
        assert 'sbproxy_gateway_client_disconnects_total{deployment="gemma"} 1.0' in metrics
    finally:
        resources.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()[-4000:]
    access = [line for line in log.read_text().splitlines() if "sbproxy.api.access" in line]
    assert any("POST /v1/completions 499 deployment=gemma" in line for line in access), access
    assert any("POST /v1/completions 200 deployment=gemma" in line for line in access), access
    print(f"permit freed {freed_s:.3f} s after the client left; engine stopped {stopped_s:.3f} s")
    print(f"the engine stopped at {n_tokens} tokens of context; the next request was served")
