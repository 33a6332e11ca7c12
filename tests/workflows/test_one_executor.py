"""Only a worker runs jobs; everyone else submits and joins. In a process with a worker loop
for the job's kind the loop runs it and ``join`` only waits; in a process without one (a CLI
process, the runtime's ordered lanes) ``join`` runs it in the process's own worker. No code
outside the engine runs a job any other way."""

from __future__ import annotations

import ast
from pathlib import Path

import anyio
import pytest

from sbproxy.store import JobStatus
from tests.workflows.test_engine import Count, open_engine, two_step_registry

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.anyio
async def test_with_a_worker_loop_join_only_waits_and_the_loop_runs_the_job(
    tmp_path: Path,
) -> None:
    registry = two_step_registry()
    engine = await open_engine(tmp_path / "journal.db", registry)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run_worker)
            await anyio.sleep(0)  # the loop registers the kinds it takes
            submitted = await engine.submit(registry.get("pair"), Count(n=1))  # type: ignore[arg-type]
            with anyio.fail_after(10):
                job = await engine.join(submitted.job.id)
            group.cancel_scope.cancel()
    finally:
        await engine.close()
    assert job.status == JobStatus.SUCCEEDED
    assert engine.executions == {"worker": 1, "joined": 1}


@pytest.mark.anyio
async def test_without_a_worker_loop_join_runs_the_job_in_its_own_worker(tmp_path: Path) -> None:
    registry = two_step_registry()
    engine = await open_engine(tmp_path / "journal.db", registry)
    try:
        submitted = await engine.submit(registry.get("pair"), Count(n=1))  # type: ignore[arg-type]
        job = await engine.join(submitted.job.id)
    finally:
        await engine.close()
    assert job.status == JobStatus.SUCCEEDED
    assert engine.executions == {"own": 1}


def test_no_code_outside_the_engine_runs_a_job_itself() -> None:
    """Executing a job is the engine's: ``execute`` (workflows/executor.py) is called only by
    workflows/engine.py, and nothing calls the engine's private runners or a ``run_job``."""
    offenders = []
    for path in sorted((ROOT / "sbproxy").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
            if isinstance(node, ast.ImportFrom) and node.module == "sbproxy.workflows.executor":
                if relative not in ("sbproxy/workflows/engine.py", "sbproxy/workflows/__init__.py"):
                    offenders.append(f"{relative}:{node.lineno} imports the executor")
                continue
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            runs = name in ("_run_here", "_execute", "run_job")
            if runs and relative != "sbproxy/workflows/engine.py":
                offenders.append(f"{relative}:{node.lineno} calls {name}()")
    assert offenders == []
