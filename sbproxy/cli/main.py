"""Root ``sbproxy`` command group; each verb group lives in its own module."""

from __future__ import annotations

import sys

import click

from sbproxy import __version__
from sbproxy.cli._lazy import LazyGroup, defer_collection
from sbproxy.cli._output import emit_json

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
    """Console-script entry point (collection paused while the command imports, see ``_lazy``).

    Usage errors click finds while it parses options (a bad ``--budget-gib``, a
    ``--lockfile`` that is a directory) keep their message on stderr and exit 2; when the
    command line asks for ``--format json`` they are also one JSON object on stdout, like
    every other error (``{"ok": false, "error": {"code": "usage", ...}}``).
    """
    defer_collection()
    try:
        outcome = cli.main(prog_name="sbproxy", standalone_mode=False)
    except click.ClickException as exc:
        if _wants_json(sys.argv[1:]):
            path = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else ""
            command = ".".join(path.split()[1:]) or "sbproxy"
            emit_json(command, {"ok": False, "error": _usage_error(exc)})
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(outcome if isinstance(outcome, int) else 0)


def _wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON output (``--format json`` or ``--format=json``)."""
    pairs = zip(args, [*args[1:], ""], strict=True)
    return "--format=json" in args or any(a == "--format" and b == "json" for a, b in pairs)


def _usage_error(exc: click.ClickException) -> dict[str, object]:
    return {"code": "usage", "error": exc.format_message(), "retryable": False}
