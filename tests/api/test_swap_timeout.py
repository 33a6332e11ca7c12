"""A request whose model must be swapped in behind a busy resident model, and that waited
its ``queue_timeout_ms`` for that model to go idle: a retryable 503 that says when to come
back (``Retry-After``), unlike a model that can never fit."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sbproxy.config import PriorityClass, Route
from tests.api.support import served

pytestmark = pytest.mark.anyio

SWAP = {"model": "tiny", "variant": "q4_k_m", "max_concurrency": 1, "queue_timeout_ms": 15000}
ROUTES = tuple(
    Route(origin="localhost", provider="local", public_model=name, deployment=name)
    for name in ("a", "b")
)


async def test_a_swap_that_timed_out_is_retryable_with_retry_after(tmp_path: Path) -> None:
    deployments = {"a": SWAP, "b": {**SWAP, "queue_timeout_ms": 2000}}
    limit = {"cache": {"directory": str(tmp_path / "cache"), "max_resident_models": 1}}
    async with served(tmp_path, deployments=deployments, model_host=limit, routes=ROUTES) as server:
        busy = await server.host.manager.acquire("a", priority=PriorityClass.STANDARD)
        try:
            async with httpx.AsyncClient(base_url=server.gateway_url, timeout=30) as client:
                answer = await client.post(
                    "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 4}
                )
        finally:
            busy.release()
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "insufficient_capacity"
        assert error["retryable"] is True
        assert answer.headers["Retry-After"] == "2"
        assert "busy resident model" in error["message"]
