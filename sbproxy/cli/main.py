"""Root ``sbproxy`` command group; each verb group lives in its own module."""

from __future__ import annotations

import logging
import sys

import click

from sbproxy import __version__
from sbproxy.cli._lazy import LazyCommand, LazyGroup, defer_collection
from sbproxy.cli._output import emit_json

__all__ = ["cli", "main"]

# Each verb group is imported only when it runs: `sbproxy models pull` starts without the
# server stack, the engine builders or the admin client, and `sbproxy --help` imports none of
# them (each line is the verb's own short help; tests/cli/test_lazy.py holds them equal).
_COMMANDS = {
    "apply": LazyCommand(
        "sbproxy.cli.apply_cmd:apply_command",
        "Validate sb.yml, then reload it in the running server (POST /admin/reload).",
    ),
    "capabilities": LazyCommand(
        "sbproxy.cli.capabilities_cmd:capabilities_command",
        "Show each engine x accelerator x feature as live, planned or unsupported (with why).",
    ),
    "certify": LazyCommand(
        "sbproxy.cli.certify_cmd:certify_command",
        "Run the live checks this machine can run (load, chat, stream, stop) and record them.",
    ),
    "config": LazyCommand(
        "sbproxy.cli.config_cmd:config_group",
        "Check and describe configuration files; show the one a running server serves.",
    ),
    "doctor": LazyCommand(
        "sbproxy.cli.doctor_cmd:doctor_command",
        "Report the host (CPU, memory, devices), engines, cache and each configured deployment.",
    ),
    "engines": LazyCommand(
        "sbproxy.cli.engines_cmd:engines_group", "Inspect and provision inference engines."
    ),
    "jobs": LazyCommand(
        "sbproxy.cli.jobs_cmd:jobs_group",
        "Inspect and control durable jobs (pull, verify, prepare, warm, drain ...).",
    ),
    "journal": LazyCommand(
        "sbproxy.cli.journal_cmd:journal_group",
        "The job journal: move the SQLite journal of a cache into PostgreSQL.",
    ),
    "models": LazyCommand(
        "sbproxy.cli.models_cmd:models_group",
        "List, inspect, pull and manage catalog models (bare `sbproxy models` lists them).",
    ),
    "nodes": LazyCommand(
        "sbproxy.cli.nodes_cmd:nodes_group",
        "The fleet's members (authority: cluster_authority): list, show, cordon, drain ...",
    ),
    "serve": LazyCommand(
        "sbproxy.cli.serve_cmd:serve_command",
        "Serve the OpenAI-compatible gateway and the admin API until SIGTERM or SIGINT.",
    ),
    "run": LazyCommand(
        "sbproxy.cli.run_cmd:run_command",
        "Serve one certified catalog MODEL on this machine with the canonical runtime.",
    ),
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


class _DriverAftermath(logging.Filter):
    """Drops the PostgreSQL driver's ``error ignored ...`` warnings.

    psycopg logs one when cleaning up after an error fails too -- a pipeline, transaction or
    copy ended on a connection that is gone (``error ignored terminating <psycopg.Pipeline
    [BAD]>: the connection is lost``). The error that caused it is raised anyway, and the
    store reports it as its own (``journal_unavailable``, one line naming ``host:port``); in a
    CLI verb, where no logging is set up, the driver's line would reach stderr bare, before it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("error ignored"))


def _quiet_driver_aftermath() -> None:
    # Logger filters are not inherited: psycopg logs on "psycopg" and on
    # "psycopg.transaction" (its transaction blocks).
    for name in ("psycopg", "psycopg.transaction"):
        logging.getLogger(name).addFilter(_DriverAftermath())


def main() -> None:
    """Console-script entry point (collection paused while the command imports, see ``_lazy``).

    Usage errors click finds while it parses options (a bad ``--budget-gib``, a
    ``--lockfile`` that is a directory) keep their message on stderr and exit 2; when the
    command line asks for ``--format json`` they are also one JSON object on stdout, like
    every other error (``{"ok": false, "error": {"code": "usage", ...}}``).
    """
    defer_collection()
    _quiet_driver_aftermath()
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
