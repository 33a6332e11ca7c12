"""What the ``sbproxy jobs`` verbs share: the journal options, the journal they select, exit
codes for bad input and the JSON form of a job. Both ``jobs_cmd`` (the group and ``list``)
and ``jobs_control_cmd`` (the verbs that open the workflow engine) import it; neither imports
the other at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sbproxy.cli._job_text import stale_dict
from sbproxy.cli._options import cache_dir_option, config_option, load_cli_config, resolve_layout
from sbproxy.store import JobRecord
from sbproxy.workflows import Staleness

__all__ = ["INVALID_INPUT_CODES", "job_json", "journal_options", "journal_path"]

F = TypeVar("F", bound=Callable[..., Any])

# Codes that mean the request itself was wrong (exit 2); anything else is a runtime failure.
INVALID_INPUT_CODES = frozenset(
    {
        "invalid_config",
        "invalid_cache_dir",
        "invalid_job_id",
        "job_not_found",
        "no_job_journal",
        "job_not_retryable",
        "idempotency_key_taken",
        # The PostgreSQL journal ($SBPROXY_JOURNAL_URL) cannot be reached or is newer.
        "journal_unavailable",
        "journal_schema_newer",
    }
)


def journal_options(fn: F) -> F:
    """``--cache-dir`` and ``-f/--config``: which journal the verb reads."""
    return config_option(cache_dir_option(fn))


def journal_path(
    command: str, cache_dir: Path | None, config_path: Path | None, output_format: str
) -> Path:
    """The journal file the options select (exit 2 on an invalid config or cache root)."""
    # The config matters only for its cache directory, so it is not read under --cache-dir.
    config = (
        load_cli_config(command, config_path, output_format=output_format)
        if cache_dir is None
        else None
    )
    return resolve_layout(command, cache_dir, config, output_format=output_format).journal


def job_json(job: JobRecord, stale: Staleness | None) -> dict[str, Any]:
    """A job in JSON output: the record, plus ``stale`` (see ``stale_dict``)."""
    return {**job.to_dict(), "stale": stale_dict(job, stale)}
