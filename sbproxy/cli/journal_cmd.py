"""``sbproxy journal``: the job journal itself (moving it to PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import anyio
import click

from sbproxy.cli._jobs_common import journal_options
from sbproxy.cli._options import load_cli_config, resolve_layout
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.locks import serving_host
from sbproxy.store import check_journal_url, journal_display

__all__ = ["journal_group"]


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
    from sbproxy.store.transfer import copy_journal

    command = "journal.migrate"
    # The source is this cache's SQLite file, whatever journal the config names.
    config = load_cli_config(command, config_path, output_format=output_format)
    source = resolve_layout(command, cache_dir, config, output_format=output_format).journal
    try:
        target = check_journal_url(target, source="--to (or $SBPROXY_JOURNAL_URL)")
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format)
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
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)
    where = journal_display(target)
    if output_format == "json":
        emit_json(command, {"from": str(source), "to": where, "rows": report.rows})
    else:
        counts = ", ".join(f"{count} {table}" for table, count in report.rows.items())
        click.echo(f"copied {source} to {where}: {counts}")
