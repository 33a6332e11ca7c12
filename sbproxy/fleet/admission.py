"""A fleet member's side of admission (docs/cluster.md, "Admitting nodes"): its own node
credential, kept in its cache, the join token it may redeem, and the check a gateway makes of
a peer's credential.

* **The node credential** (:class:`NodeCredentialFile`): made once per cache and node id and
  kept in ``<cache>/fleet-node-credential`` (JSON ``{node_id, credential}``, mode ``0600``,
  written by temp file and rename). It is written *before* the join that records its hash,
  so a crash between the two leaves a credential the next start presents (and a join token
  installs); a file of another node id is ignored (a fresh one is made).
* **The join token**: ``proxy.model_host.fleet.join_token``, else ``$SBPROXY_JOIN_TOKEN``;
  used only when the fleet does not know this node's credential yet.
* **Peer checks** (:class:`PeerCredentials`): built from the fleet snapshot a host reads every
  heartbeat and at every change it is told of (``NOTIFY``; a revocation is one), so a
  gateway never waits on the database to check a hop. A revoked or removed member is refused
  whatever it presents; a member's own credential is checked against its recorded SHA-256 in
  constant time; anything else is left to the deprecated shared credential, when accepted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from sbproxy.config import CompiledConfig
from sbproxy.errors import SbproxyError
from sbproxy.store.admission import (
    credential_matches,
    new_node_credential,
    parse_join_token,
    secret_hash,
)
from sbproxy.store.fleet import NodeRow

__all__ = [
    "CREDENTIAL_FILE",
    "ENV_JOIN_TOKEN",
    "JoinAdmission",
    "NodeCredentialFile",
    "PeerAdmission",
    "PeerCheck",
    "PeerCredentials",
    "configured_join_token",
    "shared_admits",
]

logger = logging.getLogger(__name__)

CREDENTIAL_FILE = "fleet-node-credential"
ENV_JOIN_TOKEN = "SBPROXY_JOIN_TOKEN"  # noqa: S105 - the variable's name


class PeerCheck(StrEnum):
    """What a host knows of a peer's presented credential."""

    VALID = "valid"
    """The named member's own node credential."""
    REFUSED = "refused"
    """The named member is revoked or removed: refused whatever it presents."""
    UNKNOWN = "unknown"
    """Not a member's credential this host knows (the shared credential may still admit)."""


@runtime_checkable
class PeerAdmission(Protocol):
    """What the gateway asks of its fleet about peer credentials (the agent answers)."""

    def node_secret(self) -> str | None:
        """This node's own credential to present to peers; ``None`` before it joined."""
        ...

    def check_peer(self, node: str, secret: str) -> PeerCheck:
        """Whether ``secret`` is member ``node``'s own credential (:class:`PeerCheck`)."""
        ...


@dataclass(frozen=True)
class PeerCredentials:
    """The members' credential hashes as of one fleet snapshot."""

    hashes: MappingProxyType[str, str]
    refused: frozenset[str]

    @classmethod
    def from_nodes(cls, nodes: Iterable[NodeRow]) -> PeerCredentials:
        """From the members of a snapshot: revoked or removed ones refused, the others'
        recorded hashes."""
        hashes: dict[str, str] = {}
        refused: set[str] = set()
        for node in nodes:
            if node.left or node.revoked:
                refused.add(node.id)
            elif node.credential_sha256:
                hashes[node.id] = node.credential_sha256
        return cls(MappingProxyType(hashes), frozenset(refused))

    @classmethod
    def empty(cls) -> PeerCredentials:
        """Nothing known yet (before the first snapshot)."""
        return cls(MappingProxyType({}), frozenset())

    def knows(self, node: str) -> bool:
        """Whether ``node`` is a member of the snapshot (refused, or with a credential)."""
        return node in self.refused or node in self.hashes

    def check(self, node: str | None, secret: str) -> PeerCheck:
        """:class:`PeerCheck` of ``secret`` presented as member ``node``."""
        if node is None:
            return PeerCheck.UNKNOWN
        if node in self.refused:
            return PeerCheck.REFUSED
        if credential_matches(self.hashes.get(node), secret_hash(secret)):
            return PeerCheck.VALID
        return PeerCheck.UNKNOWN


class NodeCredentialFile:
    """This node's own credential in ``<cache_root>/fleet-node-credential`` (module
    docstring)."""

    def __init__(self, cache_root: Path, node_id: str) -> None:
        self.path = cache_root / CREDENTIAL_FILE
        self.node_id = node_id

    def load_or_make(self) -> str:
        """The credential kept for this node id, or a fresh one written first.

        Raises:
            SbproxyError: ``store_failed`` -- the file cannot be read or written.
        """
        try:
            kept = self._read()
            if kept is not None:
                return kept
            fresh = new_node_credential()
            self._write(fresh)
            return fresh
        except OSError as exc:
            raise SbproxyError(
                f"the node credential file {self.path} cannot be used ({exc.strerror})",
                code="store_failed",
                remediation="Fix the cache directory's permissions (the host writes its node "
                "credential there, mode 0600).",
            ) from None

    def _read(self) -> str | None:
        if not self.path.exists():
            return None
        try:
            body = json.loads(self.path.read_text())
        except ValueError:
            logger.warning("node credential file %s is unreadable: making a new one", self.path)
            return None
        if not isinstance(body, dict) or body.get("node_id") != self.node_id:
            return None
        secret = body.get("credential")
        return secret if isinstance(secret, str) and secret else None

    def _write(self, secret: str) -> None:
        temporary = self.path.with_name(f".{CREDENTIAL_FILE}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump({"node_id": self.node_id, "credential": secret}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(self.path)


@dataclass(frozen=True)
class JoinAdmission:
    """What a node brings to its join (docs/cluster.md, "Admitting nodes").

    Attributes:
        credential_file: Where it keeps its own node credential.
        join_token: The join token it may redeem (``(id, secret hash)``), read at each join.
        shared_admits: Whether the deprecated shared credential admits it, read at each join.
    """

    credential_file: NodeCredentialFile
    join_token: Callable[[], tuple[str, str] | None]
    shared_admits: Callable[[], bool]


def configured_join_token(compiled: CompiledConfig) -> tuple[str, str] | None:
    """``(id, secret hash)`` of the join token this host may redeem:
    ``proxy.model_host.fleet.join_token``, else ``$SBPROXY_JOIN_TOKEN``; ``None`` when
    neither is set.

    Raises:
        JoinRefused: ``join_token_invalid`` -- ``$SBPROXY_JOIN_TOKEN`` is not a token (the
            config field is checked at load time).
    """
    host = compiled.model_host
    secret = host.fleet.join_token if host is not None else None
    text = secret.get_secret_value() if secret is not None else os.environ.get(ENV_JOIN_TOKEN)
    if not text or not text.strip():
        return None
    return parse_join_token(text)


def shared_admits(compiled: CompiledConfig) -> bool:
    """Whether the deprecated shared fleet credential is in force: configured, and
    ``accept_shared_credential`` not turned off."""
    host = compiled.model_host
    return (
        host is not None
        and host.fleet.credential is not None
        and host.fleet.accept_shared_credential
    )
