"""``sbproxy config status``: which configuration a running server serves, and how its last
reload went -- through the admin API (``GET /admin/model-host/status``, its ``config``
object).

Shows the active file (as the server was started with it, and where its symlinks led: a
ConfigMap's ``..<timestamp>/sb.yml``), the SHA-256 of the content it runs (compare it with
``sha256sum sb.yml``), the runtime revision, and the last reload attempt from any source
(``watch``, ``sighup``, ``admin``, ``apply``, ``admin_put``): its result (``committed``,
``refused``, ``failed``), time (ISO 8601, UTC), job id and, for a failure, its reason code
and message. Admin connection options as ``sbproxy models ps``. Exit 0 when the server
answered (whatever the last reload's result), 1 when it could not be reached, 2 refused.
"""

from __future__ import annotations

from typing import Any

import click

from sbproxy.cli._output import emit_json, format_option
from sbproxy.cli.models_admin_cmd import admin_call, admin_options

__all__ = ["status_command"]


def status_lines(config: dict[str, Any]) -> list[str]:
    """The text report of a status ``config`` object, one field a line."""
    rows: list[tuple[str, str]] = [
        ("path", str(config.get("path") or "-")),
        ("resolved path", str(config.get("resolved_path") or "-")),
        ("sha256", str(config.get("content_sha256") or "-")),
        ("revision", str(config.get("revision") if config.get("revision") is not None else "-")),
    ]
    watch = config.get("watch")
    if isinstance(watch, dict):
        rows.append(
            (
                "watch",
                f"on: at every change, and every {watch.get('poll_interval_s')} s "
                f"({watch.get('looks')} looks, last at {watch.get('last_look_at') or '-'})",
            )
        )
    else:
        rows.append(("watch", "off (SIGHUP, POST /admin/reload or `sbproxy apply` reload)"))
    last = config.get("last_reload")
    if not isinstance(last, dict):
        rows.append(("last reload", "none since the server started"))
    else:
        rows.append(("last reload", f"{last.get('result')} ({last.get('source')})"))
        rows.append(("  at", str(last.get("at") or "-")))
        rows.append(("  job", str(last.get("job_id") or "-")))
        if last.get("result") == "committed":
            rows.append(("  revision", str(last.get("revision"))))
        else:
            rows.append(("  reason", str(last.get("reason_code") or "-")))
            rows.append(("  error", str(last.get("message") or "-")))
            if last.get("content_sha256"):
                rows.append(("  tried sha256", str(last["content_sha256"])))
    width = max(len(name) for name, _ in rows)
    return [f"{name.ljust(width)}  {value}" for name, value in rows]


@click.command("status")
@admin_options
@format_option
def status_command(admin_url: str, username: str, password: str, output_format: str) -> None:
    """Show the running server's active config (path, SHA-256, revision) and its last reload
    (result, time, job, reason code and error)."""
    body = admin_call(
        "config.status",
        "GET",
        f"{admin_url.rstrip('/')}/admin/model-host/status",
        auth=(username, password),
        output_format=output_format,
    )
    config = body.get("config")
    config = config if isinstance(config, dict) else {}
    if output_format == "json":
        emit_json(
            "config.status",
            {"config": config, "runtime_revision": body.get("runtime_revision")},
        )
        return
    for line in status_lines(config):
        click.echo(line)
