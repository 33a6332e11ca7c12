"""Peer dispatch end to end: `sbproxy serve` with the real llama-server and the real SmolLM2
chat GGUF, taking peer hops with the fleet credential from its environment, and a second
host (in process, with a static routing table and no replica of its own) whose gateway
answers through it. Greedy decoding makes the two answers comparable: the stream through the
peer carries the same events as the direct one (llama-server stamps each request with its own
``id`` and ``created``; everything else is compared), and its usage is counted on the host
the client called, not on the peer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from sbproxy.config import Route
from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import CREDENTIAL, fleet_of
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.e2e.served import PASSWORD, poll, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(E2E_TIMEOUT_S)]

MODEL = "smollm2-135m-instruct"
ROUTES = (Route(origin="localhost", provider="local", public_model="smol", deployment="smol"),)
BODY = {
    "model": "smol",
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
    "stream": True,
}


def events(stream: bytes) -> list[Any]:
    """The stream's ``data:`` payloads, JSON ones without their per-request stamps."""
    found: list[Any] = []
    for line in stream.decode().splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            found.append(payload)
            continue
        document = json.loads(payload)
        for stamp in ("id", "created", "timings"):
            document.pop(stamp, None)
        found.append(document)
    return found


async def test_a_host_without_the_model_streams_it_from_a_real_peer(
    tmp_path: Path, llama_server: Path, smol_cache: Path
) -> None:
    (tmp_path / "b").mkdir()
    config, gateway, admin = write_config(
        tmp_path / "b",
        llama_server=llama_server,
        cache=smol_cache,
        deployment="smol",
        model=MODEL,
        variant="q4_1",
        max_concurrency=2,
    )
    document = yaml.safe_load(config.read_text())
    document["proxy"]["model_host"]["fleet"] = {"credential": "${FLEET_CREDENTIAL}"}
    config.write_text(yaml.safe_dump(document))
    log = tmp_path / "b" / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "FLEET_CREDENTIAL": CREDENTIAL},
        )
    admin_http = httpx.Client(
        base_url=f"http://127.0.0.1:{admin}", auth=("admin", PASSWORD), timeout=5
    )

    def ready() -> bool:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            status = admin_http.get("/admin/model-host/status").json()
        except httpx.HTTPError:
            return False
        return bool(status["deployments"][0]["state"] == "ready")

    try:
        poll(ready, timeout_s=180, what="the deployment became ready")
        async with fleet_of(tmp_path, hosting=(), names=("a",), routes=ROUTES) as fleet:
            a = fleet["a"]
            a.directory.replicas = {
                "smol": (
                    PeerReplica(
                        deployment="smol",
                        node_id="b",
                        base_url=f"http://127.0.0.1:{gateway}",
                        generation=1,
                        ready=True,
                        active=0,
                        queued=0,
                    ),
                )
            }
            answers = []
            for url in (f"http://localhost:{gateway}", a.host.gateway_url):
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    answer = await http.post("/v1/chat/completions", json=BODY)
                assert answer.status_code == 200, answer.text
                answers.append(answer)
            direct, through = answers
            assert through.headers["x-sbproxy-route-class"] == "peer"
            assert events(through.content) == events(direct.content)
            assert events(through.content)[-1] == "[DONE]"
            assert b'"usage"' not in through.content  # the client did not ask for it
            counted = a.host.gateway.usage.tokens_since_start()
            assert counted[("(keyless)", "prompt")] > 0
            assert 0 < counted[("(keyless)", "completion")] <= 12
        metrics = admin_http.get("/metrics").text
    finally:
        admin_http.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()[-4000:]
    # The peer counted the direct request only: the same prompt and (greedy) the same
    # completion as the hop, whose usage a counted.
    for kind in ("prompt", "completion"):
        line = f'sbproxy_gateway_tokens_total{{key="(keyless)",kind="{kind}"}}'
        assert f"{line} {float(counted[('(keyless)', kind)])}" in metrics, metrics
