"""What the benchmarks' ``--baseline-commit`` comparisons share (``pull.py``, ``proxy.py``,
``stream.py``): naming the checkout and the baselines, extracting a commit's ``sbproxy``
package with ``git archive`` so that it runs under this interpreter beside the current one,
and the spread of per-round ratios.

Imported by the scripts as ``baseline`` (``python benchmarks/<script>.py`` puts this
directory first on ``sys.path``).
"""

from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """``git -C <repository root> ARGS``'s standard output, stripped."""
    return subprocess.run(  # noqa: S603 - git on PATH, our arguments
        ["git", "-C", str(ROOT), *args],  # noqa: S607
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def checkout(revisions: Sequence[str]) -> tuple[str, bool, dict[str, str]]:
    """``(HEAD's short hash, whether tracked files differ from it, short hash -> revision as
    given)`` for the baselines ``revisions``."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return head, dirty, {git("rev-parse", "--short", rev): rev for rev in revisions}


def compile_package(directory: Path = ROOT) -> None:
    """Compile the bytecode of ``directory``'s ``sbproxy`` package (``__pycache__``, ignored
    by git), as a wheel install does; by default this checkout's."""
    subprocess.run(  # noqa: S603 - this interpreter, our arguments
        [sys.executable, "-m", "compileall", "-q", str(directory / "sbproxy")], check=True
    )


def extract(
    rev: str, directory: Path, *, compile_bytecode: bool = False, imports: Sequence[str] = ()
) -> Path:
    """``rev``'s ``sbproxy`` package, extracted into ``directory`` (which is returned).

    With ``compile_bytecode`` its bytecode is compiled, as a wheel install does. With
    ``imports``, those modules must import from it under this interpreter, else the script
    exits naming what is missing (an older commit may need packages since dropped).
    """
    archive = subprocess.run(  # noqa: S603 - git on PATH, our arguments
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "sbproxy"],  # noqa: S607
        capture_output=True,
        check=True,
    ).stdout
    directory.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    if compile_bytecode:
        compile_package(directory)
    if imports:
        probe = subprocess.run(  # noqa: S603 - this interpreter, our arguments
            [sys.executable, "-c", f"import {', '.join(imports)}"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(directory)},
            cwd=directory,
            check=False,
        )
        if probe.returncode != 0:
            raise SystemExit(
                f"commit {rev} cannot be imported with this environment ({sys.executable}); "
                "install what it needs beside the current dependencies (an older commit may "
                f"use packages since dropped):\n{probe.stderr[-2000:]}"
            )
    return directory


def spread(values: list[float], *, per: str = "per_round") -> dict[str, Any]:
    """``values`` rounded to 3 places under ``per``, with their median, min and max."""
    return {
        per: [round(v, 3) for v in values],
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }
