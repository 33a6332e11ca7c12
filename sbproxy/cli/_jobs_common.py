"""What the ``sbproxy jobs`` verbs share: the journal options, the journal they select and the
JSON form of a job. Both ``jobs_cmd`` (the group and ``list``)
and ``jobs_control_cmd`` (the verbs that open the workflow engine) import it; neither imports
the other at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sbproxy.cli._job_text import stale_dict
from sbproxy.cli._options import (
    JournalChoice,
    cache_dir_option,
    config_option,
    load_cli_config,
    resolve_layout,
    select_journal,
)
from sbproxy.store import JobRecord
from sbproxy.workflows import Staleness

__all__ = ["job_json", "journal_choice", "journal_options"]

F = TypeVar("F", bound=Callable[..., Any])


def journal_options(fn: F) -> F:
    """``--cache-dir`` and ``-f/--config``: which journal the verb reads."""
    return config_option(cache_dir_option(fn))


def journal_choice(
    command: str, cache_dir: Path | None, config_path: Path | None, output_format: str
) -> JournalChoice:
    """The journal the options select, as every verb selects it (:func:`select_journal`):
    exit 2 on an invalid config, cache root or journal URL."""
    # Read under --cache-dir too: the config may name a PostgreSQL journal.
    config = load_cli_config(command, config_path, output_format=output_format)
    layout = resolve_layout(command, cache_dir, config, output_format=output_format)
    return select_journal(command, layout, config, output_format=output_format)


def job_json(job: JobRecord, stale: Staleness | None) -> dict[str, Any]:
    """A job in JSON output: the record, plus ``stale`` (see ``stale_dict``)."""
    return {**job.to_dict(), "stale": stale_dict(job, stale)}
