"""``sbproxy jobs show``, ``watch``, ``cancel`` and ``retry``: the verbs that open the engine.

They open the journal through :class:`~sbproxy.workflows.WorkflowEngine` (the full store,
migrations included) with the model host's workflow registry, so ``retry`` can run a job of a
kind this process knows. The group, its options and ``list`` are in ``jobs_cmd``; see there
for the exit statuses.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import click
from ulid import ULID

from sbproxy.cli._event_view import open_view
from sbproxy.cli._job_text import (
    RUNTIME_KINDS,
    job_outcome_line,
    last_error,
    resume_hint,
    show_lines,
    stale_text,
)
from sbproxy.cli._jobs_common import job_json, journal_choice, journal_options
from sbproxy.cli._live import follow, run_followed
from sbproxy.cli._options import JournalChoice
from sbproxy.cli._output import (
    EXIT_RUNTIME,
    emit_json,
    fail,
    format_option,
    interrupted,
)
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.artifacts.locks import serving_host
from sbproxy.model_host.flows import registry
from sbproxy.store import (
    JobRecord,
    JobStatus,
    StepRecord,
    StepStatus,
    wall_clock_ms,
)
from sbproxy.workflows import Staleness, WorkflowEngine

__all__ = [
    "cancel_command",
    "list_with_engine",
    "retry_command",
    "show_command",
    "watch_command",
]

RETRYABLE_STATUSES = frozenset({JobStatus.FAILED, JobStatus.PARKED})

job_id_argument = click.argument("job_id", metavar="ID")


def _parse_job_id(value: str) -> str:
    """The canonical (upper-case) ULID text of ``value``.

    Raises:
        SbproxyError: ``invalid_job_id`` when ``value`` is not a ULID.
    """
    try:
        return str(ULID.from_str(value.strip()))
    except ValueError:
        raise SbproxyError(
            f"{value!r} is not a job id (expected a ULID).",
            code="invalid_job_id",
            remediation="`sbproxy jobs list` shows the ids.",
        ) from None


def _require_journal(journal: JournalChoice) -> None:
    """Refuse to go on (and to create the file) when nothing has run with this cache root.

    Raises:
        SbproxyError: ``no_job_journal``.
    """
    if journal.on_postgres:
        return  # a PostgreSQL journal, which whoever used it first created
    if not journal.layout.journal.is_file():
        raise SbproxyError(
            f"no job journal at {journal.layout.journal}; nothing has run with this cache "
            "directory.",
            code="no_job_journal",
            remediation="Pass the --cache-dir (or -f config) that the server uses.",
            details={"journal": str(journal.layout.journal)},
        )


@asynccontextmanager
async def _engine(journal: JournalChoice) -> AsyncIterator[WorkflowEngine]:
    """The workflow engine over ``journal`` with what this process's workflows need: the
    artifact cache the journal belongs to, as ``models pull`` has it, so that a retried pull
    (or import, remove, gc) runs here; on PostgreSQL its jobs record the cache's node."""
    cache = ArtifactCache(journal.layout)
    engine = await WorkflowEngine.open(
        journal.location, registry, resources=[cache], node=journal.node()
    )
    try:
        yield engine
    finally:
        await engine.close()


def _run(command: str, output_format: str, work: Callable[[], Awaitable[int]]) -> None:
    """Run ``work`` on an event loop and exit with its status; map errors to exit codes."""
    try:
        status = anyio.run(work)
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)
    except KeyboardInterrupt:
        interrupted(command)
    if status:
        sys.exit(status)


def _outcome_status(job: JobRecord) -> int:
    return 0 if job.status == JobStatus.SUCCEEDED else EXIT_RUNTIME


def _completed_prefix(steps: Sequence[StepRecord]) -> int:
    """How many steps, from the first, have a recorded output (a retry replays those)."""
    done = 0
    for record in steps:
        if record.status != StepStatus.SUCCEEDED:
            break
        done += 1
    return done


async def _stale_of(engine: WorkflowEngine, jobs: Sequence[JobRecord]) -> dict[str, Staleness]:
    """The stale ones among ``jobs``, by id."""
    found = {}
    for job in jobs:
        stale = await engine.staleness(job)
        if stale is not None:
            found[job.id] = stale
    return found


def _report_outcome(command: str, job: JobRecord, output_format: str, **extra: object) -> int:
    if output_format == "json":
        emit_json(command, {"job": job.to_dict(), **extra})
    else:
        click.echo(job_outcome_line(job))
    return _outcome_status(job)


