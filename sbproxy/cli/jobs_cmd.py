"""``sbproxy jobs``: list, inspect, follow, cancel and retry durable jobs.

Every verb reads the journal the server's worker and other CLI processes write, so it sees
their jobs live and after restarts: the ``-f`` config's ``proxy.model_host.journal.url``, else
``$SBPROXY_JOURNAL_URL`` (PostgreSQL), else the SQLite file under the cache root
(``<cache>/jobs/journal.db``), chosen as ``serve`` chooses it (``_options.select_journal``).
A running job whose lease lapsed or whose owner died is *stale*: ``list`` and ``show`` mark
it (its age, why, last step, owner, and who resumes it; ``"stale"`` in JSON, ``null`` for any
other job), and ``watch`` says so once it meets one instead of waiting
silently. The cache root comes from ``--cache-dir``, else the ``-f`` config's
``proxy.model_host.cache.directory``, else the platform default (``resolve_cache_root``).

Exit status: 0 success; 1 a followed job ended failed, cancelled or parked (or the journal
could not be used); 2 bad input or a refusal: a malformed or unknown job id, an invalid config
or journal URL, no journal at the chosen cache root, a PostgreSQL journal that cannot be
reached or is newer than this sbproxy, or a retry of a job that is not failed or parked.

``list`` lives here with the group and reads the journal through the stdlib ``sqlite3``
(:class:`~sbproxy.store.JournalReader`), falling back to the full store only when that reader
declines; the verbs that follow or change jobs (``show``, ``watch``, ``cancel``, ``retry``) are
in ``jobs_control_cmd`` and are imported when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from sbproxy.cli._job_text import job_table
from sbproxy.cli._jobs_common import job_json, journal_choice, journal_options
from sbproxy.cli._lazy import LazyCommand, LazyGroup
from sbproxy.cli._output import emit_json, format_option
from sbproxy.store import (
    JobRecord,
    JobStatus,
    JournalReader,
    ReaderDeclined,
    journal_display,
    system_lease_time,
    wall_clock_ms,
)
from sbproxy.workflows import Staleness, stale_reason, staleness

__all__ = ["jobs_group"]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_LIST_LIMIT = 50

# The verbs that open the workflow engine are imported when they run (`jobs list` needs none
# of it), and `sbproxy jobs --help` imports none of them.
_VERBS = {
    "cancel": LazyCommand(
        "sbproxy.cli.jobs_control_cmd:cancel_command",
        "Cancel a job: queued and parked jobs at once, a running one at its next step boundary.",
    ),
    "retry": LazyCommand(
        "sbproxy.cli.jobs_control_cmd:retry_command",
        "Re-queue a failed or parked job; it resumes after its last completed step.",
    ),
    "show": LazyCommand(
        "sbproxy.cli.jobs_control_cmd:show_command",
        "Show one job: its state, progress, last error and every journaled step.",
    ),
    "watch": LazyCommand(
        "sbproxy.cli.jobs_control_cmd:watch_command",
        "Follow a job until it finishes or is parked, whichever process runs it.",
    ),
}


@click.group("jobs", cls=LazyGroup, lazy_commands=_VERBS)
def jobs_group() -> None:
    """Inspect and control durable jobs (pull, verify, prepare, warm, drain ...)."""


def _read_listing(
    journal: Path, statuses: Sequence[JobStatus], kind: str | None, limit: int
) -> tuple[list[JobRecord], dict[str, Staleness]]:
    """The listed jobs and the stale ones among them, read with :class:`JournalReader`.

    Judged as ``WorkflowEngine.staleness`` judges (lease-clock now per job, the journal of a
    job read only when it is stale); a test holds the output equal to the engine's.

    Raises:
        ReaderDeclined: the reader cannot answer; the full store must.
    """
    with JournalReader.open(journal) as reader:
        jobs = reader.list_jobs(statuses=statuses, kind=kind, limit=limit)
        found = {}
        for job in jobs:
            lease_now = system_lease_time()
            if stale_reason(job, lease_now=lease_now) is None:
                continue
            steps = reader.steps(job.id)
            stale = staleness(job, steps, lease_now=lease_now, now_ms=wall_clock_ms())
            if stale is not None:
                found[job.id] = stale
    return jobs, found


# --- verbs ----------------------------------------------------------------------------------


@jobs_group.command("list")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([status.value for status in JobStatus]),
    help="Only jobs in this state (repeatable).",
)
@click.option("--kind", default=None, help="Only jobs of this workflow kind (pull, verify ...).")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=DEFAULT_LIST_LIMIT,
    show_default=True,
    help="Most jobs to show, newest first.",
)
@journal_options
@format_option
def list_command(
    *,
    states: tuple[str, ...],
    kind: str | None,
    limit: int,
    cache_dir: Path | None,
    config_path: Path | None,
    output_format: str,
) -> None:
    """List jobs, newest first. A cache root where nothing has run lists none.

    A stale job (running, but its lease lapsed or its owner died) shows as ``running
    (stale)``, with a line after the table saying how long it has been silent, why, its last
    step and owner, and what resumes it.
    """
    command = "jobs.list"
    journal = journal_choice(command, cache_dir, config_path, output_format)
    location = journal.location
    statuses = tuple(JobStatus(state) for state in states)
    jobs: list[JobRecord] = []
    stale: dict[str, Staleness] = {}
    if journal.on_postgres:
        from sbproxy.cli.jobs_control_cmd import list_with_engine

        jobs, stale = list_with_engine(
            command, output_format, journal, statuses=statuses, kind=kind, limit=limit
        )
    elif journal.layout.journal.is_file():
        try:
            jobs, stale = _read_listing(journal.layout.journal, statuses, kind, limit)
        except ReaderDeclined:
            from sbproxy.cli.jobs_control_cmd import list_with_engine

            jobs, stale = list_with_engine(
                command, output_format, journal, statuses=statuses, kind=kind, limit=limit
            )
    if output_format == "json":
        listed = [job_json(j, stale.get(j.id)) for j in jobs]
        emit_json(command, {"journal": journal_display(location), "jobs": listed})
    elif jobs:
        for line in job_table(jobs, now_ms=wall_clock_ms(), stale=stale):
            click.echo(line)
    else:
        filters = [f"state {'|'.join(states)}"] if states else []
        filters += [f"kind {kind}"] if kind else []
        where = f" with {' and '.join(filters)}" if filters else ""
        click.echo(f"no jobs{where} in {journal_display(location)}")
