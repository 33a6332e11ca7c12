"""Small workflows that `sbproxy jobs` tests run in a separate process.

Usage (cwd = repository root)::

    python -m tests.cli.jobflows JOURNAL submit KIND WORKDIR [KEY]   # queue only
    python -m tests.cli.jobflows JOURNAL run KIND WORKDIR [KEY]      # queue, then run here
    python -m tests.cli.jobflows JOURNAL resume JOB_ID               # run an existing job

``submit`` and ``run`` print ``job <id>`` as soon as the job is queued; ``run`` and ``resume``
print the final job as one JSON line. Kinds:

* ``slow-download``: ``gate`` waits until ``WORKDIR/gate`` exists (when ``WORKDIR/use-gate``
  does), ``download:model.gguf`` reports byte progress over about a second, ``publish``
  returns a digest.
* ``flaky``: ``prepare``, then ``flaky`` fails permanently on its first run (it leaves
  ``WORKDIR/marker`` behind) and succeeds afterwards, then ``finish``. Every step appends its
  name to ``WORKDIR/effects``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from sbproxy.errors import SbproxyError
from sbproxy.workflows import (
    Registry,
    StepContext,
    WorkflowContext,
    WorkflowDef,
    WorkflowEngine,
    step,
)

registry = Registry()

DOWNLOAD_BYTES = 253_125_017  # 241.4 MiB
DOWNLOAD_CHUNKS = 8
CHUNK_S = 0.15
GATE_WAIT_S = 30.0


class FlowInput(BaseModel):
    workdir: str


class Published(BaseModel):
    digest: str
    size_bytes: int


def _record(workdir: str, name: str) -> None:
    with Path(workdir, "effects").open("a", encoding="utf-8") as effects:
        effects.write(name + "\n")
        effects.flush()
        os.fsync(effects.fileno())


@step("gate")
async def wait_for_gate(ctx: StepContext, arg: FlowInput) -> bool:
    """Hold the job until the test opens the gate.

    Idempotency: only reads the file system.
    """
    workdir = Path(arg.workdir)
    if not (workdir / "use-gate").exists():
        return False
    with anyio.fail_after(GATE_WAIT_S):
        while not (workdir / "gate").exists():
            await anyio.sleep(0.02)
    return True


@step("download")
async def download(ctx: StepContext, arg: FlowInput) -> int:
    """Pretend to download a file, reporting progress per chunk.

    Idempotency: writes nothing.
    """
    chunk = DOWNLOAD_BYTES // DOWNLOAD_CHUNKS
    for index in range(1, DOWNLOAD_CHUNKS + 1):
        await anyio.sleep(CHUNK_S)
        done = DOWNLOAD_BYTES if index == DOWNLOAD_CHUNKS else chunk * index
        await ctx.report_progress(done=done, total=DOWNLOAD_BYTES, force=True)
    return DOWNLOAD_BYTES


@step("publish")
async def publish(ctx: StepContext, size: int) -> Published:
    """Return the published digest.

    Idempotency: pure.
    """
    return Published(digest="sha256:" + "ab" * 32, size_bytes=size)


@registry.workflow("slow-download", version=1)
async def slow_download(ctx: WorkflowContext, arg: FlowInput) -> Published:
    await ctx.step(wait_for_gate, arg)
    size = await ctx.step(download, arg, name="download:model.gguf")
    return await ctx.step(publish, size)


@step("prepare")
async def prepare(ctx: StepContext, arg: FlowInput) -> str:
    """Idempotency: not idempotent on purpose; tests count its runs in ``effects``."""
    _record(arg.workdir, "prepare")
    return "prepared"


@step("flaky")
async def flaky(ctx: StepContext, arg: FlowInput) -> str:
    """Fail permanently the first time, succeed after (a fixed upstream, say).

    Idempotency: not idempotent on purpose; tests count its runs in ``effects``.
    """
    _record(arg.workdir, "flaky")
    marker = Path(arg.workdir, "marker")
    if not marker.exists():
        marker.touch()
        raise SbproxyError(
            "the upstream refused the request (test failure)", code="flaky_first_run"
        )
    return "fixed"


@step("finish")
async def finish(ctx: StepContext, arg: FlowInput) -> str:
    """Idempotency: not idempotent on purpose; tests count its runs in ``effects``."""
    _record(arg.workdir, "finish")
    return "finished"


@registry.workflow("flaky", version=1)
async def flaky_flow(ctx: WorkflowContext, arg: FlowInput) -> list[str]:
    return [
        await ctx.step(prepare, arg),
        await ctx.step(flaky, arg),
        await ctx.step(finish, arg),
    ]


FLOWS: dict[str, WorkflowDef[FlowInput, Any]] = {
    "slow-download": slow_download,
    "flaky": flaky_flow,
}


async def _main(journal: Path, action: str, args: list[str]) -> None:
    engine = await WorkflowEngine.open(journal, registry)
    try:
        if action == "resume":
            job_id = args[0]
        else:
            kind, workdir = args[0], args[1]
            key = args[2] if len(args) > 2 else None
            submitted = await engine.submit(
                FLOWS[kind], FlowInput(workdir=workdir), idempotency_key=key, subject="test"
            )
            job_id = submitted.job.id
            print(f"job {job_id}", flush=True)
            if action == "submit":
                return
        job = await engine.join(job_id)
        print(json.dumps(job.to_dict()), flush=True)
    finally:
        await engine.close()


if __name__ == "__main__":
    anyio.run(_main, Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