def list_with_engine(
    command: str,
    output_format: str,
    journal: JournalChoice,
    *,
    statuses: Sequence[JobStatus],
    kind: str | None,
    limit: int,
) -> tuple[list[JobRecord], dict[str, Staleness]]:
    """``jobs list`` through the full store, where :class:`~sbproxy.store.JournalReader`
    declines (an older schema to migrate, a damaged or unwritable file ...): the listed jobs
    and the stale ones among them, or exit as :func:`_run` does."""
    listing: tuple[list[JobRecord], dict[str, Staleness]] = ([], {})

    async def work() -> int:
        nonlocal listing
        async with _engine(journal) as engine:
            jobs = await engine.store.list_jobs(statuses=statuses, kind=kind, limit=limit)
            listing = (jobs, await _stale_of(engine, jobs))
        return 0

    _run(command, output_format, work)
    return listing


# --- verbs ----------------------------------------------------------------------------------


@click.command("show")
@job_id_argument
@journal_options
@format_option
def show_command(
    *, job_id: str, cache_dir: Path | None, config_path: Path | None, output_format: str
) -> None:
    """Show one job: its state, progress, last error and every journaled step.

    A stale job also gets a ``stale`` line: how long it has been silent, why, its last step
    and owner, and what resumes it.
    """
    command = "jobs.show"
    journal = journal_choice(command, cache_dir, config_path, output_format)

    async def work() -> int:
        wanted = _parse_job_id(job_id)
        _require_journal(journal)
        async with _engine(journal) as engine:
            job = await engine.get(wanted)
            steps = await engine.steps(wanted)
            stale = await engine.staleness(job)
        if output_format == "json":
            emit_json(
                command,
                {
                    "job": job_json(job, stale),
                    "steps": [record.to_dict() for record in steps],
                    "last_error": last_error(job, steps),
                },
            )
        else:
            lease_now = engine.store.lease_clock()
            lines = show_lines(job, steps, now_ms=wall_clock_ms(), lease_now=lease_now, stale=stale)
            for line in lines:
                click.echo(line)
        return 0

    _run(command, output_format, work)


@click.command("watch")
@job_id_argument
@journal_options
@format_option
def watch_command(
    *, job_id: str, cache_dir: Path | None, config_path: Path | None, output_format: str
) -> None:
    """Follow a job until it finishes or is parked, whichever process runs it.

    Progress, step and status lines go to stderr (a live bar on a terminal). At the end the
    job's outcome goes to stdout (the whole job with --format json). Exit status 0 when it
    succeeded, 1 when it failed, was cancelled or was parked.

    A job that is (or goes) stale -- running, but nobody runs it: its owner died or its
    lease lapsed -- gets one line on stderr saying so and what resumes it; the watch goes on
    and follows the resumed run.
    """
    command = "jobs.watch"
    journal = journal_choice(command, cache_dir, config_path, output_format)

    async def work() -> int:
        wanted = _parse_job_id(job_id)
        _require_journal(journal)
        async with _engine(journal) as engine:
            await engine.get(wanted)
            view = open_view(wanted, live_from_ms=wall_clock_ms())
            announced: set[int] = set()  # claim attempts already said to be stale

            async def say_if_stale(job: JobRecord) -> None:
                if job.attempt in announced:
                    return
                stale = await engine.staleness(job)
                if stale is not None:
                    announced.add(job.attempt)
                    view.line(
                        f"{job.id}: stale, {stale_text(stale)}; {resume_hint(job.kind)} "
                        "(still watching)"
                    )

            await follow(engine, wanted, after_seq=0, view=view, on_idle=say_if_stale)
            job = await engine.get(wanted)
        return _report_outcome(command, job, output_format)

    _run(command, output_format, work)


@click.command("cancel")
@job_id_argument
@journal_options
@format_option
def cancel_command(
    *, job_id: str, cache_dir: Path | None, config_path: Path | None, output_format: str
) -> None:
    """Cancel a job: queued and parked jobs at once, a running one at its next step boundary.

    Prints the job after the request. A job that already finished is left as it is.
    """
    command = "jobs.cancel"
    journal = journal_choice(command, cache_dir, config_path, output_format)

    async def work() -> int:
        wanted = _parse_job_id(job_id)
        _require_journal(journal)
        async with _engine(journal) as engine:
            before = await engine.get(wanted)
            job = await engine.cancel(wanted)
        if output_format == "json":
            emit_json(command, {"job": job.to_dict()})
        elif before.terminal:
            click.echo(f"{job.id}: already {job.status.value}; nothing to cancel")
        elif job.status == JobStatus.CANCELLED:
            click.echo(f"{job.id}: cancelled")
        else:
            click.echo(
                f"{job.id}: cancellation requested; the running job stops at its next check "
                f"(`sbproxy jobs watch {job.id}` follows it)"
            )
        return 0

    _run(command, output_format, work)


