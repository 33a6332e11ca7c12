"""Which journal a process uses, and what may be shown of it (light: no driver is loaded
until a URL has to be read).

:func:`journal_location` is the one answer, for ``serve`` and every CLI verb alike:
``proxy.model_host.journal.url`` of the configuration in force (``-f sb.yml``) names a
PostgreSQL journal; else ``$SBPROXY_JOURNAL_URL``; else the SQLite file in the cache
directory, as always. A URL that cannot name a server is refused here, where it is chosen
(``invalid_journal_url``, naming where it came from), never taken for an unreachable one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from sbproxy.errors import SbproxyError

if TYPE_CHECKING:
    from sbproxy.config import ModelHostConfig

__all__ = [
    "CONFIG_JOURNAL_URL",
    "ENV_JOURNAL_URL",
    "check_journal_url",
    "journal_display",
    "journal_location",
]

ENV_JOURNAL_URL = "SBPROXY_JOURNAL_URL"
CONFIG_JOURNAL_URL = "proxy.model_host.journal.url"


def journal_location(sqlite_file: Path, host: ModelHostConfig | None = None) -> Path | str:
    """Where this process's journal is.

    Args:
        sqlite_file: The cache's SQLite journal (``CacheLayout.journal``).
        host: ``proxy.model_host`` of the configuration in force, if any.

    Returns:
        ``host.journal.url``, else ``$SBPROXY_JOURNAL_URL`` (either a checked
        ``postgresql://`` URL), else ``sqlite_file``.

    Raises:
        SbproxyError: ``invalid_journal_url`` (not retryable) when the URL chosen cannot name
            a PostgreSQL server; the message names its source, never its password.
    """
    configured = host.journal if host is not None else None
    if configured is not None:
        return check_journal_url(configured.url.get_secret_value(), source=CONFIG_JOURNAL_URL)
    from_env = os.environ.get(ENV_JOURNAL_URL, "").strip()
    if from_env:
        return check_journal_url(from_env, source=f"${ENV_JOURNAL_URL}")
    return sqlite_file


def check_journal_url(url: str, *, source: str) -> str:
    """``url`` when it names a PostgreSQL journal libpq can read, else refuse it.

    Args:
        url: The URL.
        source: Where it came from, for the message (``proxy.model_host.journal.url``,
            ``$SBPROXY_JOURNAL_URL``, ``--to``).

    Returns:
        ``url`` unchanged.

    Raises:
        SbproxyError: ``invalid_journal_url`` (not retryable), naming ``source`` and the
            problem, never the URL itself (it may hold a password).
    """
    # Imported here: ``sbproxy.config`` loads the pydantic models, which a verb that reads a
    # SQLite journal (`jobs list`) does without.
    from sbproxy.config.journal_url import (
        INVALID_JOURNAL_URL,
        JOURNAL_URL_FORM,
        journal_url_problem,
    )

    problem = journal_url_problem(url)
    if problem is None:
        # What only libpq knows (an unknown parameter, a bad percent-escape).
        from sbproxy.store.postgres import PgTarget

        try:
            PgTarget.parse(url)
        except SbproxyError as exc:
            # Its message names the URL by scheme only; libpq's reason follows the colon.
            reason = exc.message.strip().rpartition("connection URL: ")[2]
            problem = f"is not a libpq connection URL ({reason})"
    if problem is None:
        return url
    raise SbproxyError(
        f"{source} is not a usable journal URL: it {problem}",
        code=INVALID_JOURNAL_URL,
        retryable=False,
        remediation=f"Write {JOURNAL_URL_FORM} in {source} (the password in ${{ENV}} "
        "interpolation or a pgpass file), or leave it unset for the SQLite journal in the "
        "cache directory.",
        details={"source": source},
    )


def journal_display(location: Path | str) -> str:
    """What output may show of ``location``: the SQLite path, or
    ``postgresql://user@host:port/db`` without the password or other parameters."""
    if isinstance(location, Path):
        return str(location)
    from sbproxy.store.postgres import PgTarget

    try:
        return PgTarget.parse(location).describe()
    except SbproxyError:
        return "postgresql://(invalid URL)"
