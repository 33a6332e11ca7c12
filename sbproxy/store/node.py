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

__all__ = ["ENV_NODE_ID", "MAX_NODE_ID_CHARS", "node_id"]

ENV_NODE_ID = "SBPROXY_NODE_ID"
MAX_NODE_ID_CHARS = 128


def node_id() -> str:
    """This process's node id (module docstring): at most 128 characters, never empty."""
    chosen = os.environ.get(ENV_NODE_ID, "").strip() or socket.gethostname() or "localhost"
    return chosen[:MAX_NODE_ID_CHARS]
