"""``sbproxy apply -f sb.yml``: validate a configuration here, then have the running server
reload it through the same transaction as its file watcher and ``SIGHUP``.

The file is validated locally first (every problem listed with its dotted path, exit 2,
nothing sent). Then ``POST /admin/reload`` with ``{"source": <absolute path>}``: a single
host refuses (409 ``source_mismatch``) unless it was started from that very file, so what
was validated is what is applied. The server prepares the complete candidate before
changing any route; a refusal (``restart_required``, ``foundation_change``, a prepare
failure) leaves everything running as it was. Admin connection options as ``sbproxy models
ps``.

A file that declares ``authority: cluster_authority`` is a fleet's desired-state document:
the body also carries its deployments (as validated here), and any member of the fleet
makes them the fleet's next revision, whichever file that member serves itself; a member
started from this very file also reloads its own settings (routes, keys) from it. The
summary is then the fleet's change: the revision this apply committed, and the deployments
added, removed and changed (``chat: replicas 2 -> 3``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from sbproxy.cli._output import EXIT_INVALID, emit_json, format_option
from sbproxy.cli.models_admin_cmd import admin_call, admin_options
from sbproxy.config import CompiledConfig, load_config
from sbproxy.config.model_host import Authority
from sbproxy.errors import ConfigError

__all__ = ["apply_command", "fleet_summary"]


def _body(config_file: Path, compiled: CompiledConfig) -> dict[str, Any]:
    """The reload body: the file, and for a fleet's document its deployments."""
    body: dict[str, Any] = {"source": str(config_file.resolve())}
    host = compiled.model_host
    if host is not None and host.authority == Authority.CLUSTER_AUTHORITY:
        body["deployments"] = {
            d: c.model_dump(mode="json", exclude_unset=True)
            for d, c in compiled.deployments.items()
        }
    return body


def _changed_line(row: Mapping[str, Any]) -> str:
    """``chat: replicas 2 -> 3``, ``chat: variant, max_context``, or both."""
    parts = []
    counts = row.get("replicas")
    if counts:
        parts.append(f"replicas {counts['from']} -> {counts['to']}")
    others = [f for f in row.get("fields") or [] if f != "replicas"]
    if others:
        parts.append(", ".join(others))
    return f"{row['deployment']}: {'; '.join(parts)}"


def _count(row: Mapping[str, Any]) -> str:
    replicas = row.get("replicas", 1)
    return f"{row['deployment']} ({replicas} replica{'' if replicas == 1 else 's'})"


def fleet_summary(fleet: Mapping[str, Any]) -> list[str]:
    """The lines ``sbproxy apply`` prints for a fleet's answer (``fleet`` of
    ``POST /admin/reload``): the revision, then one line per deployment added, changed
    or removed; nothing listed when the revision is unchanged."""
    revision, previous = fleet.get("revision"), fleet.get("previous_revision")
    if not fleet.get("written"):
        return [f"fleet revision {revision} unchanged: the fleet runs these deployments already"]
    was = f" (was {previous})" if previous is not None else " (the first)"
    lines = [f"fleet revision {revision} committed{was}"]
    change = fleet.get("change") or {}
    lines += [f"  added     {_count(row)}" for row in change.get("added") or []]
    lines += [f"  changed   {_changed_line(row)}" for row in change.get("changed") or []]
    lines += [f"  removed   {_count(row)}" for row in change.get("removed") or []]
    unchanged = change.get("unchanged") or []
    if unchanged:
        lines.append(f"  unchanged {', '.join(unchanged)}")
    return lines


@click.command("apply")
@click.option(
    "-f",
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    required=True,
    help="The sb.yml the server runs (edited); on a fleet, any cluster_authority file whose "
    "deployments are to be the fleet's.",
)
@admin_options
@format_option
def apply_command(
    config_file: Path, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Validate sb.yml, then reload it in the running server (POST /admin/reload).

    Prints the committed revision and the plan: added, changed, removed and preserved
    deployments (preserved ones keep their engine). On a fleet member: the fleet revision
    this apply committed and the deployments it added, changed (replica counts) and
    removed. Exit 0 committed, 2 invalid or refused, 1 the server could not be reached or
    failed.
    """
    try:
        compiled = load_config(config_file)
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
        json_body=_body(config_file, compiled),
    )
    if output_format == "json":
        emit_json("apply", body)
        return
    fleet = body.get("fleet")
    if isinstance(fleet, dict):
        for line in fleet_summary(fleet):
            click.echo(line)
        if body.get("host_reloaded"):
            click.echo(f"this host's own settings reloaded (job {body.get('job_id')})")
        else:
            click.echo("this host's own settings unchanged (it serves another file)")
        return
    plan = body.get("plan", {})
    click.echo(f"revision {body.get('revision')} committed (job {body.get('job_id')})")
    for kind in ("added", "changed", "removed", "preserved"):
        names = plan.get(kind) or []
        click.echo(f"  {kind:<9} {', '.join(names) if names else '-'}")
