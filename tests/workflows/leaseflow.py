"""Processes for the lease-clock tests: an owner that holds a job, an observer that recovers.

Usage:

* ``python -m tests.workflows.leaseflow own JOURNAL GATE``: submits (or joins) the ``hold``
  job, prints ``job <id>``, runs it in-process with a :data:`LEASE_S` lease (its one step
  waits until the file GATE exists) and prints the final record as JSON.
* ``python -m tests.workflows.leaseflow observe JOURNAL``: one lease-recovery pass
  (``requeue_expired``, the lease rule alone, without the owner-liveness check); prints
  ``{"wall_ms": <its wall clock>, "requeued": [<ids>]}``.

Tests run the observer under ``faketime`` to step its wall clock.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
from pydantic import BaseModel

from sbproxy.store import Database, JobStore, wall_clock_ms
from sbproxy.workflows import LeaseSettings, Registry, StepContext, WorkflowContext, WorkflowEngine
from sbproxy.workflows import step as declare_step

# Long enough that a loaded machine never misses a heartbeat, short enough to wait out.
LEASE_S = 1.5

registry = Registry()


class Gate(BaseModel):
    path: str


@declare_step("hold")
async def hold(ctx: StepContext, gate: Gate) -> str:
    """Idempotency: only waits for a file."""
    while not Path(gate.path).exists():
        await anyio.sleep(0.05)
    return "released"


@registry.workflow("hold", version=1)
async def hold_workflow(ctx: WorkflowContext, gate: Gate) -> str:
    return await ctx.step(hold, gate)


async def own(journal: Path, gate: Path) -> None:
    lease = LeaseSettings(lease_s=LEASE_S, heartbeat_s=0.1)
    engine = await WorkflowEngine.open(journal, registry, lease=lease)
    try:
        submitted = await engine.submit(hold_workflow, Gate(path=str(gate)), idempotency_key="hold")
        print(f"job {submitted.job.id}", flush=True)
        job = await engine.join(submitted.job.id, poll_s=0.05)
        print(json.dumps(job.to_dict()), flush=True)
    finally:
        await engine.close()


async def observe(journal: Path) -> None:
    database = await Database.open(journal)
    try:
        requeued = await JobStore(database).requeue_expired()
        print(json.dumps({"wall_ms": wall_clock_ms(), "requeued": requeued}), flush=True)
    finally:
        await database.close()


if __name__ == "__main__":
    if sys.argv[1] == "own":
        anyio.run(own, Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        anyio.run(observe, Path(sys.argv[2]))
