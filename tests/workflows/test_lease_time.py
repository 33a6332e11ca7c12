"""A wall-clock step (NTP, an operator's ``date -s``) neither recovers a job whose owner is
alive and heartbeating nor keeps a dead owner's job from being recovered.

In-process engines with an injected wall clock prove the rule; real processes whose wall
clock ``faketime`` steps prove it again where ``faketime`` is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from sbproxy.store import Database, JobStatus, JobStore, wall_clock_ms
from sbproxy.workflows import (
    LeaseSettings,
    Registry,
    StepContext,
    WorkerIdentity,
    WorkflowContext,
    WorkflowEngine,
    step,
)
from tests.support.tools import tools_required
from tests.workflows import leaseflow

ROOT = Path(__file__).resolve().parents[2]
HOUR_MS = 3_600_000
STEPS_MS = [HOUR_MS, -HOUR_MS]


class SteppedWall:
    """A wall clock that follows the real one, ``offset_ms`` away (a step NTP made)."""

    def __init__(self, offset_ms: int) -> None:
        self.offset_ms = offset_ms

    def __call__(self) -> int:
        return wall_clock_ms() + self.offset_ms


class Gate:
    """Holds the ``wait`` step open until the test releases it; counts its runs."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.released = anyio.Event()
        self.runs = 0


class Empty(BaseModel):
    pass


@step("wait")
async def wait_step(ctx: StepContext, arg: Empty) -> str:
    """Idempotency: only waits; the test counts its runs."""
    gate = ctx.resource(Gate)
    gate.runs += 1
    gate.entered.set()
    await gate.released.wait()
    return "done"


registry = Registry()


@registry.workflow("wait", version=1)
async def wait_workflow(ctx: WorkflowContext, arg: Empty) -> str:
    return await ctx.step(wait_step, arg)


@pytest.fixture
def journal(journal_location: Path | str) -> Path | str:
    return journal_location


async def engine_over(
    journal: Path | str, *, wall: SteppedWall | None = None, gate: Gate | None = None
) -> WorkflowEngine:
    """A second engine on the journal, as another process would open it."""
    database = await Database.open(journal)
    store = JobStore(database, clock=wall) if wall else JobStore(database)
    return WorkflowEngine(
        store,
        registry,
        lease=LeaseSettings(lease_s=1.0, heartbeat_s=0.05),
        resources=[gate] if gate else [],
    )


@pytest.fixture
async def owner(journal: Path | str) -> AsyncIterator[tuple[WorkflowEngine, Gate]]:
    gate = Gate()
    engine = await engine_over(journal, gate=gate)
    try:
        yield engine, gate
    finally:
        await engine.close()


@pytest.mark.anyio
@pytest.mark.parametrize("step_ms", STEPS_MS)
async def test_a_wall_clock_step_does_not_recover_a_live_heartbeating_job(
    journal: Path | str, owner: tuple[WorkflowEngine, Gate], step_ms: int
) -> None:
    engine, gate = owner
    submitted = await engine.submit(wait_workflow, Empty())
    observer = await engine_over(journal, wall=SteppedWall(step_ms))
    try:
        async with anyio.create_task_group() as group:
            finished: list[Any] = []

            async def run() -> None:
                finished.append(await engine.join(submitted.job.id))

            group.start_soon(run)
            with anyio.fail_after(10):
                await gate.entered.wait()
            # Past one lease length: only heartbeats keep the lease, and they do.
            deadline = anyio.current_time() + 1.5
            while anyio.current_time() < deadline:
                assert await observer.recover() == []
                await anyio.sleep(0.1)
            gate.released.set()
        (job,) = finished
        assert (job.status, job.attempt, gate.runs) == (JobStatus.SUCCEEDED, 1, 1)
        events = await observer.store.events(job.id)
        queued = [e.data for e in events if e.type == "status" and e.data["status"] == "queued"]
        assert queued == [{"status": "queued"}]  # submitted, never re-queued
    finally:
        await observer.close()


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.anyio
@pytest.mark.parametrize("step_ms", STEPS_MS)
@pytest.mark.parametrize("death", ["lease lapses", "pid gone"])
async def test_a_wall_clock_step_still_recovers_a_dead_owners_job(
    journal: Path | str, owner: tuple[WorkflowEngine, Gate], step_ms: int, death: str
) -> None:
    engine, gate = owner
    submitted = await engine.submit(wait_workflow, Empty())
    if death == "lease lapses":
        # No check can prove this owner dead: only its lease lapsing frees the job.
        dead_owner = "unknown-boot/1/1/dead"
    else:
        me = WorkerIdentity.current()
        dead_owner = f"{me.boot_id}/{dead_pid()}/{me.start_ticks}/dead"
    assert await engine.store.claim(owner=dead_owner, lease_ms=300) is not None
    observer = await engine_over(journal, wall=SteppedWall(step_ms), gate=gate)
    try:
        if death == "lease lapses":
            await anyio.sleep(0.4)  # real time, on the monotonic clock
        assert await observer.recover() == [submitted.job.id]
        gate.released.set()
        with anyio.fail_after(10):
            job = await observer.join(submitted.job.id, poll_s=0.05)
        assert (job.status, job.attempt, gate.runs) == (JobStatus.SUCCEEDED, 2, 1)
    finally:
        await observer.close()


