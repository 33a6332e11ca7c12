"""Root ``sbproxy`` command group; each verb group lives in its own module."""

from __future__ import annotations

import click

from sbproxy import __version__
from sbproxy.cli._lazy import LazyGroup, defer_collection

__all__ = ["cli", "main"]

# Each verb group is imported only when it runs: `sbproxy models pull` starts without the
# server stack, the engine builders or the admin client.
_COMMANDS = {
    "apply": "sbproxy.cli.apply_cmd:apply_command",
    "config": "sbproxy.cli.config_cmd:config_group",
    "doctor": "sbproxy.cli.doctor_cmd:doctor_command",
    "engines": "sbproxy.cli.engines_cmd:engines_group",
    "jobs": "sbproxy.cli.jobs_cmd:jobs_group",
    "models": "sbproxy.cli.models_cmd:models_group",
    "serve": "sbproxy.cli.serve_cmd:serve_command",
    "run": "sbproxy.cli.run_cmd:run_command",
}


@click.group(
    cls=LazyGroup,
    lazy_commands=_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="sbproxy")
def cli() -> None:
    """sbproxy: pull pinned models, run supervised engines, serve an OpenAI-compatible API.

    Every mutation (pull, verify, prepare, warm, drain, remove, gc, reload) is a durable job
    journaled in SQLite; a restarted host finishes unfinished jobs.
    """


def main() -> None:
    """Console-script entry point (collection paused while the command imports, see ``_lazy``)."""
    defer_collection()
    cli(prog_name="sbproxy")
