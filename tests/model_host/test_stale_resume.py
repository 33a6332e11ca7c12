"""A verb that submits a job kind first finishes the stale jobs of that kind (and subject),
under their own ids, instead of stepping over them and leaving them ``running`` for good.

``models remove`` killed after its delete step is proven with real processes in
``artifacts/test_crash_sweep.py``; here the service meets a stale collection of another
budget, which its own submission would never join.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sbproxy.model_host.artifacts import CacheLayout
from sbproxy.model_host.flows import GcInput, gc_workflow, prune_workflow
from sbproxy.model_host.service import open_service
from sbproxy.store import JobStatus
from sbproxy.workflows import WorkerIdentity

pytestmark = pytest.mark.anyio


def dead_owner() -> str:
    """The owner id of a process of this boot that has exited (provably gone)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = WorkerIdentity.current()
    return f"{me.boot_id}/{child.pid}/{me.start_ticks}/dead"


async def test_a_collection_first_finishes_a_stale_collection_of_another_budget(
    tmp_path: Path,
) -> None:
    async with open_service(CacheLayout(root=tmp_path / "cache")) as service:
        engine = service.engine
        owner = dead_owner()
        stale = await engine.submit(gc_workflow, GcInput(budget_bytes=5), idempotency_key="gc:5")
        other = await engine.submit(prune_workflow, GcInput(budget_bytes=0), idempotency_key="p")
        for submitted in (stale, other):
            claimed = await engine.store.claim(
                owner=owner, lease_ms=600_000, job_id=submitted.job.id
            )
            assert claimed is not None
        assert [job.id for job, _ in await engine.stale_jobs(kind="gc")] == [stale.job.id]

        report, job = await service.gc(budget_bytes=10)

        assert report is not None and job.status == JobStatus.SUCCEEDED
        assert job.id != stale.job.id
        resumed = await engine.get(stale.job.id)
        assert (resumed.status, resumed.attempt) == (JobStatus.SUCCEEDED, 2)
        assert resumed.created_at_ms <= job.created_at_ms
        # Only its own kind: the stale prune is left to a prune (or a server).
        left = await engine.get(other.job.id)
        assert (left.status, left.lease_owner) == (JobStatus.RUNNING, owner)
