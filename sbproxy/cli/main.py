"""Root ``sbproxy`` command group; each verb group lives in its own module."""

from __future__ import annotations

import click

from sbproxy import __version__
from sbproxy.cli.apply_cmd import apply_command
from sbproxy.cli.config_cmd import config_group
from sbproxy.cli.doctor_cmd import doctor_command
from sbproxy.cli.engines_cmd import engines_group
from sbproxy.cli.jobs_cmd import jobs_group
from sbproxy.cli.models_cmd import models_group
from sbproxy.cli.run_cmd import run_command
from sbproxy.cli.serve_cmd import serve_command

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sbproxy")
def cli() -> None:
    """sbproxy: pull pinned models, run supervised engines, serve an OpenAI-compatible API.

    Every mutation (pull, verify, prepare, warm, drain, remove, gc, reload) is a durable job
    journaled in SQLite; a restarted host finishes unfinished jobs.
    """


cli.add_command(apply_command)
cli.add_command(config_group)
cli.add_command(doctor_command)
cli.add_command(engines_group)
cli.add_command(jobs_group)
cli.add_command(models_group)
cli.add_command(serve_command)
cli.add_command(run_command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="sbproxy")
