"""A runtime host process for reload crash tests.

Usage: ``python -m tests.model_host.runtime.reloadproc ROOT apply|resume``.

``apply`` starts a warm ``recreate`` deployment from ``ROOT/sb.yml``, prints its engine pid
and generation as JSON, then edits the file (new ``extra_args``) and reloads from it; an
armed fault point (``SBPROXY_FAULT_POINTS``) kills it part-way. ``resume`` starts from the
edited file with the job worker running, waits until every reload job in the journal has
ended and the deployment is ready, prints the outcome as JSON and shuts down cleanly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio

from sbproxy.model_host.runtime.reload import reload_from_source
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobStatus
from tests.model_host.runtime.host import config_text, runtime_host

BEFORE: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "warm": True, "rollout": "recreate"}
AFTER: dict[str, Any] = {**BEFORE, "extra_args": ["--seed", "7"]}


async def apply(root: Path) -> None:
    async with runtime_host(root, deployments={"a": BEFORE}, config_file=True) as host:
        slot = host.manager.deployment("a")
        with anyio.fail_after(60):
            while slot.state != DeploymentState.READY:
                await anyio.sleep(0.05)
        assert slot.process is not None
        print(json.dumps({"engine_pid": slot.process.pid, "generation": slot.generation}))
        sys.stdout.flush()
        executable = root / "bin" / "llama-server"
        edited = config_text(root, executable=executable, deployments={"a": AFTER})
        (root / "sb.yml").write_text(edited)
        await reload_from_source(host.manager, source="test")


async def resume(root: Path) -> None:
    async with runtime_host(root, deployments={"a": AFTER}, config_file=True, worker=True) as host:
        jobs = [job for job in await host.engine.store.list_jobs() if job.kind == "reload"]
        with anyio.fail_after(60):
            while True:
                jobs = [await host.engine.get(job.id) for job in jobs]
                slot = host.manager.deployment("a")
                settled = all(job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED) for job in jobs)
                if settled and slot.state == DeploymentState.READY:
                    break
                await anyio.sleep(0.05)
        assert slot.process is not None
        print(
            json.dumps(
                {
                    "jobs": [[job.id, job.status.value, job.attempt] for job in jobs],
                    "state": slot.state.value,
                    "generation": slot.generation,
                    "extra_args": slot.config.extra_args,
                    "engine_pid": slot.process.pid,
                    "revision": host.manager.revision,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    anyio.run(apply if sys.argv[2] == "apply" else resume, Path(sys.argv[1]))
