"""Which journal a process uses, and what may be shown of it (light: no driver is loaded).

``proxy.model_host.journal.url`` (``serve``, and the verbs that read ``sb.yml``) names a
PostgreSQL journal; else ``$SBPROXY_JOURNAL_URL`` (the CLI's verbs); else the SQLite file in
the cache directory, as always.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_JOURNAL_URL", "journal_display", "journal_location"]

ENV_JOURNAL_URL = "SBPROXY_JOURNAL_URL"


def journal_location(sqlite_file: Path, configured_url: str | None = None) -> Path | str:
    """Where this process's journal is: ``configured_url`` (``proxy.model_host.journal.url``),
    else ``$SBPROXY_JOURNAL_URL``, else the SQLite file in the cache (``sqlite_file``)."""
    if configured_url:
        return configured_url
    from_env = os.environ.get(ENV_JOURNAL_URL, "").strip()
    return from_env or sqlite_file


def journal_display(location: Path | str) -> str:
    """What output may show of ``location``: the SQLite path, or
    ``postgresql://user@host:port/db`` without the password or other parameters."""
    if isinstance(location, Path):
        return str(location)
    from sbproxy.errors import SbproxyError
    from sbproxy.store.postgres import PgTarget

    try:
        return PgTarget.parse(location).describe()
    except SbproxyError:
        return "postgresql://(invalid URL)"
