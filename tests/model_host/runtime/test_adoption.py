"""Which runtime jobs (load, drain, reset) a host takes from its journal: a queued one it
does not hold yet at once (a ``jobs retry``), a dead owner's, never a live owner's, and
never one its configuration does not declare as the job was submitted."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from sbproxy.model_host.runtime.jobs import DeploymentInput, load_workflow, submit_load
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobStatus, boot_id
from sbproxy.workflows import process_start_ticks
from tests.model_host.runtime.host import runtime_host
from tests.model_host.runtime.support import converged, finished, live_engines, until

pytestmark = pytest.mark.anyio

TINY: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "max_concurrency": 2}


async def queued_load(root: Path, deployments: dict[str, dict[str, Any]], name: str) -> str:
    """A load job of ``name`` left queued in the journal by a host that then stopped."""
    async with runtime_host(root, deployments=deployments, start=False) as host:
        return (await submit_load(host.manager.port, name)).id


async def test_a_load_of_a_deployment_this_host_does_not_declare_is_cancelled(
    tmp_path: Path,
) -> None:
    job_id = await queued_load(tmp_path, {"gone": TINY}, "gone")
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        job = await finished(host, job_id)
        assert job.status == JobStatus.CANCELLED
        events = await host.engine.store.events(job_id)
        superseded = [e for e in events if e.type == "superseded"]
        assert superseded
        assert "not declared in this host's configuration" in superseded[0].data["message"]
        assert live_engines(tmp_path) == set()
        assert host.manager.snapshot("tiny").state == DeploymentState.CONFIGURED


async def test_a_load_whose_deployment_definition_changed_is_not_run(tmp_path: Path) -> None:
    job_id = await queued_load(tmp_path, {"tiny": TINY}, "tiny")
    changed = {**TINY, "max_concurrency": 1}  # edited while the host was down
    async with runtime_host(tmp_path, deployments={"tiny": changed}) as host:
        job = await finished(host, job_id)
        assert job.status == JobStatus.CANCELLED
        events = await host.engine.store.events(job_id)
        assert any("changed since this load job" in str(e.data) for e in events)
        assert live_engines(tmp_path) == set()
        # A load under the current definition runs as usual.
        load = await host.manager.load("tiny")
        assert load.id != job_id
        assert (await finished(host, load.id)).status == JobStatus.SUCCEEDED
        await converged(host)


async def test_a_queued_load_nobody_holds_is_run_by_the_host_at_once(tmp_path: Path) -> None:
    """What ``sbproxy jobs retry`` of a load leaves: a queued job in no command lane."""
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        submitted = await host.engine.submit(
            load_workflow,
            DeploymentInput(deployment="tiny"),
            idempotency_key="load:tiny:retried",
            subject="deployment:tiny",
        )
        job = await finished(host, submitted.job.id, timeout_s=15)
        assert job.status == JobStatus.SUCCEEDED
        assert host.manager.deployment("tiny").routable()
        await converged(host)


async def test_a_load_running_under_a_live_owner_is_never_taken(tmp_path: Path) -> None:
    job_id = await queued_load(tmp_path, {"tiny": TINY}, "tiny")
    other = subprocess.Popen(["sleep", "60"])  # another live process holds the job
    try:
        owner = f"{boot_id()}/{other.pid}/{process_start_ticks(other.pid)}/other"
        async with runtime_host(tmp_path, deployments={"tiny": TINY}, start=False) as host:
            claimed = await host.engine.store.claim(owner=owner, lease_ms=60_000, job_id=job_id)
            assert claimed is not None
        async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
            assert await host.manager.adopt_runtime_jobs() == []
            job = await host.engine.get(job_id)
            assert (job.status, job.lease_owner) == (JobStatus.RUNNING, owner)
            assert live_engines(tmp_path) == set()
            other.kill()
            other.wait()
            # Its owner is gone: the next adoption pass takes the job and finishes it here.
            job = await finished(host, job_id)
            assert (job.status, job.attempt) == (JobStatus.SUCCEEDED, 2)
            await until(lambda: host.manager.deployment("tiny").routable())
            await converged(host)
    finally:
        other.kill()
        other.wait()
