"""What durability costs: journaled steps per second under ``synchronous=FULL`` and ``NORMAL``.

Runs N jobs of K trivial steps through the real engine (submit, claim, replay-aware
``ctx.step``, lease heartbeat, finish) on a fresh journal per mode, one job at a time, and
prints ONE JSON object on stdout:

* ``durable_steps_per_s``: journaled steps per wall-clock second over the measured jobs
  (submit and claim/finish commits included, so this is the end-to-end rate);
* ``step_overhead_ms``: each ``ctx.step`` call timed from inside the workflow. A trivial step
  does no work, so this is the journal's cost per step: two ``BEGIN IMMEDIATE`` commits
  (step started, with the cancellation check in the same transaction; output recorded);
* ``job_ms``: submit to finished, per job;
* ``raw_sqlite_commit_ms``: a one-row commit through the stdlib driver with the same
  pragmas, the floor that fsync sets (the rest of a step's cost is the async stack);
* ``full_over_normal``: how much slower FULL is than NORMAL on each figure.

Usage: ``python benchmarks/journal.py [--jobs 40] [--steps 5] [--warmup 2] [--dir PATH]``.
Durability costs depend on the file system under ``--dir`` (tmpfs makes fsync free), so the
output names it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, get_args

import anyio
from pydantic import BaseModel

from sbproxy.store import Synchronous
from sbproxy.workflows import Registry, StepContext, WorkflowContext, WorkflowEngine, step

registry = Registry()

# Filled by the workflow body: the duration of every ctx.step call, in seconds.
_step_timings: list[float] = []


class BenchInput(BaseModel):
    steps: int


@step("bench")
async def trivial(ctx: StepContext, value: int) -> int:
    """Do nothing but return a value, so only the journal's cost is measured.

    Idempotency: pure.
    """
    return value + 1


@registry.workflow("bench", version=1)
async def bench(ctx: WorkflowContext, arg: BenchInput) -> int:
    value = 0
    for index in range(arg.steps):
        started = time.perf_counter()
        value = await ctx.step(trivial, value, name=f"bench:{index}")
        _step_timings.append(time.perf_counter() - started)
    return value


def _percentile(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def _summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [value * 1000 for value in seconds]
    return {
        "p50": round(_percentile(ms, 50), 3),
        "p99": round(_percentile(ms, 99), 3),
        "mean": round(statistics.fmean(ms), 3),
        "max": round(max(ms), 3),
    }


async def _run_mode(mode: Synchronous, *, jobs: int, steps: int, warmup: int, base: Path) -> Any:
    with tempfile.TemporaryDirectory(prefix=f"journal-{mode.lower()}-", dir=base) as tmp:
        engine = await WorkflowEngine.open(Path(tmp) / "journal.db", registry, synchronous=mode)
        try:
            for _ in range(warmup):
                submitted = await engine.submit(bench, BenchInput(steps=steps))
                await engine.join(submitted.job.id)
            _step_timings.clear()
            job_times: list[float] = []
            wall_started = time.perf_counter()
            for _ in range(jobs):
                started = time.perf_counter()
                submitted = await engine.submit(bench, BenchInput(steps=steps))
                job = await engine.join(submitted.job.id)
                job_times.append(time.perf_counter() - started)
                assert job.status == "succeeded", job.to_dict()
            wall_s = time.perf_counter() - wall_started
        finally:
            await engine.close()
    step_times = list(_step_timings)
    assert len(step_times) == jobs * steps
    return {
        "synchronous": mode,
        "jobs": jobs,
        "steps_per_job": steps,
        "durable_steps": jobs * steps,
        "wall_s": round(wall_s, 3),
        "durable_steps_per_s": round(jobs * steps / wall_s, 1),
        "step_overhead_ms": _summary_ms(step_times),
        "job_ms": _summary_ms(job_times),
    }


def _raw_commit_ms(mode: str, *, base: Path, commits: int = 300) -> dict[str, float]:
    """The floor: one-row ``BEGIN IMMEDIATE`` commits through the stdlib driver, same pragmas.

    The gap between this and ``step_overhead_ms`` / 2 is the async stack's cost per commit.
    """
    with tempfile.TemporaryDirectory(prefix=f"raw-{mode.lower()}-", dir=base) as tmp:
        connection = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={mode}")
            connection.execute("CREATE TABLE t (n INTEGER)")
            timings = []
            for index in range(commits):
                started = time.perf_counter()
                connection.execute("BEGIN IMMEDIATE")
                connection.execute("INSERT INTO t VALUES (?)", (index,))
                connection.execute("COMMIT")
                timings.append(time.perf_counter() - started)
        finally:
            connection.close()
    return _summary_ms(timings)


def _filesystem(path: Path) -> str | None:
    """The type of the file system holding ``path`` (Linux ``/proc/mounts``), if known."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best: tuple[int, str] | None = None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > best[0]):
            best = (len(mount_point), fields[2])
    return best[1] if best else None


def _ratio(slow: float, fast: float) -> float | None:
    return round(slow / fast, 2) if fast else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=40, help="measured jobs per mode")
    parser.add_argument("--steps", type=int, default=5, help="trivial steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured jobs first")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the temporary journals live (its file system decides fsync cost)",
    )
    args = parser.parse_args()
    if args.jobs < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--jobs and --steps must be at least 1, --warmup at least 0")

    results = {}
    for mode in get_args(Synchronous):
        run = partial(_run_mode, mode, jobs=args.jobs, steps=args.steps, warmup=args.warmup)
        results[mode] = anyio.run(partial(run, base=args.dir))
        results[mode]["raw_sqlite_commit_ms"] = _raw_commit_ms(mode, base=args.dir)
    full, normal = results["FULL"], results["NORMAL"]
    report = {
        "benchmark": "journal",
        "engine": "sbproxy.workflows.WorkflowEngine.join, one job at a time",
        "modes": [full, normal],
        "full_over_normal": {
            "step_overhead_p50": _ratio(
                full["step_overhead_ms"]["p50"], normal["step_overhead_ms"]["p50"]
            ),
            "step_overhead_p99": _ratio(
                full["step_overhead_ms"]["p99"], normal["step_overhead_ms"]["p99"]
            ),
            "wall_time": _ratio(full["wall_s"], normal["wall_s"]),
            "steps_per_s_normal_over_full": _ratio(
                normal["durable_steps_per_s"], full["durable_steps_per_s"]
            ),
            "raw_commit_p50": _ratio(
                full["raw_sqlite_commit_ms"]["p50"], normal["raw_sqlite_commit_ms"]["p50"]
            ),
        },
        "environment": {
            "sqlite_version": sqlite3.sqlite_version,
            "python": sys.version.split()[0],
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(),
            "journal_dir": str(args.dir),
            "journal_filesystem": _filesystem(args.dir),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
