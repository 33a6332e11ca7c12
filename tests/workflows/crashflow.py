"""A five-step workflow whose steps record side effects; run as a subprocess by crash tests.

Usage: ``python -m tests.workflows.crashflow JOURNAL EFFECTS [KEY]``. Prints ``job <id>``
right after submitting (so a test knows the id even if the process is killed later), then
runs the job in-process and prints its final record as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
from pydantic import BaseModel

from sbproxy.workflows import Registry, StepContext, WorkflowContext, WorkflowEngine, step

registry = Registry()


class CrashInput(BaseModel):
    effects: str
    seed: int


class Carry(BaseModel):
    effects: str
    index: int
    value: int


class CrashOutput(BaseModel):
    values: list[int]


def _record(effects: str, line: str) -> None:
    # O_APPEND + fsync: one atomic, durable line per side effect.
    fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_step(index: int):  # type: ignore[no-untyped-def]
    @step(f"s{index}")
    async def body(ctx: StepContext, carry: Carry) -> Carry:
        """Idempotency: not idempotent on purpose; the test counts how often it ran."""
        _record(carry.effects, f"s{index}")
        return Carry(effects=carry.effects, index=index, value=carry.value * 31 + index)

    return body


STEPS = [_make_step(i) for i in range(1, 6)]


@registry.workflow("crash-five", version=1)
async def crash_five(ctx: WorkflowContext, arg: CrashInput) -> CrashOutput:
    carry = Carry(effects=arg.effects, index=0, value=arg.seed)
    values = []
    for definition in STEPS:
        carry = await ctx.step(definition, carry)
        values.append(carry.value)
    return CrashOutput(values=values)


async def _main(journal: Path | str, effects: str, key: str) -> None:
    engine = await WorkflowEngine.open(journal, registry)
    try:
        submitted = await engine.submit(
            crash_five, CrashInput(effects=effects, seed=7), idempotency_key=key
        )
        print(f"job {submitted.job.id}", flush=True)
        job = await engine.join(submitted.job.id)
        print(json.dumps(job.to_dict()), flush=True)
    finally:
        await engine.close()


if __name__ == "__main__":
    # The journal: a SQLite file, or a postgresql:// URL.
    where: Path | str = sys.argv[1] if "://" in sys.argv[1] else Path(sys.argv[1])
    anyio.run(_main, where, sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "crash")
