"""Whether a text is a usable PostgreSQL journal URL (``proxy.model_host.journal.url``,
``$SBPROXY_JOURNAL_URL``), judged without a driver: the config layer loads no database
library, and the store adds libpq's own parse on top (``sbproxy.store.location``).

libpq itself accepts URLs that name no server (``postgresql://@:5432``: the default Unix
socket, whatever it is on the machine that runs the verb), so a typo or an empty
``${VAR}`` would otherwise surface much later as an unreachable server at a place nobody
wrote. A journal is shared by hosts over the network, so its URL must say where the server
is: a host in the authority part, or ``host=`` / ``hostaddr=`` / ``service=`` among its
parameters (a Unix socket directory, a ``pg_service.conf`` entry).

Messages never quote the URL: it may carry a password.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

__all__ = ["INVALID_JOURNAL_URL", "JOURNAL_URL_FORM", "journal_url_problem"]

# The reason code of an unusable journal URL, wherever it came from (config, env, flag).
INVALID_JOURNAL_URL = "invalid_journal_url"
JOURNAL_URL_FORM = "postgresql://user@host:port/dbname"

_SCHEMES = ("postgresql", "postgres")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")
# Parameters through which libpq learns the server without a host in the authority part.
_SERVER_PARAMETERS = frozenset({"host", "hostaddr", "service"})
_MAX_PORT = 65535


def journal_url_problem(url: str) -> str | None:
    """What makes ``url`` unusable as a PostgreSQL journal URL, or ``None`` when it is usable.

    Args:
        url: The URL as configured (after ``${VAR}`` interpolation).

    Returns:
        One phrase naming the problem (never any part of ``url`` but its scheme), such as
        ``"names no server host"``; ``None`` when the URL has the scheme, a server and
        well-formed ports.
    """
    text = url.strip()
    scheme = text.split("://", 1)[0] if "://" in text else ""
    if not text:
        return "is empty"
    if any(char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in text):
        return "contains spaces or control characters"
    if not _SCHEME.match(scheme):
        return f"is not a URL (expected {JOURNAL_URL_FORM})"
    if scheme.lower() not in _SCHEMES:
        return f"has the scheme {scheme}://, not postgresql:// (the SQLite journal needs no URL)"
    try:
        parts = urlsplit(text)
    except ValueError:
        return "is not a well-formed URL (an unbalanced [ ] around an IPv6 address?)"
    return _servers_problem(parts.netloc.rpartition("@")[2], parts.query)


def _servers_problem(servers: str, query: str) -> str | None:
    """The problem of the authority's ``host:port[,host:port...]`` list (the user and
    password left out: never looked at, never shown) with the URL's ``query``, or ``None``."""
    named = {name for name, _ in parse_qsl(query, keep_blank_values=True)}
    entries = servers.split(",") if servers else []
    if not (entries and _host_and_port(entries[0])[0]) and not named & _SERVER_PARAMETERS:
        return "names no server host (for a Unix socket: ?host=/socket/directory)"
    for server in entries:
        host, port = _host_and_port(server)
        if host is None:
            return "has an IPv6 address without its closing ]"
        if not host and len(entries) > 1:
            return "lists a server without a host"
        if port is not None and not (port.isdigit() and 0 < int(port) <= _MAX_PORT):
            return f"has a port that is not a number from 1 to {_MAX_PORT}"
    return None


def _host_and_port(server: str) -> tuple[str | None, str | None]:
    """``(host, port)`` of one ``host[:port]`` (``[v6]:port`` too); host ``None`` when an
    IPv6 bracket is unclosed, port ``None`` when none is written."""
    if server.startswith("["):
        end = server.find("]")
        if end < 0:
            return None, None
        rest = server[end + 1 :]
        return server[1:end], (rest[1:] if rest.startswith(":") else None)
    host, colon, port = server.partition(":")
    return host, (port if colon else None)
