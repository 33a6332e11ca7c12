"""The node a process runs on: the name every job it submits records.

Jobs are node-local (a pull fills this node's cache, a build, launch or drain acts on this
node's engines), so a job is claimed, and recovered from a dead runner, only on the node that
recorded it; a node that died leaves its jobs ``stale`` in the shared journal until it comes
back (``docs/operations.md``, "Running on PostgreSQL").

On SQLite every process of a cache is one node anyway, and the node id is
``$SBPROXY_NODE_ID`` when set, else the host name. On a PostgreSQL journal, shared by many
hosts, the host name is no identity -- two caches on one machine would share one node and
join each other's jobs (issue 30, item 12) -- so every process of a cache, ``serve`` and the
CLI verbs alike, records the cache's own node id (:func:`journal_node_id`): the configured
``proxy.model_host.node.id``, else ``$SBPROXY_NODE_ID``, else a ULID made once and kept in
``<cache>/node-id`` (a configured id is written there too, so a verb run without the config
agrees with ``serve``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ulid import ULID

from sbproxy.errors import SbproxyError

__all__ = ["ENV_NODE_ID", "MAX_NODE_ID_CHARS", "fleet_node_id", "journal_node_id", "node_id"]

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
    path = cache_root / NODE_ID_FILE
    try:
        # A verb may name a cache that does not exist yet (its journal on PostgreSQL):
        # the id is the cache's from its first use on.
        cache_root.mkdir(parents=True, exist_ok=True)
        kept = path.read_text().strip() if path.exists() else ""
        if configured:
            chosen = configured[:MAX_NODE_ID_CHARS]
            if kept != chosen:
                _write(path, chosen)  # every process of this cache records the same node
            return chosen
        from_env = os.environ.get(ENV_NODE_ID, "").strip()
        if from_env:
            return from_env[:MAX_NODE_ID_CHARS]
        if kept:
            return kept[:MAX_NODE_ID_CHARS]
        fresh = str(ULID()).lower()
        _write(path, fresh)
        return fresh
    except OSError as exc:
        raise SbproxyError(
            f"the node id file {path} cannot be used ({exc.strerror})",
            code="store_failed",
            remediation="Set proxy.model_host.node.id, or fix the cache directory's permissions.",
        ) from None


def _write(path: Path, node: str) -> None:
    temporary = path.with_name(f".{NODE_ID_FILE}.{os.getpid()}")
    temporary.write_text(node + "\n")
    temporary.replace(path)


def journal_node_id(
    location: Path | str, cache_root: Path, configured: str | None = None
) -> str | None:
    """The node id jobs in the journal at ``location`` record for the cache at
    ``cache_root``: on PostgreSQL the cache's own (:func:`fleet_node_id`, module docstring);
    on SQLite ``None`` (:func:`node_id`, the default).

    Raises:
        SbproxyError: ``store_failed`` when the id file cannot be read or written.
    """
    if isinstance(location, Path):
        return None
    return fleet_node_id(configured, cache_root)
