"""One of several processes that submit and run jobs against one journal.

Usage: ``python -m tests.workflows.contention JOURNAL RUNDIR INDEX PROCESSES UNIQUE SHARED``.
Submits UNIQUE jobs with keys of its own and SHARED jobs with keys every process uses, writes
``ready-INDEX`` and waits for every process to be ready (so no job finishes before all
submissions are in), then runs a worker until idle. Each job's step appends
``<job id> <pid>`` to RUNDIR/effects. Prints one JSON line: submitted ids and created flags.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import anyio
from pydantic import BaseModel

from sbproxy.workflows import Registry, StepContext, WorkflowContext, WorkflowEngine, step

registry = Registry()


class Work(BaseModel):
    effects: str
    key: str


class Done(BaseModel):
    key: str


@step("record")
async def record(ctx: StepContext, arg: Work) -> Done:
    """Idempotency: deliberately not idempotent; the test counts executions."""
    fd = os.open(arg.effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{ctx.job_id} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return Done(key=arg.key)


@registry.workflow("contended")
async def contended(ctx: WorkflowContext, arg: Work) -> Done:
    return await ctx.step(record, arg)


async def _main(
    journal: Path | str, rundir: Path, index: int, processes: int, unique: int, shared: int
) -> None:
    engine = await WorkflowEngine.open(journal, registry)
    effects = str(rundir / "effects")
    submitted = []
    keys = [f"shared-{i}" for i in range(shared)] + [f"p{index}-{i}" for i in range(unique)]
    for key in keys:
        outcome = await engine.submit(
            contended, Work(effects=effects, key=key), idempotency_key=key
        )
        submitted.append({"key": key, "id": outcome.job.id, "created": outcome.created})
    (rundir / f"ready-{index}").touch()
    deadline = time.monotonic() + 60
    while len(list(rundir.glob("ready-*"))) < processes:
        if time.monotonic() > deadline:
            raise SystemExit("peers never became ready")
        await anyio.sleep(0.02)
    await engine.run_worker(concurrency=4, poll_s=0.02, until_idle=True)
    await engine.close()
    print(json.dumps(submitted), flush=True)


if __name__ == "__main__":
    journal, rundir, *numbers = sys.argv[1:]
    index, processes, unique, shared = (int(n) for n in numbers)
    where: Path | str = journal if "://" in journal else Path(journal)  # SQLite or postgresql://
    anyio.run(_main, where, Path(rundir), index, processes, unique, shared)
