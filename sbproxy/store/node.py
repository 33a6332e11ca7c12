"""The node a process runs on: the name every job it submits records.

Jobs are node-local (a pull fills this node's cache, a build, launch or drain acts on this
node's engines), so a job is claimed, and recovered from a dead runner, only on the node that
recorded it; a node that died leaves its jobs ``stale`` in the shared journal until it comes
back (``docs/operations.md``, "Running on PostgreSQL").

The node id is ``$SBPROXY_NODE_ID`` when set, else the host name: stable across restarts and
the same for every process of one machine (``serve`` and the CLI verbs agree without sharing
anything). Two hosts on one machine sharing a PostgreSQL journal (separate caches) set
``SBPROXY_NODE_ID`` apart. On SQLite every process of a cache is one node anyway.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ulid import ULID

from sbproxy.errors import SbproxyError

__all__ = ["ENV_NODE_ID", "MAX_NODE_ID_CHARS", "fleet_node_id", "node_id"]

ENV_NODE_ID = "SBPROXY_NODE_ID"
MAX_NODE_ID_CHARS = 128


def node_id() -> str:
    """This process's node id (module docstring): at most 128 characters, never empty."""
    chosen = os.environ.get(ENV_NODE_ID, "").strip() or socket.gethostname() or "localhost"
    return chosen[:MAX_NODE_ID_CHARS]


NODE_ID_FILE = "node-id"


def fleet_node_id(configured: str | None, cache_root: Path) -> str:
    """The fleet node id of the host serving ``cache_root``: ``configured``
    (``proxy.model_host.node.id``), else ``$SBPROXY_NODE_ID``, else a ULID generated once and
    kept in ``<cache_root>/node-id`` (stable across restarts of this cache).

    Raises:
        SbproxyError: ``store_failed`` when the id file cannot be read or written.
    """
    if configured:
        return configured[:MAX_NODE_ID_CHARS]
    chosen = os.environ.get(ENV_NODE_ID, "").strip()
    if chosen:
        return chosen[:MAX_NODE_ID_CHARS]
    path = cache_root / NODE_ID_FILE
    try:
        kept = path.read_text().strip() if path.exists() else ""
        if kept:
            return kept[:MAX_NODE_ID_CHARS]
        fresh = str(ULID()).lower()
        temporary = path.with_name(f".{NODE_ID_FILE}.{os.getpid()}")
        temporary.write_text(fresh + "\n")
        temporary.replace(path)
        return fresh
    except OSError as exc:
        raise SbproxyError(
            f"the node id file {path} cannot be used ({exc.strerror})",
            code="store_failed",
            remediation="Set proxy.model_host.node.id, or fix the cache directory's permissions.",
        ) from None
