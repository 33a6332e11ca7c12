"""A hung engine -- it answers ``/health`` but never a completion -- no longer holds its
deployment: requests end with 504 ``engine_timeout`` at ``request_timeout_ms``,
``unhealthy_after`` of them in a row drain the generation and relaunch it after the restart
backoff, and the host converges: status true, one engine per ready generation, requests
answered. Real HTTP through the gateway, real stand-in engine processes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.workflows import process_start_ticks
from tests.api.support import TINY, served
from tests.model_host.engines.support import fake_llama_server
from tests.model_host.runtime.support import converged, live_engines, until

pytestmark = pytest.mark.anyio

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_hung_engine_is_restarted_and_the_host_converges(tmp_path: Path) -> None:
    hung = {
        **TINY,
        "request_timeout_ms": 300,
        "unhealthy_after": 2,
        "restart_backoff_initial_ms": 50,
        "warm": True,
    }
    async with served(tmp_path, deployments={"tiny": hung}, mode="hang_completions") as host:
        manager = host.host.manager
        await until(lambda: manager.deployment("tiny").routable())
        first = manager.snapshot("tiny")
        # The engine is mended on disk: the relaunch (and only it) starts a working one.
        fake_llama_server(tmp_path / "bin")
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            for _ in range(2):
                timed_out = await http.post("/v1/chat/completions", json=CHAT)
                assert timed_out.status_code == 504
                assert timed_out.json()["error"]["code"] == "engine_timeout"
            await until(lambda: manager.snapshot("tiny").generation > first.generation)
            await until(lambda: manager.deployment("tiny").routable())
            answered = await http.post("/v1/chat/completions", json=CHAT)
        assert answered.status_code == 200
        status = manager.snapshot("tiny")
        assert status.state == DeploymentState.READY
        assert status.active_requests == 0
        assert process_start_ticks(first.extra["engine_pid"]) is None
        await converged(host.host)
        assert live_engines(tmp_path) == {status.extra["engine_pid"]}
        # The restart is recorded: ready -> failed (engine_unhealthy), drained, relaunched.
        moves = manager.tallies.transitions
        assert moves[("tiny", "ready", "failed")] == 1
        assert moves[("tiny", "failed", "preparing")] == 1
