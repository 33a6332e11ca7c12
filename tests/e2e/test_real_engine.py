"""The real llama-server, built from the pinned source through the product's build path,
serves the real Gemma 3 270M GGUF from the cache through the llama.cpp driver."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import LaunchRequest, launch, plan_llama_launch
from sbproxy.workflows import WorkerIdentity, process_start_ticks
from tests.e2e.conftest import E2E_TIMEOUT_S
from tests.model_host.engines.support import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.e2e, pytest.mark.timeout(E2E_TIMEOUT_S)]


async def test_real_llama_server_answers_a_chat_completion(
    llama_server: Path, gemma_cache: Path, tmp_path: Path
) -> None:
    cache = ArtifactCache(CacheLayout(root=gemma_cache))
    (metadata,) = cache.published()
    assert metadata.logical_model == "gemma-3-270m"
    port = free_port()
    request = LaunchRequest(
        deployment="e2e",
        generation=1,
        metadata=metadata,
        snapshot=cache.snapshot(metadata.artifact_digest),
        port=port,
        ctx_size=2048,
        max_concurrency=2,
    )
    plan = plan_llama_launch(request, executable=llama_server)
    process = await launch(
        plan,
        log_path=tmp_path / "engine.log",
        owned_dir=tmp_path / "owned",
        label="e2e/1",
        identity=WorkerIdentity.current(),
        ready_timeout_s=120,
    )
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            response = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Say hello in one word."}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
        assert response.status_code == 200, response.text
        body = response.json()
        content = body["choices"][0]["message"]["content"]
        assert isinstance(content, str)
        assert content.strip(), json.dumps(body)
        assert body["usage"]["completion_tokens"] > 0
    finally:
        await process.shutdown(grace_s=10)
    assert process_start_ticks(process.pid) is None
    assert not (tmp_path / "owned").exists() or list((tmp_path / "owned").iterdir()) == []
