"""``sbproxy apply -f sb.yml``: validate a configuration here, then have the running server
reload it through the same transaction as its file watcher and ``SIGHUP``.

The file is validated locally first (every problem listed with its dotted path, exit 2,
nothing sent). Then ``POST /admin/reload`` with ``{"source": <absolute path>}``: the server
refuses (409 ``source_mismatch``) unless it was started from that very file, so what was
validated is what is applied. The server prepares the complete candidate before changing
any route; a refusal (``restart_required``, ``foundation_change``, a prepare failure) leaves
everything running as it was. Admin connection options as ``sbproxy models ps``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sbproxy.cli._output import EXIT_INVALID, emit_json, format_option
from sbproxy.cli.models_admin_cmd import admin_call, admin_options
from sbproxy.config import load_config
from sbproxy.errors import ConfigError

__all__ = ["apply_command"]


@click.command("apply")
@click.option(
    "-f",
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    required=True,
    help="The sb.yml the server runs (edited).",
)
@admin_options
@format_option
def apply_command(
    config_file: Path, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Validate sb.yml, then reload it in the running server (POST /admin/reload).

    Prints the committed revision and the plan: added, changed, removed and preserved
    deployments (preserved ones keep their engine). Exit 0 committed, 2 invalid or refused,
    1 the server could not be reached or failed.
    """
    try:
        load_config(config_file)
    except ConfigError as exc:
        if output_format == "json":
            emit_json(
                "apply",
                {
                    "ok": False,
                    "error": exc.to_dict(),
                    "errors": [issue.to_dict() for issue in exc.issues],
                },
            )
        click.echo(f"sbproxy apply: {exc}", err=True)
        sys.exit(EXIT_INVALID)
    body = admin_call(
        "apply",
        "POST",
        f"{admin_url.rstrip('/')}/admin/reload",
        auth=(username, password),
        output_format=output_format,
        json_body={"source": str(config_file.resolve())},
    )
    if output_format == "json":
        emit_json("apply", body)
        return
    plan = body.get("plan", {})
    click.echo(f"revision {body.get('revision')} committed (job {body.get('job_id')})")
    for kind in ("added", "changed", "removed", "preserved"):
        names = plan.get(kind) or []
        click.echo(f"  {kind:<9} {', '.join(names) if names else '-'}")