@click.command("retry")
@job_id_argument
@click.option(
    "--detach",
    is_flag=True,
    help="Only queue the job for a running `sbproxy serve` worker; do not run it here.",
)
@journal_options
@format_option
def retry_command(
    *,
    job_id: str,
    detach: bool,
    cache_dir: Path | None,
    config_path: Path | None,
    output_format: str,
) -> None:
    """Re-queue a failed or parked job; it resumes after its last completed step.

    When this process knows the job's workflow (and without --detach) the job runs here,
    with progress on stderr, and the exit status is its outcome as for `jobs watch`.
    Otherwise it waits in the queue for the `sbproxy serve` of this cache, which takes it at
    once (a deployment's load, drain or reset always runs there: its engines are that
    host's). A job that is still queued or running is not an error: it is run here (or
    followed), or with --detach its state is printed. Exit status 2 if the job finished
    (succeeded or cancelled).
    """
    command = "jobs.retry"
    journal = journal_choice(command, cache_dir, config_path, output_format)

    async def work() -> int:
        wanted = _parse_job_id(job_id)
        _require_journal(journal)
        async with _engine(journal) as engine:
            # Only what the new run writes is streamed; the history is `jobs show`'s job.
            after_seq = await engine.store.last_event_seq(wanted)
            job = await engine.get(wanted)
            unfinished = job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
            if not unfinished:
                job = await _requeue(engine, wanted)
            if detach or engine.registry.get(job.kind) is None:
                where = await _who_runs_it(engine, job, journal)
                if output_format == "json":
                    emit_json(command, {"job": job.to_dict(), "ran_here": False, **where})
                else:
                    click.echo(str(where["text"]))
                return 0
            # Unfinished already: run it here if it waits (or its owner died), else follow it.
            final = await run_followed(engine, job.id, after_seq=after_seq)
        return _report_outcome(command, final, output_format, ran_here=True)

    _run(command, output_format, work)


async def _who_runs_it(
    engine: WorkflowEngine, job: JobRecord, journal: JournalChoice
) -> dict[str, object]:
    """Where a job left in the journal (queued or running) is run from, for ``jobs retry``
    that does not run it here: ``{"text": one line, "serving_pid": pid or None}``."""
    steps = await engine.steps(job.id)
    done = _completed_prefix(steps)
    resume = f"after step {steps[done - 1].name}" if done else "from its start"
    watch = f"`sbproxy jobs watch {job.id}` follows it"
    pid = serving_host(journal.layout.root / "locks" / "host.lock")
    if job.status == JobStatus.RUNNING:
        stale = await engine.staleness(job)
        if stale is None:
            return {"text": f"{job.id}: already running ({watch})", "serving_pid": pid}
        state = f"running but stale ({stale_text(stale)})"
    else:
        state = "queued"
    if pid is not None:
        runner = f"the `sbproxy serve` of this cache (pid {pid}) resumes it {resume} now"
    elif job.kind in RUNTIME_KINDS:
        runner = f"no `sbproxy serve` runs on this cache: it resumes {resume} when one starts"
    else:
        runner = (
            f"no `sbproxy serve` runs on this cache: one resumes it {resume}, or run "
            f"`sbproxy jobs retry {job.id}` without --detach"
        )
    return {"text": f"{job.id}: {state}; {runner} ({watch})", "serving_pid": pid}


async def _requeue(engine: WorkflowEngine, job_id: str) -> JobRecord:
    """Retry ``job_id`` or explain why it cannot be.

    Raises:
        SbproxyError: ``job_not_retryable`` (not failed or parked), ``idempotency_key_taken``
            (a newer unfinished job holds its key, so it stays failed).
        JobNotFound: ``job_not_found``.
    """
    job = await engine.get(job_id)
    if job.status not in RETRYABLE_STATUSES:
        raise SbproxyError(
            f"job {job_id} is {job.status.value}; only failed or parked jobs can be retried",
            code="job_not_retryable",
            details={"job_id": job_id, "status": job.status.value},
        )
    retried = await engine.retry(job_id)
    if retried.status == JobStatus.QUEUED:
        return retried
    holder = (
        await engine.store.find_active(retried.idempotency_key) if retried.idempotency_key else None
    )
    if retried.status in RETRYABLE_STATUSES and holder is not None:
        raise SbproxyError(
            f"job {job_id} stays {retried.status.value}: its idempotency key is held by the "
            f"unfinished job {holder.id}.",
            code="idempotency_key_taken",
            remediation=f"Follow that job with `sbproxy jobs watch {holder.id}` instead.",
            details={"job_id": job_id, "holder": holder.id},
        )
    raise SbproxyError(
        f"job {job_id} is now {retried.status.value}; another process changed it first",
        code="job_not_retryable",
        details={"job_id": job_id, "status": retried.status.value},
    )
