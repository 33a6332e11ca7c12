"""Start the cached llama-server on the cached Gemma artifact, ask one question, stop.

A stop-gap for the main job until ``sbproxy run`` exists: it uses the product's own pieces
(cache lookup, llama.cpp driver, supervised launch) exactly as the runtime will.

Usage: ``python scripts/demo_chat.py CACHE_DIR``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import anyio
import httpx

from sbproxy.model_host.artifacts import ArtifactCache, CacheLayout
from sbproxy.model_host.engines import (
    LaunchRequest,
    detect_llama_cpp,
    launch,
    plan_llama_launch,
)
from sbproxy.workflows import WorkerIdentity


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def main(root: Path) -> int:
    layout = CacheLayout(root=root)
    cache = ArtifactCache(layout)
    gemma = [m for m in cache.published() if m.logical_model == "gemma-3-270m"]
    found = detect_llama_cpp(None, layout=layout)
    if not gemma or found.executable is None:
        print("gemma-3-270m or llama-server is missing from the cache", file=sys.stderr)
        return 1
    port = _free_port()
    request = LaunchRequest(
        deployment="demo",
        generation=1,
        metadata=gemma[0],
        snapshot=cache.snapshot(gemma[0].artifact_digest),
        port=port,
        ctx_size=2048,
        max_concurrency=1,
    )
    process = await launch(
        plan_llama_launch(request, executable=Path(found.executable)),
        log_path=layout.root / "logs" / "demo-engine.log",
        owned_dir=layout.root / "engines" / "owned",
        label="demo/1",
        identity=WorkerIdentity.current(),
        ready_timeout_s=120,
    )
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            reply = await client.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24},
            )
        reply.raise_for_status()
        print("gemma-3-270m says:", reply.json()["choices"][0]["message"]["content"].strip())
    finally:
        await process.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, Path(sys.argv[1])))
