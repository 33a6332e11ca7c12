"""A runtime host process for crash tests: a warm deployment of the stand-in engine.

Usage: ``python -m tests.model_host.runtime.hostproc ROOT``. Waits until the deployment is
ready, prints its status and load job id as JSON, then shuts down cleanly. Killed by an
armed fault point (``SBPROXY_FAULT_POINTS``), it leaves a half-done load job behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio

from sbproxy.model_host.runtime.state import DeploymentState
from tests.model_host.runtime.host import runtime_host

WARM = {"model": "tiny", "variant": "q4_k_m", "warm": True}


async def main(root: Path) -> None:
    async with runtime_host(root, deployments={"tiny": WARM}) as host:
        slot = host.manager.slot("tiny")
        with anyio.fail_after(60):
            while slot.state != DeploymentState.READY:
                await anyio.sleep(0.05)
        assert slot.job_id is not None
        job = await host.engine.run_job(slot.job_id)
        assert slot.process is not None
        print(
            json.dumps(
                {
                    "state": slot.state.value,
                    "generation": slot.generation,
                    "job_id": slot.job_id,
                    "job_status": job.status.value,
                    "engine_pid": slot.process.pid,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
