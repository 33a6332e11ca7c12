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
(``SBPROXY_CACHE_DIR``, a temporary directory) whose journal holds ten jobs in every state
(``tests.support.journals``), two of them stale, so ``jobs list`` judges staleness and reads
their steps. The package's bytecode is compiled once before the runs, as installing a wheel
does.

Prints ONE JSON object on stdout: per command the median, p10/p90, min/max and every run in
seconds, its ratio to ``import click`` (median over median), its goal and whether it meets
it; then the environment. On the shared 2-core machines, use many runs (``--runs 30``) and
compare ratios within one run.

Usage: ``python benchmarks/cli.py [--runs 20]``, from the repository root with the project's
virtual environment (``python -m benchmarks.cli`` works too).
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

ROOT = Path(__file__).resolve().parents[1]
SBPROXY = Path(sys.executable).parent / "sbproxy"
CONFIG = ROOT / "examples" / "model-host-managed" / "sb.yml"

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
# Run from the repository root, where `tests` is importable.
_FILL = (
    "import sys, anyio, pathlib\n"
    "from tests.support.journals import fill_varied_journal\n"
    "anyio.run(fill_varied_journal, pathlib.Path(sys.argv[1]))\n"
)


def prepare(cache: Path) -> dict[str, str]:
    """The cache root's journal, and the environment every command runs with."""
    subprocess.run(  # noqa: S603 - our own fixed argv
        [sys.executable, "-c", _FILL, str(cache / "jobs" / "journal.db")], cwd=ROOT, check=True
    )
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
        "journal": "10 jobs in every state, 2 of them stale (tests.support.journals)",
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
