"""How long the ``sbproxy`` CLI takes to start, against ``python -c "import click"``.

Times whole processes, from spawn to exit, interleaved so that drift in the machine hits
every command alike (each round runs every command once, in a rotated order):

* ``python -c pass``: the interpreter's own start-up, the floor;
* ``python -c "import click"``: the yardstick every ratio divides by;
* ``sbproxy --help``: the verb table (goal: at most 3x ``import click``);
* ``sbproxy models list``: the built-in catalog resolved for this machine, with its cache
  status (goal: at most 5x);
* ``sbproxy jobs list``: the jobs of a journal (goal: at most 5x);
* ``sbproxy config validate -f examples/model-host-managed/sb.yml`` (goal: at most 5x).

``sbproxy`` is the virtual environment's console script (``<venv>/bin/sbproxy``, beside the
running interpreter), as an installed CLI is run. Every run uses one prepared cache root
(``SBPROXY_CACHE_DIR``, a temporary directory) whose journal holds a few jobs: succeeded,
failed, queued, and one running under an owner that is gone (stale, so ``jobs list`` judges
staleness and reads its steps). The package's bytecode is compiled once before the runs, as
installing a wheel does.

Prints ONE JSON object on stdout: per command the median, p10/p90, min/max and every run in
seconds, its ratio to ``import click`` (median over median), its goal and whether it meets
it; then the environment. On the shared 2-core machines, use many runs (``--runs 30``) and
compare ratios within one run.

Usage: ``python benchmarks/cli.py [--runs 20]``, from the repository root with the project's
virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from sbproxy.store import Database, ErrorInfo, JobStatus, JobStore

ROOT = Path(__file__).resolve().parents[1]
SBPROXY = Path(sys.executable).parent / "sbproxy"
CONFIG = ROOT / "examples" / "model-host-managed" / "sb.yml"
# A lease owner on this boot whose pid cannot exist (above pid_max): certainly gone.
GONE_OWNER_PID = 4_194_305

# Command name -> (argv, goal as a ratio to `import click`, or None for reference rows).
COMMANDS: dict[str, tuple[list[str], float | None]] = {
    "python_pass": ([sys.executable, "-c", "pass"], None),
    "import_click": ([sys.executable, "-c", "import click"], None),
    "help": ([str(SBPROXY), "--help"], 3.0),
    "models_list": ([str(SBPROXY), "models", "list"], 5.0),
    "jobs_list": ([str(SBPROXY), "jobs", "list"], 5.0),
    "config_validate": ([str(SBPROXY), "config", "validate", "-f", str(CONFIG)], 5.0),
}
BASELINE = "import_click"


async def _fill_journal(journal: Path) -> None:
    """A few jobs in every state ``jobs list`` shows, one of them stale."""
    from sbproxy.store import boot_id

    database = await Database.open(journal)
    store = JobStore(database)
    try:
        for index, outcome in enumerate(
            (JobStatus.SUCCEEDED, JobStatus.SUCCEEDED, JobStatus.FAILED, None, "stale")
        ):
            submitted = await store.submit(
                kind="pull",
                workflow_version=1,
                input_json=json.dumps({"n": index}),
                idempotency_key=f"bench-{index}",
                subject=f"artifact:sha256:{index:064x}",
            )
            if outcome is None:
                continue  # stays queued
            job_id = submitted.job.id
            owner = f"{boot_id()}/{GONE_OWNER_PID}/1/bench" if outcome == "stale" else "bench-owner"
            claimed = await store.claim(owner=owner, lease_ms=60_000, job_id=job_id)
            assert claimed is not None
            await store.begin_step(job_id, owner=owner, attempt=claimed.attempt, seq=0, name="plan")
            await store.end_step(
                job_id, owner=owner, attempt=claimed.attempt, seq=0, name="plan", output_json="1"
            )
            await store.report_progress(
                job_id,
                owner=owner,
                attempt=claimed.attempt,
                progress={"done": 5, "total": 10, "unit": "bytes"},
                event=True,
            )
            if isinstance(outcome, JobStatus):
                failed = outcome == JobStatus.FAILED
                error = ErrorInfo("bench_failure", "failed on purpose") if failed else None
                await store.finish(
                    job_id,
                    owner=owner,
                    attempt=claimed.attempt,
                    status=outcome,
                    output_json=None if error else "{}",
                    error=error,
                )
    finally:
        await database.close()


def prepare(cache: Path) -> dict[str, str]:
    """The cache root's journal, and the environment every command runs with."""
    anyio.run(_fill_journal, cache / "jobs" / "journal.db")
    dropped = {"SB_CONFIG_FILE", "SBPROXY_CACHE_DIR", "SBPROXY_FAULT_POINTS"}
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env["SBPROXY_CACHE_DIR"] = str(cache)
    env["SB_ADMIN_PASSWORD"] = "bench-password"  # noqa: S105 - the example interpolates it
    return env


def time_once(argv: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=False)  # noqa: S603 - fixed argv
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()}")
    return elapsed


def _quantile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summarise(runs: dict[str, list[float]]) -> dict[str, Any]:
    baseline = statistics.median(runs[BASELINE])
    out: dict[str, Any] = {}
    for name, seconds in runs.items():
        median = statistics.median(seconds)
        argv, goal = COMMANDS[name]
        ratio = median / baseline
        out[name] = {
            "argv": " ".join([Path(argv[0]).name, *argv[1:]]),
            "median_s": round(median, 4),
            "p10_s": round(_quantile(seconds, 0.1), 4),
            "p90_s": round(_quantile(seconds, 0.9), 4),
            "min_s": round(min(seconds), 4),
            "max_s": round(max(seconds), 4),
            "ratio_to_import_click": round(ratio, 2),
            "goal_ratio": goal,
            "meets_goal": None if goal is None else ratio <= goal,
            "runs_s": [round(s, 4) for s in seconds],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    args = parser.parse_args()

    subprocess.run(  # noqa: S603 - our own fixed argv
        [sys.executable, "-m", "compileall", "-q", str(ROOT / "sbproxy")], check=True
    )
    runs: dict[str, list[float]] = {name: [] for name in COMMANDS}
    names = list(COMMANDS)
    with tempfile.TemporaryDirectory(prefix="sbproxy-cli-bench-") as temp:
        env = prepare(Path(temp) / "cache")
        for round_index in range(args.warmup + args.runs):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed = time_once(COMMANDS[name][0], env)
                if round_index >= args.warmup:
                    runs[name].append(elapsed)

    commands = summarise(runs)
    report: dict[str, Any] = {
        "benchmark": "cli",
        "runs_each": args.runs,
        "sbproxy": f"{SBPROXY} (the virtual environment's console script)",
        "bytecode": "sbproxy compiled before the runs (compileall), as a wheel install does",
        "journal": "5 jobs: 2 succeeded, 1 failed, 1 queued, 1 running under a gone owner",
        "commands": commands,
        "all_goals_met": all(c["meets_goal"] is not False for c in commands.values()),
        "environment": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
