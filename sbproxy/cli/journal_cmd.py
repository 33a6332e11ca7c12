"""``sbproxy journal``: the job journal itself (moving it to PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from sbproxy.cli._jobs_common import journal_options, journal_path
from sbproxy.cli._output import EXIT_INVALID, EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.locks import serving_host
from sbproxy.store import journal_display

__all__ = ["journal_group"]

# Refusals that mean "not now / not there" (exit 2): fix the situation, run again.
_REFUSALS = frozenset(
    {
        "journal_in_use",
        "journal_not_empty",
        "journal_unavailable",
        "journal_schema_newer",
        "invalid_config",
    }
)


@click.group("journal")
def journal_group() -> None:
    """The job journal: move the SQLite journal of a cache into PostgreSQL."""


@journal_group.command("migrate")
@click.option(
    "--to",
    "target",
    required=True,
    envvar="SBPROXY_JOURNAL_URL",
    help="PostgreSQL URL of the (empty) target journal, postgresql://user@host:port/db "
    "(default: $SBPROXY_JOURNAL_URL). The password never appears in output.",
)
@journal_options
@format_option
def migrate_command(
    target: str,
    cache_dir: Path | None,
    config_path: Path | None,
    output_format: str,
) -> None:
    """Copy this cache's SQLite journal (jobs, steps, events, revisions, usage) into an empty
    PostgreSQL journal, in one transaction. Refused while a host serves the cache or a job
    holds a live lease (``journal_in_use``), or when the target holds jobs.

    Afterwards set ``proxy.model_host.journal.url`` (or ``$SBPROXY_JOURNAL_URL``); the SQLite
    file stays as it was (a backup).
    """
    from sbproxy.store.postgres import is_postgres_url
    from sbproxy.store.transfer import copy_journal

    command = "journal.migrate"
    source = journal_path(command, cache_dir, config_path, output_format)
    if not is_postgres_url(target):
        fail(
            command,
            SbproxyError(
                "--to must be a postgresql://user@host:port/dbname URL",
                code="invalid_config",
                remediation="Name the target PostgreSQL database.",
            ),
            output_format=output_format,
        )
    if not source.is_file():
        fail(
            command,
            SbproxyError(
                f"no job journal at {source}; nothing to migrate",
                code="no_job_journal",
                remediation="Pass the --cache-dir (or -f config) that the server uses.",
            ),
            output_format=output_format,
        )
    host = serving_host(source.parent.parent / "locks" / "host.lock")
    if host is not None:
        fail(
            command,
            SbproxyError(
                f"the journal {source} is in use: `sbproxy serve` (pid {host}) serves this cache",
                code="journal_in_use",
                remediation="Stop that host, then migrate.",
            ),
            output_format=output_format,
        )
    try:
        report = anyio.run(copy_journal, source, target)
    except SbproxyError as exc:
        code = EXIT_INVALID if exc.code in _REFUSALS else EXIT_RUNTIME
        fail(command, exc, output_format=output_format, exit_code=code)
    where = journal_display(target)
    if output_format == "json":
        emit_json(command, {"from": str(source), "to": where, "rows": report.rows})
    else:
        counts = ", ".join(f"{count} {table}" for table, count in report.rows.items())
        click.echo(f"copied {source} to {where}: {counts}")
