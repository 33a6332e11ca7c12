"""Every job records its node; only that node claims it and recovers it from a dead runner
(on both backends): a dead node's jobs wait for it instead of running elsewhere."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sbproxy.store import Database, JobStatus, JobStore, LeaseTime, Recovered
from sbproxy.store.node import ENV_NODE_ID, node_id

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> LeaseTime:
        return LeaseTime(clock="shared", ms=self.ms)


@pytest.fixture
async def database(journal_location: Path | str) -> AsyncIterator[Database]:
    opened = await Database.open(journal_location)
    try:
        yield opened
    finally:
        await opened.close()


async def test_only_the_recording_node_claims_a_job(database: Database) -> None:
    node_a = JobStore(database, node="node-a")
    node_b = JobStore(database, node="node-b")
    job = (await node_a.submit(kind="pull", workflow_version=1, input_json="{}")).job
    assert job.node == "node-a"
    assert await node_b.claim(owner="b", lease_ms=1_000) is None
    assert await node_b.claim(owner="b", lease_ms=1_000, job_id=job.id) is None
    claimed = await node_a.claim(owner="a", lease_ms=1_000)
    assert claimed is not None
    assert (claimed.id, claimed.node, claimed.status) == (job.id, "node-a", JobStatus.RUNNING)


async def test_idempotency_keys_are_per_node(database: Database) -> None:
    """Two nodes pulling one artifact (one key) get a job each: node B never joins node A's
    node-local job, which only A can claim; within a node the key still joins."""
    node_a = JobStore(database, node="node-a")
    node_b = JobStore(database, node="node-b")
    first = await node_a.submit(
        kind="pull", workflow_version=1, input_json="{}", idempotency_key="d"
    )
    other = await node_b.submit(
        kind="pull", workflow_version=1, input_json="{}", idempotency_key="d"
    )
    again = await node_b.submit(
        kind="pull", workflow_version=1, input_json="{}", idempotency_key="d"
    )
    assert first.created and other.created and not again.created
    assert (first.job.node, other.job.node) == ("node-a", "node-b")
    assert again.job.id == other.job.id != first.job.id
    found = await node_a.find_active("d")
    assert found is not None and found.id == first.job.id


async def test_a_dead_nodes_jobs_wait_for_it(database: Database) -> None:
    clock = Clock()
    node_a = JobStore(database, node="node-a", lease_clock=clock)
    node_b = JobStore(database, node="node-b", lease_clock=clock)
    job = (await node_a.submit(kind="pull", workflow_version=1, input_json="{}")).job
    assert await node_a.claim(owner="a", lease_ms=1_000) is not None
    clock.ms += 5_000  # node a's runner stopped renewing long ago

    assert await node_b.recover_lapsed(max_recoveries=3) == Recovered(requeued=(), exhausted=())
    assert (
        await node_b.recover_from(job.id, owner="a", reason="owner_gone", max_recoveries=3) is None
    )
    still = await node_b.get(job.id)
    assert still is not None
    assert (still.status, still.lease_owner) == (JobStatus.RUNNING, "a")

    recovered = await node_a.recover_lapsed(max_recoveries=3)
    assert recovered.requeued == (job.id,)


def test_the_node_id_is_the_environment_or_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv(ENV_NODE_ID, raising=False)
    assert node_id() == socket.gethostname()
    monkeypatch.setenv(ENV_NODE_ID, "  rack2-gpu7  ")
    assert node_id() == "rack2-gpu7"
