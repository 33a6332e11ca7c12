"""Round trips to a PostgreSQL journal, counted on the wire: one per step, a few per job.

The journal talks to a real server through a relay that counts what the client waits for
(``wire.py``), so these hold whatever the driver does underneath (pipelines, prepared
statements, statements held back for the next).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from sbproxy.store import EndedStep, JobStatus, JobStore, StepRecord, StepRefusal
from sbproxy.workflows import (
    LeaseSettings,
    Registry,
    StepContext,
    WorkflowContext,
    WorkflowEngine,
    step,
)
from tests.support.postgres import PostgresServer
from tests.workflows.wire import RoundTripCounter

pytestmark = pytest.mark.anyio

STEPS = 4
# Long enough that no heartbeat renews the lease while a test counts.
QUIET_LEASE = LeaseSettings(lease_s=600.0)


class Count(BaseModel):
    n: int


@step("plain")
async def plain(ctx: StepContext, arg: Count) -> Count:
    """Idempotency: pure."""
    return Count(n=arg.n + 1)


# What the workflow body saw of the wire: the round trips each step call took.
counted: dict[str, RoundTripCounter] = {}
per_step: list[int] = []

registry = Registry()


@registry.workflow("plain_steps", version=1)
async def plain_steps(ctx: WorkflowContext, arg: Count) -> Count:
    wire = counted["wire"]
    for index in range(STEPS):
        before = wire.total()
        arg = await ctx.step(plain, arg, name=f"plain:{index}")
        per_step.append(wire.total() - before)
    return arg


@pytest.fixture
def wire(postgres_server: PostgresServer) -> Iterator[RoundTripCounter]:
    with RoundTripCounter(postgres_server.port) as relay:
        counted["wire"] = relay
        per_step.clear()
        yield relay
        counted.clear()


async def test_a_plain_step_is_one_round_trip_and_a_job_four_more(
    postgres_server: PostgresServer, wire: RoundTripCounter
) -> None:
    url = wire.url(postgres_server.create_database(), postgres_server.port)
    engine = await WorkflowEngine.open(url, registry, lease=QUIET_LEASE)
    try:
        before = wire.total()
        submitted = await engine.submit(plain_steps, Count(n=0))
        job = await engine.join(submitted.job.id)
        job_round_trips = wire.total() - before
        steps = await engine.steps(job.id)
    finally:
        await engine.close()
    assert (job.status, job.output) == (JobStatus.SUCCEEDED, {"n": STEPS})
    assert [(s.name, s.output_json) for s in steps] == [
        (f"plain:{index}", f'{{"n":{index + 1}}}') for index in range(STEPS)
    ]
    # Each step call: its start (after the previous step's end) with the fence's answer,
    # one statement the server commits before it answers.
    assert per_step == [1] * STEPS
    # The job: its submit, its claim, the steps, the last step's end, the outcome. A first
    # claim's journal is empty: it is not read.
    assert job_round_trips == STEPS + 4


async def test_a_fenced_step_start_is_one_round_trip_and_records_nothing(
    postgres_server: PostgresServer, wire: RoundTripCounter
) -> None:
    url = wire.url(postgres_server.create_database(), postgres_server.port)
    engine = await WorkflowEngine.open(url, registry, lease=QUIET_LEASE)
    store = engine.store
    assert isinstance(store, JobStore)
    try:
        job = (await store.submit(kind="demo", workflow_version=1, input_json="{}")).job
        stale = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
        assert stale is not None
        first = await store.begin_step(job.id, owner="w", attempt=stale.attempt, seq=0, name="a")
        assert isinstance(first, StepRecord)
        # Recovery takes the job from that claim and a new claim of the same owner holds it.
        assert await store.requeue_from(job.id, owner="w", reason="owner_gone")
        fresh = await store.claim(owner="w", lease_ms=60_000, job_id=job.id)
        assert fresh is not None and fresh.attempt == stale.attempt + 1
        before = wire.total()
        refused = await store.begin_step(
            job.id,
            owner="w",
            attempt=stale.attempt,
            seq=1,
            name="b",
            ending=EndedStep(seq=0, name="a", output_json="1"),
        )
        assert wire.total() - before == 1
        assert refused == StepRefusal.LEASE_LOST
        [recorded] = await store.steps(job.id)
    finally:
        await engine.close()
    # The stale claim's end of step a and start of step b were both refused.
    assert (recorded.seq, recorded.status, recorded.output_json) == (0, "running", None)
