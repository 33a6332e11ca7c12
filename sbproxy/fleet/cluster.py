"""Assembly of a ``cluster_authority`` host: its node id, the desired state it starts with
(its own placements, so a restarted host serves again at once), and its agent."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread

from sbproxy.config import CompiledConfig, DeploymentConfig
from sbproxy.config.model_host import Authority
from sbproxy.fleet.admission import (
    JoinAdmission,
    NodeCredentialFile,
    configured_join_token,
    shared_admits,
)
from sbproxy.fleet.agent import FleetAgent, NodeIdentity, ask_peers_http
from sbproxy.fleet.control import facts_of, local_deployments
from sbproxy.fleet.membership import LIVE_STATES, FleetTiming
from sbproxy.fleet.placement import PlacementPolicy
from sbproxy.fleet.split import SplitNode, worker_threads
from sbproxy.model_host.artifacts import ArtifactCache
from sbproxy.model_host.artifacts.cache import CachedMetadata
from sbproxy.model_host.artifacts.peers import PeerHolder, PeerSources
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.memory import GgufError, read_gguf_header
from sbproxy.model_host.runtime.reload import with_deployments
from sbproxy.model_host.service import ModelHostService
from sbproxy.store.fleet import FleetStore, NodeRow
from sbproxy.store.node import ENV_NODE_ID, fleet_node_id

__all__ = [
    "MAX_INVENTORY",
    "PEER_STATES",
    "PULLING_WITHIN_S",
    "CacheInventory",
    "CachedFacts",
    "advertise_url",
    "fleet_credential",
    "fleet_store",
    "is_cluster",
    "open_agent",
    "shared_credential",
    "start_node",
    "starting_state",
]


logger = logging.getLogger(__name__)


class CachedFacts:
    """The GGUF header facts of the verified artifacts in one cache, ``{digest: facts JSON}``
    (:func:`~sbproxy.fleet.control.facts_of`): what a node reports so that the controller
    sizes replicas from the model's shape. Each header is read once per process; an
    artifact with no ``.gguf`` file, or whose header cannot be read, is left out."""

    def __init__(self, cache: ArtifactCache) -> None:
        self.cache = cache
        self._known: dict[str, dict[str, Any] | None] = {}

    def __call__(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for metadata in self.cache.published():
            digest = metadata.artifact_digest
            if digest not in self._known:
                self._known[digest] = self._read(metadata)
            facts = self._known[digest]
            if facts is not None:
                found[digest] = facts
        return found

    def _read(self, metadata: CachedMetadata) -> dict[str, Any] | None:
        ggufs = [item for item in metadata.files if item.path.endswith(".gguf")]
        if not ggufs:
            return None
        try:
            header = read_gguf_header(self.cache.snapshot(metadata.artifact_digest) / ggufs[0].path)
        except GgufError as exc:
            logger.warning(
                "artifact %s: no GGUF facts to report: %s", metadata.artifact_digest, exc
            )
            return None
        return facts_of(header)


# A node reports at most this many artifacts (the most recently used first): the row stays
# small, and a cache with more is still served, only not advertised beyond them.
MAX_INVENTORY = 256
# A partial directory counts as a pull under way while something in it changed this
# recently (a pull writes its manifest at its plan and its bytes as they come).
PULLING_WITHIN_S = 60.0
# Members a pull may ask for files: live ones (a suspect one may be slow: it is tried, and
# the next source follows if it fails).
PEER_STATES = LIVE_STATES


class CacheInventory:
    """What a node's cache holds, as it reports it (``fleet_nodes.artifact_inventory_json``):
    ``{artifact digest: {"bytes": N, "verified": bool}}`` -- each published artifact
    (verified against the catalog's SHA-256 when it was pulled: ``verified: true``, ``bytes``
    its total size), then each pull under way -- a partial directory written to within
    :data:`PULLING_WITHIN_S` -- (``verified: false``, ``bytes`` its partials' bytes so far),
    at most :data:`MAX_INVENTORY` entries. Cheap: sizes and times only, nothing hashed."""

    def __init__(self, cache: ArtifactCache) -> None:
        self.cache = cache

    def __call__(self) -> dict[str, dict[str, Any]]:
        published = sorted(self.cache.published(), key=lambda m: -m.last_accessed_ms)
        found: dict[str, dict[str, Any]] = {
            meta.artifact_digest: {"bytes": meta.total_size_bytes, "verified": True}
            for meta in published[:MAX_INVENTORY]
        }
        now = time.time()
        for download in self.cache.partial_downloads():
            if len(found) >= MAX_INVENTORY:
                break
            if download.digest in found or not _touched_since(
                self.cache.layout.partials / download.digest, now - PULLING_WITHIN_S
            ):
                continue
            done = sum(item.bytes for item in download.files)
            found[download.digest] = {"bytes": done, "verified": False}
        return found


def _touched_since(directory: Path, since: float) -> bool:
    """Whether a file of ``directory`` (a pull's partials and manifest) changed after
    ``since`` (wall-clock seconds): a pull under way writes there; a failed one left long
    ago does not."""
    with contextlib.suppress(OSError):
        for path in directory.rglob("*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime >= since:
                    return True
    return False


def peer_sources(agent: FleetAgent, credential: Callable[[], str | None]) -> PeerSources:
    """The :class:`~sbproxy.model_host.artifacts.peers.PeerSources` of ``agent``'s node,
    read from the fleet snapshot of its last heartbeat (no database call per lookup): the
    live members (:data:`PEER_STATES`) with an advertised URL, other than this node, that
    reported an artifact verified (by node id) or a pull of it under way."""

    def live() -> list[NodeRow]:
        snapshot = agent.snapshot
        if snapshot is None:
            return []
        return [
            node
            for node in snapshot.nodes
            if node.id != agent.identity.id
            and not node.left
            and node.state in PEER_STATES
            and node.advertise_url
        ]

    def holders(digest: str) -> list[PeerHolder]:
        return [
            PeerHolder(node=node.id, base_url=str(node.advertise_url))
            for node in live()
            if node.holds(digest)
        ]

    def fetching(digest: str) -> dict[str, int]:
        return {
            node.id: int(entry.get("bytes", 0))
            for node in live()
            if (entry := node.inventory.get(digest)) is not None and not entry.get("verified")
        }

    return PeerSources(
        node=agent.identity.id,
        holders=holders,
        credential=credential,
        fetching=fetching,
        members=lambda: len(live()),
        settle_s=(2 * agent.timing.heartbeat_ms + 250) / 1000,
    )


def is_cluster(compiled: CompiledConfig) -> bool:
    """The host runs under ``authority: cluster_authority``."""
    host = compiled.model_host
    return host is not None and host.authority == Authority.CLUSTER_AUTHORITY


def fleet_credential(compiled: CompiledConfig) -> str | None:
    """The fleet credential of ``compiled`` (``proxy.model_host.fleet.credential``), if any.

    A running host reads it from the configuration its runtime serves *now*
    (``manager.compiled``) at each use, so that a reload that rotates it reaches the lease
    route, the fence ask and peer dispatch alike."""
    host = compiled.model_host
    secret = host.fleet.credential if host is not None else None
    return secret.get_secret_value() if secret is not None else None


def shared_credential(compiled: CompiledConfig) -> str | None:
    """The shared fleet credential of ``compiled`` while it is accepted
    (``accept_shared_credential``), else ``None``."""
    return fleet_credential(compiled) if shared_admits(compiled) else None


def fleet_store(compiled: CompiledConfig) -> FleetStore:
    """The fleet store of a cluster host (its journal is PostgreSQL by config rule)."""
    host = compiled.model_host
    assert host is not None and host.journal is not None  # noqa: S101 - config rule
    timing = FleetTiming.from_config(host.fleet)
    return FleetStore(
        host.journal.url.get_secret_value(),
        statement_deadline_s=timing.store_deadline_ms / 1000,
    )


def start_node(compiled: CompiledConfig, cache_root: Path) -> str:
    """This host's node id; also made the id its jobs record (``$SBPROXY_NODE_ID``), so the
    node-local jobs of its placements are its own."""
    host = compiled.model_host
    node = fleet_node_id(host.node.id if host else None, cache_root)
    os.environ[ENV_NODE_ID] = node
    return node


def advertise_url(compiled: CompiledConfig) -> str:
    """``node.advertise_url``, else the gateway listener's address (loopback when it binds
    every interface: set advertise_url for hosts on other machines)."""
    host = compiled.model_host
    if host is not None and host.node.advertise_url:
        return host.node.advertise_url.rstrip("/")
    proxy = compiled.config.proxy
    bind = proxy.bind_address
    if bind in ("0.0.0.0", "::", ""):  # noqa: S104 - reading the setting, not binding
        bind = "127.0.0.1"
    if ":" in bind:
        bind = f"[{bind}]"
    return f"http://{bind}:{proxy.http_bind_port}"


async def starting_state(compiled: CompiledConfig, store: FleetStore, node: str) -> CompiledConfig:
    """``compiled`` with the deployments placed on ``node`` (none on a new node).

    Raises:
        JournalUnavailable: ``journal_unavailable``.
    """
    snapshot = await anyio.to_thread.run_sync(store.snapshot)
    me = next((n for n in snapshot.nodes if n.id == node), None)
    wanted = {} if me is not None and me.left else local_deployments(snapshot.placements, node)
    deployments = {d: DeploymentConfig.model_validate(b) for d, b in wanted.items()}
    return with_deployments(compiled, deployments)


def open_agent(
    compiled: CompiledConfig, manager: RuntimeManager, store: FleetStore, node: str
) -> FleetAgent:
    """The agent of a cluster host (not joined yet): it joins with its own node credential
    (kept in its cache), else its join token, else -- deprecated -- the shared credential
    (docs/cluster.md, "Admitting nodes"); it presents its node credential to peers once it
    has joined with one."""
    host = compiled.model_host
    assert host is not None  # noqa: S101 - a cluster host has a model host
    service = ModelHostService.serving(manager)
    layout = service.layout
    cache = ArtifactCache(layout)

    def served() -> CompiledConfig:
        return ModelHostService.serving(manager).served

    if shared_admits(compiled):
        logger.warning(
            "proxy.model_host.fleet.credential: the shared fleet credential is deprecated; it "
            "still admits hosts without a join token and is accepted from peers. Once every "
            "member has joined with its own node credential, set "
            "proxy.model_host.fleet.accept_shared_credential: false (docs/cluster.md, "
            '"Admitting nodes")'
        )

    def peer_secret() -> str | None:
        own = agent.node_secret()
        if own is not None:
            return own
        return fleet_credential(served()) if shared_admits(served()) else None

    agent = FleetAgent(
        store=store,
        manager=manager,
        identity=NodeIdentity(
            id=node, labels=dict(host.node.labels), advertise_url=advertise_url(compiled)
        ),
        timing=FleetTiming.from_config(host.fleet),
        policy=PlacementPolicy.from_config(host.fleet),
        artifacts=lambda: sorted(meta.artifact_digest for meta in cache.published()),
        ask_peers=ask_peers_http(peer_secret, as_node=node),
        artifact_facts=CachedFacts(cache),
        admission=JoinAdmission(
            credential_file=NodeCredentialFile(layout.root, node),
            join_token=lambda: configured_join_token(served()),
            shared_admits=lambda: shared_admits(served()),
        ),
        inventory=CacheInventory(cache),
    )

    def fetch_secret() -> str | None:
        # Pulls ask the members that hold an artifact first, unless the file says not to.
        fleet = served().model_host
        if fleet is not None and not fleet.fleet.peer_artifacts:
            return None
        return peer_secret()

    service.engine.add_resource(peer_sources(agent, fetch_secret))
    agent.split = SplitNode(
        node_id=node,
        advertise_url=agent.identity.advertise_url,
        layout=layout,
        executable=manager.provision_engine,
        credentials=agent.credential_hash,
        own_credential=agent.node_secret,
        threads=worker_threads(len(manager.devices.devices)),
        accelerator=manager.devices.accelerator.value,
    )
    return agent