# --- real processes, wall clock stepped by faketime ------------------------------------------

FAKETIME = shutil.which("faketime")
if FAKETIME is None and tools_required():
    raise RuntimeError("SBPROXY_REQUIRE_TOOLS=1 but faketime(1) is not installed")
needs_faketime = pytest.mark.skipif(
    FAKETIME is None,
    reason="faketime(1) is not installed (apt-get install faketime); the injected-clock "
    "tests above prove the same rule",
)


FLOW = (sys.executable, "-m", "tests.workflows.leaseflow")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SBPROXY_FAULT", "FAKETIME"))}


def start_owner(tmp: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FLOW, "own", str(tmp / "j.db"), str(tmp / "gate")],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def observe_stepped(tmp: Path, offset: str) -> dict[str, Any]:
    """One recovery pass in a process whose wall clock ``faketime`` stepped by ``offset``.

    Only the wall clock: an NTP step never moves ``CLOCK_MONOTONIC``, so neither does this
    (libfaketime moves every clock unless told not to).
    """
    assert FAKETIME is not None
    env = {**clean_env(), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    done = subprocess.run(
        [FAKETIME, "-f", offset, *FLOW, "observe", str(tmp / "j.db")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def wait_until_holding(tmp: Path, owner: subprocess.Popen[str]) -> str:
    """The job id once the owner runs its step."""
    assert owner.stdout is not None
    job_id = owner.stdout.readline().split()[1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with sqlite3.connect(tmp / "j.db") as raw:
            row = raw.execute("SELECT status FROM steps WHERE job_id = ?", (job_id,)).fetchone()
        if row == ("running",):
            return job_id
        assert owner.poll() is None, owner.communicate()
        time.sleep(0.05)
    raise AssertionError("the owner never started its step")


def assert_stepped(result: dict[str, Any], offset_ms: int) -> None:
    """The observer really ran with its wall clock ``offset_ms`` away from ours."""
    assert abs(result["wall_ms"] - (wall_clock_ms() + offset_ms)) < 60_000, result


@pytest.mark.slow
@needs_faketime
def test_an_observer_an_hour_ahead_does_not_take_a_live_owners_job(tmp_path: Path) -> None:
    with start_owner(tmp_path) as owner:
        try:
            job_id = wait_until_holding(tmp_path, owner)
            first = observe_stepped(tmp_path, "+1h")
            assert_stepped(first, HOUR_MS)
            assert first["requeued"] == []
            time.sleep(leaseflow.LEASE_S)  # the lease the owner first took is over by now
            assert observe_stepped(tmp_path, "+1h")["requeued"] == []
            (tmp_path / "gate").touch()
            stdout, stderr = owner.communicate(timeout=60)
        finally:
            owner.kill()
    assert owner.returncode == 0, stderr
    job = json.loads(stdout.splitlines()[-1])
    assert (job["id"], job["status"], job["attempt"]) == (job_id, "succeeded", 1)


@pytest.mark.slow
@needs_faketime
def test_an_observer_an_hour_behind_still_takes_a_dead_owners_job(tmp_path: Path) -> None:
    with start_owner(tmp_path) as owner:
        try:
            job_id = wait_until_holding(tmp_path, owner)
        finally:
            owner.send_signal(signal.SIGKILL)
    assert owner.returncode == -signal.SIGKILL
    time.sleep(leaseflow.LEASE_S + 0.5)
    result = observe_stepped(tmp_path, "-1h")
    assert_stepped(result, -HOUR_MS)
    assert result["requeued"] == [job_id]

    (tmp_path / "gate").touch()
    with start_owner(tmp_path) as resumed:
        stdout, stderr = resumed.communicate(timeout=60)
    assert resumed.returncode == 0, stderr
    job = json.loads(stdout.splitlines()[-1])
    assert (job["id"], job["status"], job["attempt"]) == (job_id, "succeeded", 2)
