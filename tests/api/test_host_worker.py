"""The server's job worker loop outlives a journal it cannot write, then runs what waited.

Before, the first failed journal write inside the loop (``claim``, a job's end) ended the
loop's task group, and with it ``sbproxy serve`` (exit 1). Here the journal's writes fail as
on a full disk (real SQLite, the failure raised under the driver): the loop logs the reason
with our code and starts again after a pause; once writes work, the queued job runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from pydantic import BaseModel

from sbproxy.api.host import _worker
from sbproxy.store import JobStatus
from sbproxy.workflows import LeaseSettings, Registry, StepContext, WorkflowContext, WorkflowEngine
from sbproxy.workflows import step as declare_step
from tests.support.journal_faults import JournalFull

pytestmark = pytest.mark.anyio


class Number(BaseModel):
    n: int


@declare_step("double")
async def double(ctx: StepContext, arg: Number) -> Number:
    """Idempotency: pure."""
    return Number(n=arg.n * 2)


def registry() -> Registry:
    chosen = Registry()

    @chosen.workflow("double", version=1)
    async def run(ctx: WorkflowContext, arg: Number) -> Number:
        return await ctx.step(double, arg)

    return chosen


async def test_the_worker_loop_survives_a_full_journal_and_runs_the_job_once_writable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chosen = registry()
    engine = await WorkflowEngine.open(
        tmp_path / "journal.db", chosen, lease=LeaseSettings(lease_s=5, heartbeat_s=0.5)
    )
    try:
        journal = JournalFull(engine.store)
        definition = chosen.get("double")
        assert definition is not None
        job = (await engine.submit(definition, Number(n=21))).job
        journal.on = True
        caplog.set_level(logging.ERROR, logger="sbproxy.api.host")
        async with anyio.create_task_group() as group:
            group.start_soon(_worker, engine)
            with anyio.fail_after(10):
                while not any("job worker stopped" in r.getMessage() for r in caplog.records):
                    await anyio.sleep(0.05)
            await anyio.sleep(1.5)  # at least one restart, still failing
            assert journal.failures >= 2
            assert (await engine.get(job.id)).status == JobStatus.QUEUED

            journal.on = False
            with anyio.fail_after(15):
                while (await engine.get(job.id)).status != JobStatus.SUCCEEDED:
                    await anyio.sleep(0.05)
            group.cancel_scope.cancel()
        finished = await engine.get(job.id)
        assert finished.output == {"n": 42}
        stopped = [r.getMessage() for r in caplog.records if "job worker stopped" in r.getMessage()]
        assert stopped[0].startswith("job worker stopped: [disk_full] the job journal ")
        assert all("e3q8" not in line for line in stopped)
    finally:
        await engine.close()
