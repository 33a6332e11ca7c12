"""``sbproxy nodes list|show|cordon|uncordon|drain|remove|admit`` (and ``revoke``, ``token``:
:mod:`sbproxy.cli.nodes_token_cmd`): the fleet's members through a
``cluster_authority`` host's admin API (``/admin/fleet/*``), admin connection options as
``sbproxy models ps``.

``list`` and ``show`` read (the state the controller recorded, last heartbeat age, labels,
replicas; ``list`` leaves removed members out unless ``--all``); the mutations set the
operator's flag on the member and answer the ``fleet.node`` job that recorded it
(``job_id``): ``cordon`` -- no new replicas there; ``drain`` -- cordon and move its replicas
elsewhere (started there first); ``uncordon`` -- clear both; ``remove`` -- the member leaves
the fleet (its replicas are re-placed; a host that comes back is refused, ``node_removed``,
until ``admit``); ``admit`` -- a removed member may join again. Exit 0 done, 2 refused
(unknown node, not a fleet host), 1 unreachable.
"""

from __future__ import annotations

from typing import Any

import click

from sbproxy.cli._output import emit_json, format_option
from sbproxy.cli.models_admin_cmd import admin_call, admin_options
from sbproxy.cli.nodes_token_cmd import revoke_command, token_group

__all__ = ["nodes_group"]


HEADER = ("NODE", "STATE", "HEARTBEAT", "LABELS", "REPLICAS", "URL")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def _nodes_rows(body: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for node in body.get("nodes", []):
        labels = ",".join(f"{k}={v}" for k, v in sorted(node.get("labels", {}).items()))
        replicas = ",".join(sorted(node.get("replicas", {})))
        rows.append(
            (
                str(node["id"]) + (" *" if node.get("controller") else ""),
                str(node.get("state")) + (" (revoked)" if node.get("revoked_at_ms") else ""),
                f"{int(node.get('heartbeat_age_ms', 0)) / 1000:.1f}s",
                labels or "-",
                replicas or "-",
                str(node.get("advertise_url") or "-"),
            )
        )
    return rows


@click.group("nodes")
def nodes_group() -> None:
    """The fleet's members (authority: cluster_authority): list, show, cordon, drain ..."""


@nodes_group.command("list")
@click.option("--all", "show_all", is_flag=True, help="Show removed members too (state left).")
@admin_options
@format_option
def list_command(
    show_all: bool, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Every member: state, last heartbeat age, labels, replicas (* marks the controller)."""
    body = admin_call(
        "nodes.list",
        "GET",
        f"{admin_url.rstrip('/')}/admin/fleet/nodes" + ("?all=true" if show_all else ""),
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("nodes.list", body)
        return
    _table(HEADER, _nodes_rows(body))


@nodes_group.command("show")
@click.argument("node")
@admin_options
@format_option
def show_command(
    node: str, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """One member and the placements on it."""
    body = admin_call(
        "nodes.show",
        "GET",
        f"{admin_url.rstrip('/')}/admin/fleet/nodes/{node}",
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("nodes.show", body)
        return
    found = body.get("node", {})
    _table(
        ("NODE", "STATE", "HEARTBEAT", "LABELS", "REPLICAS", "URL"), _nodes_rows({"nodes": [found]})
    )
    for placement in found.get("placements", []):
        click.echo(
            f"  {placement['deployment']} replica {placement['replica']}: {placement['state']}"
            f" (revision {placement['revision']}, placement {placement['id']})"
        )


def _mutation(action: str, help_text: str) -> click.Command:
    @click.command(action, help=help_text)
    @click.argument("node")
    @admin_options
    @format_option
    def command(
        node: str, admin_url: str, username: str, password: str, output_format: str
    ) -> None:
        body = admin_call(
            f"nodes.{action}",
            "POST",
            f"{admin_url.rstrip('/')}/admin/fleet/nodes/{node}/{action}",
            auth=(username, password),
            output_format=output_format,
        )
        if output_format == "json":
            emit_json(f"nodes.{action}", body)
            return
        click.echo(f"{node} {action} (job {body.get('job_id')})")

    return command


nodes_group.add_command(_mutation("cordon", "Take no new replicas on NODE (keeps its own)."))
nodes_group.add_command(
    _mutation("uncordon", "Let NODE take replicas again (clears cordon and drain).")
)
nodes_group.add_command(
    _mutation("drain", "Cordon NODE and move its replicas elsewhere (started there first).")
)
nodes_group.add_command(
    _mutation(
        "remove",
        "Remove NODE from the fleet; its replicas are re-placed, and it is refused "
        "(node_removed) if it comes back, until `sbproxy nodes admit NODE`.",
    )
)
nodes_group.add_command(
    _mutation(
        "admit",
        "Let a removed NODE join the fleet again (a revoked one: with a fresh join token).",
    )
)
nodes_group.add_command(revoke_command)
nodes_group.add_command(token_group)
