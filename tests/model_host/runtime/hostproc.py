"""A runtime host process for crash tests: a warm deployment of the stand-in engine.

Usage: ``python -m tests.model_host.runtime.hostproc ROOT``. Waits until the deployment is
ready, sends it one chat request, prints its status, load job id, the request's HTTP status
and how many engine processes of the cache are alive as JSON, then shuts down cleanly.
Killed by an armed fault point (``SBPROXY_FAULT_POINTS``), it leaves a half-done load job
behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import httpx

from sbproxy.config import PriorityClass
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.workflows import process_start_ticks
from tests.model_host.runtime.host import runtime_host

WARM = {"model": "tiny", "variant": "q4_k_m", "warm": True}


async def answered(manager: RuntimeManager) -> int:
    """HTTP status of one chat request through an admitted upstream (200: it answered)."""
    upstream = await manager.acquire("tiny", priority=PriorityClass.STANDARD)
    try:
        async with httpx.AsyncClient(base_url=upstream.base_url, timeout=10) as client:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            return (await client.post("/v1/chat/completions", json=body)).status_code
    except httpx.HTTPError:
        return 0
    finally:
        upstream.release()


def live_engines(root: Path) -> int:
    """Engine processes recorded under the cache (this host's and any orphan) still alive."""
    owned = root / "cache" / "engines" / "owned"
    pids = [int(p.name.split("-")[0]) for p in owned.glob("*.json")] if owned.is_dir() else []
    return sum(process_start_ticks(pid) is not None for pid in pids)


async def main(root: Path) -> None:
    async with runtime_host(root, deployments={"tiny": WARM}) as host:
        slot = host.manager.deployment("tiny")
        with anyio.fail_after(60):
            while slot.state != DeploymentState.READY:
                await anyio.sleep(0.05)
        assert slot.job_id is not None
        job = await host.engine.join(slot.job_id)
        assert slot.process is not None
        with anyio.fail_after(30):
            status = await answered(host.manager)
        print(
            json.dumps(
                {
                    "state": slot.state.value,
                    "generation": slot.generation,
                    "job_id": slot.job_id,
                    "job_status": job.status.value,
                    "engine_pid": slot.process.pid,
                    "request_status": status,
                    "live_engines": live_engines(root),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
