"""Output conventions shared by every CLI verb.

* JSON goes to stdout as one object carrying ``schema_version: 1`` and a stable ``command``
  name (``models.list``, ``config.validate`` ...), with no ANSI escapes or carriage returns.
* Progress and human diagnostics go to stderr.
* Exit codes: 0 success, 1 runtime failure, 2 bad input or a refusal (usage, config,
  unknown id, a journal that cannot be used: :data:`REFUSAL_CODES`), 130 interrupted
  (Ctrl-C; 128 + SIGINT, as shells report it).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

import click

from sbproxy.errors import ConfigError, SbproxyError

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_RUNTIME",
    "REFUSAL_CODES",
    "configure_server_logging",
    "emit_json",
    "exit_status",
    "fail",
    "format_option",
    "freeze_startup_heap",
    "interrupted",
]

EXIT_RUNTIME = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130

# Reason codes of refusals: what was asked cannot be done as asked, and nothing ran -- the
# input, the configuration or the situation (a journal that cannot be reached, a port in
# use) must change first. Every verb exits 2 on them, however they reach it: raised here, or
# answered by a server's admin API. Anything else is a failure while working (exit 1).
REFUSAL_CODES = frozenset(
    {
        # The request itself.
        "usage",
        "invalid_config",
        "empty_config",
        "invalid_cache_dir",
        "invalid_catalog",
        "catalog_conflict",
        "unknown_catalog_model",
        "unknown_catalog_variant",
        "variant_not_pinned",
        "preview_incomplete",
        "no_compatible_variant",
        "no_model_host",
        "no_cache_budget",
        "invalid_import_path",
        "removal_blocked",
        "config_required",
        "invalid_lockfile",
        "lockfile_not_found",
        "invalid_endpoint",
        "invalid_job_id",
        "job_not_found",
        "no_job_journal",
        "job_not_retryable",
        "idempotency_key_taken",
        "admin_password_required",
        # The journal: a URL that names no server, a server that cannot be reached or that
        # is newer than this sbproxy, a journal that cannot be moved now.
        "invalid_journal_url",
        "journal_unavailable",
        "journal_schema_newer",
        "store_version_mismatch",  # a SQLite journal newer than this sbproxy
        "journal_in_use",
        "journal_not_empty",
        # A host that cannot start where it was told to.
        "port_in_use",
        "port_not_permitted",
        "bind_address_unavailable",
        "cache_in_use",
        "node_id_in_use",
        "node_removed",
        "invalid_advertise_url",
        # Admission (docs/cluster.md, "Admitting nodes").
        "join_token_required",
        "join_token_invalid",
        "join_token_expired",
        "join_token_used_up",
        "node_revoked",
        "node_credential_invalid",
        "unknown_join_token",
        "invalid_join_token_request",
    }
)

SCHEMA_VERSION = 1

format_option = click.option(
    "--format",
    "output_format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="text for people; json prints one object on stdout for scripts.",
)


def _scrub(text: str) -> str:
    # JSON output must be free of control bytes a terminal would interpret.
    return text.replace("\x1b", "").replace("\r", "")


def emit_json(command: str, payload: Mapping[str, object]) -> None:
    """Print ``{"schema_version": 1, "command": command, **payload}`` on stdout."""
    envelope: dict[str, object] = {"schema_version": SCHEMA_VERSION, "command": command}
    envelope.update(payload)
    text = json.dumps(envelope, indent=2, ensure_ascii=False, sort_keys=False)
    click.echo(_scrub(text))


def exit_status(error: SbproxyError, *, otherwise: int = EXIT_RUNTIME) -> int:
    """The exit status for ``error``: 2 for a refusal (:data:`REFUSAL_CODES`, or any
    configuration error), else ``otherwise``."""
    if error.code in REFUSAL_CODES or isinstance(error, ConfigError):
        return EXIT_INVALID
    return otherwise


def fail(
    command: str,
    error: SbproxyError,
    *,
    output_format: str,
    exit_code: int = EXIT_INVALID,
) -> NoReturn:
    """Report ``error`` (JSON on stdout or a message on stderr) and exit with ``exit_code``
    -- 2 whatever ``exit_code`` says when ``error`` is a refusal (:func:`exit_status`)."""
    if output_format == "json":
        emit_json(command, {"ok": False, "error": error.to_dict()})
    click.echo(_scrub(f"sbproxy {command.replace('.', ' ')}: {error}"), err=True)
    sys.exit(exit_status(error, otherwise=exit_code))


def interrupted(command: str) -> NoReturn:
    """Report a Ctrl-C on stderr and exit 130 (stdout gets nothing, so JSON stays valid).

    A durable job the verb was running keeps its id: the journal still has it unfinished,
    and running the same command again joins and resumes it.
    """
    click.echo(
        f"sbproxy {command.replace('.', ' ')}: interrupted; an unfinished job resumes under "
        "the same job id when the command is run again.",
        err=True,
    )
    sys.exit(EXIT_INTERRUPTED)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now out of the collector's reach.

    A server process starts with ~130k tracked objects (modules, Litestar's route tables,
    pydantic schemas) that live as long as it does; each full collection walked them all
    and stopped the event loop for ~50-60 ms (p50), which was the largest stall at the
    gateway's p99 under load after the probe fix. Frozen, full collections take under 1 ms
    (``benchmarks/proxy.py``, 16 clients: p99 49 ms -> 10 ms). Call once the listeners
    accept; the initial collect keeps garbage of the start from being frozen with it.
    """
    gc.collect()
    gc.freeze()


def configure_server_logging() -> None:
    """Logging of a long-running process: sbproxy's own INFO lines, libraries' warnings.

    Per-request and per-probe lines (httpx, uvicorn access) stay off: the hot path and the
    health loop would otherwise write a line every second.
    """
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("sbproxy").setLevel(logging.INFO)
    # The gateway's access log (sbproxy.api.access): refusals, timeouts and disconnects by
    # default; every request with SBPROXY_ACCESS_LOG=all; none with off.
    access = os.environ.get("SBPROXY_ACCESS_LOG", "errors").strip().lower()
    levels = {"all": logging.DEBUG, "off": logging.WARNING}
    logging.getLogger("sbproxy.api.access").setLevel(levels.get(access, logging.INFO))
