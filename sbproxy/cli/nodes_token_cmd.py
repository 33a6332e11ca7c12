"""``sbproxy nodes token create|list|revoke`` and ``sbproxy nodes revoke``: admitting nodes
into the fleet, through a ``cluster_authority`` host's admin API (admin connection options as
``sbproxy models ps``; docs/cluster.md, "Admitting nodes").

``token create [--ttl DURATION] [--uses N] [--description TEXT]`` prints a join token once
(``<id>.<secret>``; the journal keeps only its SHA-256); ``token list`` shows every token's
id, state, expiry and uses, never a secret; ``token revoke ID`` stops a token admitting
anyone. ``revoke NODE [--reason TEXT]`` revokes a member at once: its peers refuse it, its
renewals are refused, it fences, and its replicas are re-placed. Exit 0 done, 2 refused
(bad option, unknown node or token, not a fleet host), 1 unreachable.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import click

from sbproxy.cli._options import config_option, load_cli_config
from sbproxy.cli._output import EXIT_RUNTIME, emit_json, fail, format_option
from sbproxy.cli.models_admin_cmd import admin_call, admin_options
from sbproxy.config.origins import parse_duration_secs
from sbproxy.errors import SbproxyError

__all__ = ["revoke_command", "token_group"]


def _ttl_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    del ctx, param
    if value is None:
        return None
    try:
        return parse_duration_secs(value) * 1000
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _when(at_ms: int | None) -> str:
    if at_ms is None:
        return "never"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_ms / 1000))


F = TypeVar("F", bound=Callable[..., Any])


def _offline_with_config(func: F) -> F:
    """Mark a verb whose ``-f`` works on that file's journal itself: no admin password is
    needed then (:func:`~sbproxy.cli.models_admin_cmd.admin_options`)."""
    func.offline_with_config = True  # type: ignore[attr-defined]
    return func


@click.group("token")
def token_group() -> None:
    """Join tokens: a new node joins the fleet only with one."""


@token_group.command("create")
@click.option(
    "--ttl",
    "ttl_ms",
    callback=_ttl_ms,
    default=None,
    help="How long the token admits nodes: seconds or <n>s|m|h|d (e.g. 1h); default no expiry."
    " Counted on the database's clock.",
)
@click.option(
    "--uses", type=click.IntRange(min=1), default=None, help="Joins it admits; default unlimited."
)
@click.option("--description", default="", help="A note shown by `token list`.")
@config_option
@admin_options
@format_option
@_offline_with_config
def create_command(
    ttl_ms: int | None,
    uses: int | None,
    description: str,
    config_path: Path | None,
    admin_url: str,
    username: str,
    password: str,
    output_format: str,
) -> None:
    """Make a join token and print it, once (the fleet keeps only its hash).

    Through a member's admin API; or, with -f sb.yml (a cluster_authority file), straight in
    the fleet's journal -- how the first member of a new fleet gets its token.
    """
    command = "nodes.token.create"
    if config_path is not None:
        body = _create_in_journal(
            command, config_path, ttl_ms=ttl_ms, uses=uses, description=description,
            output_format=output_format,
        )  # fmt: skip
    else:
        body = admin_call(
            command,
            "POST",
            f"{admin_url.rstrip('/')}/admin/fleet/join-tokens",
            auth=(username, password),
            output_format=output_format,
            json_body={"ttl_ms": ttl_ms, "uses": uses, "description": description},
        )
    if output_format == "json":
        emit_json("nodes.token.create", body)
        return
    token: dict[str, Any] = body.get("token", {})
    uses_text = "unlimited" if token.get("uses_left") is None else str(token.get("uses_left"))
    click.echo(str(token.get("token")))
    click.echo(
        f"join token {token.get('id')}: expires {_when(token.get('expires_at_ms'))}, "
        f"uses {uses_text} (job {body.get('job_id')}). It is shown only now: give it to the "
        "new host as proxy.model_host.fleet.join_token or $SBPROXY_JOIN_TOKEN.",
        err=True,
    )


def _create_in_journal(
    command: str,
    config_path: Path,
    *,
    ttl_ms: int | None,
    uses: int | None,
    description: str,
    output_format: str,
) -> dict[str, Any]:
    """Make the token in the journal of a ``cluster_authority`` file (exit 2 for any other
    file, 1 when the journal cannot be reached)."""
    from sbproxy.fleet.cluster import fleet_store, is_cluster
    from sbproxy.store.admission import create_join_token, token_body

    config = load_cli_config(command, config_path, output_format=output_format)
    if config is None or not is_cluster(config):
        fail(
            command,
            SbproxyError(
                f"{config_path} is not a fleet member's file (proxy.model_host.authority is "
                "not cluster_authority): it names no fleet journal",
                code="fleet_disabled",
                remediation="Give -f the sb.yml of a cluster_authority host, or leave -f out "
                "to ask a member's admin API.",
            ),
            output_format=output_format,
        )
    store = fleet_store(config)
    try:
        row, token, job_id = create_join_token(
            store,
            by=f"cli@{socket.gethostname()}",
            ttl_ms=ttl_ms,
            uses=uses,
            description=description,
        )
    except SbproxyError as exc:
        fail(command, exc, output_format=output_format, exit_code=EXIT_RUNTIME)
    finally:
        store.close()
    return {"job_id": job_id, "token": token_body(row, token, row.created_at_ms)}


@token_group.command("list")
@admin_options
@format_option
def list_command(admin_url: str, username: str, password: str, output_format: str) -> None:
    """Every join token: id, state, expiry, uses (never a secret)."""
    body = admin_call(
        "nodes.token.list",
        "GET",
        f"{admin_url.rstrip('/')}/admin/fleet/join-tokens",
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("nodes.token.list", body)
        return
    rows = [("ID", "STATE", "EXPIRES", "USES LEFT", "USED", "DESCRIPTION")]
    for token in body.get("tokens", []):
        left = token.get("uses_left")
        rows.append(
            (
                str(token["id"]),
                str(token.get("state")),
                _when(token.get("expires_at_ms")),
                "unlimited" if left is None else str(left),
                str(token.get("used", 0)),
                str(token.get("description") or "-"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


@token_group.command("revoke")
@click.argument("token_id")
@admin_options
@format_option
def revoke_token_command(
    token_id: str, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Revoke join token TOKEN_ID: it admits no node from now on."""
    body = admin_call(
        "nodes.token.revoke",
        "POST",
        f"{admin_url.rstrip('/')}/admin/fleet/join-tokens/{token_id}/revoke",
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("nodes.token.revoke", body)
        return
    click.echo(f"join token {token_id} revoked (job {body.get('job_id')})")


@click.command("revoke")
@click.argument("node")
@click.option("--reason", default="", help="Why (recorded with the fleet.node job).")
@admin_options
@format_option
def revoke_command(
    node: str, reason: str, admin_url: str, username: str, password: str, output_format: str
) -> None:
    """Revoke NODE at once: peers refuse it, its renewals are refused, it fences, and its
    replicas are re-placed. It joins again only after `sbproxy nodes admit NODE`, with a
    fresh join token."""
    body = admin_call(
        "nodes.revoke",
        "POST",
        f"{admin_url.rstrip('/')}/admin/fleet/nodes/{node}/revoke"
        + (f"?{urlencode({'reason': reason})}" if reason else ""),
        auth=(username, password),
        output_format=output_format,
    )
    if output_format == "json":
        emit_json("nodes.revoke", body)
        return
    click.echo(f"{node} revoked (job {body.get('job_id')})")
