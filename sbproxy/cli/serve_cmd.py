"""``sbproxy serve -f sb.yml``: run the gateway, the admin API, the runtime and the job worker.

The work lives in :mod:`sbproxy.api.server`; this module reads options, loads the
configuration and reports the listening addresses on stderr. With ``--locked`` it first
checks ``sbproxy-models.lock`` next to the configuration (as ``sbproxy models verify-lock``
does) and refuses to start on any drift.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from sbproxy.cli._output import (
    EXIT_INVALID,
    configure_server_logging,
    exit_status,
    freeze_startup_heap,
)
from sbproxy.config import CompiledConfig, load_config
from sbproxy.errors import SbproxyError
from sbproxy.telemetry import configure_from_environment

if TYPE_CHECKING:
    from sbproxy.model_host.lockfile import LockReport

__all__ = ["serve_command"]


@click.command("serve")
@click.option(
    "-f",
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="SB_CONFIG_FILE",
    required=True,
    help="The sb.yml to serve (also SB_CONFIG_FILE).",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache root; overrides proxy.model_host.cache.directory.",
)
@click.option(
    "--watch/--no-watch",
    default=True,
    show_default=True,
    help="Reload when the configuration file's content changes, however it changed (a "
    "ConfigMap symlink swap, a rename, an edit in place); SIGHUP always reloads.",
)
@click.option(
    "--locked",
    is_flag=True,
    help="Refuse to start unless sbproxy-models.lock next to the config matches what the "
    "config resolves to and every locked artifact is in the cache (exit 2).",
)
def serve_command(config_file: Path, cache_dir: Path | None, watch: bool, locked: bool) -> None:
    """Serve the OpenAI-compatible gateway and the admin API until SIGTERM or SIGINT.

    The gateway listens on proxy.bind_address:proxy.http_bind_port (loopback by default);
    the admin API, when proxy.admin.enabled, on proxy.admin.bind:proxy.admin.port.
    SIGTERM or SIGINT gives requests in flight up to proxy.model_host.shutdown_deadline_ms,
    ends the rest with 503 shutting_down and stops the engines: exit 0 within that deadline
    plus 2 s. A second signal stops at once. Unfinished jobs resume at the next start.

    Editing the file (with --watch), SIGHUP, POST /admin/reload and `sbproxy apply` reload
    it: the candidate is prepared in full before any route changes, and a bad candidate
    changes nothing. `sbproxy config status` shows the active config (path, SHA-256,
    revision) and the last reload's result, time and error.

    With --locked, nothing starts (exit 2) when the lockfile is missing or invalid, or a
    model drifted from it (see `sbproxy models verify-lock`); later reloads of the file are
    checked the same way and refused (lock_drift) when they drift.
    """
    from sbproxy.api.server import run_served, serve

    configure_server_logging()
    configure_from_environment()  # OTLP traces when OTEL_EXPORTER_OTLP_ENDPOINT is set

    def listening(addresses: list[str]) -> None:
        names = ("gateway", "admin")
        for name, address in zip(names, addresses, strict=False):
            click.echo(f"sbproxy: {name} listening on {address}", err=True)
        freeze_startup_heap()

    try:
        compiled = load_config(config_file)
    except SbproxyError as exc:
        click.echo(f"serve: {exc} ({exc.code})", err=True)
        sys.exit(exit_status(exc))
    if locked:
        _check_lock(config_file, compiled, cache_dir)
    try:
        run_served(
            lambda: serve(
                compiled,
                cache_dir=cache_dir.absolute() if cache_dir else None,
                on_listening=listening,
                watch_config=watch,
                lockfile=_lock_path(config_file) if locked else None,
            )
        )
    except SbproxyError as exc:
        # A refusal (a port in use, a journal that cannot be reached ...) is 2, as from
        # every verb (``REFUSAL_CODES``); a failure while serving is 1.
        click.echo(f"serve: {exc} ({exc.code})", err=True)
        sys.exit(exit_status(exc))


def _lock_path(config_file: Path) -> Path:
    from sbproxy.model_host.lockfile import default_lock_path

    return default_lock_path(config_file)


def _check_lock(config_file: Path, compiled: CompiledConfig, cache_dir: Path | None) -> None:
    """Verify the lockfile next to ``config_file``; on drift or error, explain and exit.

    Runs before anything binds or starts; the service it opens is closed again first.
    """
    import anyio

    from sbproxy.cli._host import exit_code_for
    from sbproxy.cli.models_lock_cmd import check_line
    from sbproxy.model_host.artifacts import resolve_cache_root
    from sbproxy.model_host.lockfile import read_lock, verify_lock
    from sbproxy.model_host.service import open_service

    path = _lock_path(config_file)
    host = compiled.model_host

    async def verify() -> LockReport:
        lock = read_lock(path)
        layout = resolve_cache_root(
            cache_dir.absolute() if cache_dir else None,
            configured=host.cache.directory if host is not None else None,
        )
        async with open_service(layout, config=compiled) as service:
            return verify_lock(lock, service)

    try:
        report = anyio.run(verify)
    except SbproxyError as exc:
        click.echo(f"serve: --locked: {exc} ({exc.code})", err=True)
        sys.exit(exit_code_for(exc))
    if report.drift:
        drifted = report.drifted
        click.echo(
            f"serve: --locked: {len(drifted)} model(s) drifted from {path}; nothing was "
            "started. Pull the missing artifacts or review and rewrite the lock with "
            "`sbproxy models lock`:",
            err=True,
        )
        for check in drifted:
            click.echo(f"  {check_line(check)}", err=True)
        sys.exit(EXIT_INVALID)
