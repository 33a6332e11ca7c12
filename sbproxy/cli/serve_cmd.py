"""``sbproxy serve -f sb.yml``: run the gateway, the admin API, the runtime and the job worker.

The work lives in :mod:`sbproxy.api.server`; this module reads options, loads the
configuration and reports the listening addresses on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sbproxy.cli._output import configure_server_logging, freeze_startup_heap
from sbproxy.config import load_config
from sbproxy.errors import SbproxyError
from sbproxy.telemetry import configure_from_environment

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
    help="Reload when the configuration file changes (SIGHUP always reloads).",
)
def serve_command(config_file: Path, cache_dir: Path | None, watch: bool) -> None:
    """Serve the OpenAI-compatible gateway and the admin API until SIGTERM or SIGINT.

    The gateway listens on proxy.bind_address:proxy.http_bind_port (loopback by default);
    the admin API, when proxy.admin.enabled, on proxy.admin.bind:proxy.admin.port.
    Shutdown drains deployments within proxy.model_host.shutdown_deadline_ms and stops
    their engines; unfinished jobs resume at the next start. Editing the file (with
    --watch), SIGHUP, POST /admin/reload and `sbproxy apply` reload it: the candidate is
    prepared in full before any route changes, and a bad candidate changes nothing.
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
        run_served(
            lambda: serve(
                compiled,
                cache_dir=cache_dir.absolute() if cache_dir else None,
                on_listening=listening,
                watch_config=watch,
            )
        )
    except SbproxyError as exc:
        click.echo(f"serve: {exc} ({exc.code})", err=True)
        sys.exit(2 if exc.code == "invalid_config" else 1)
