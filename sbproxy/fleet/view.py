"""The fleet as an operator sees it: nodes, replicas per deployment, the controller and the
live placement jobs -- what the console's fleet page (``/admin/ui/fleet``) shows.

Pure values and one protocol, like :mod:`sbproxy.fleet.routing`: the fleet's control side
(membership, controller, placement) implements :class:`FleetStatus`; the console only reads
the :class:`FleetView` it returns. Ages are given in milliseconds on database time (``now``
minus the row's stamp, both read from the shared database's clock), so no host's clock
drift shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ArtifactRow",
    "ControllerRow",
    "FleetStatus",
    "FleetView",
    "NodeRow",
    "PlacementJobRow",
    "ReplicaRow",
    "artifact_rows",
]


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One member of the fleet.

    Attributes:
        node_id: The node's stable id.
        state: Its membership state (a :class:`~sbproxy.fleet.membership.NodeState` value:
            ``ready``, ``suspect``, ``lost``, ``cordoned``, ``draining``, ``left``).
        heartbeat_age_ms: Milliseconds since its last lease renewal, on database time;
            ``None`` when it never renewed.
        advertise_url: Where peers reach its gateway; ``None`` when not advertised.
        labels: Its labels (``proxy.model_host.node.labels``).
    """

    node_id: str
    state: str
    heartbeat_age_ms: int | None
    advertise_url: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica of a deployment, placed on a node.

    Attributes:
        deployment: The deployment's id.
        node_id: The node it is placed on.
        state: Its state as its node last reported it (the runtime's deployment state, e.g.
            ``ready``, ``loading``, ``cold``, ``failed``; or ``placing`` before the node took
            it up).
        generation: Its runtime generation on that node (0 before the first launch).
        port: The engine's port on that node, when running.
        active: Requests in flight at it, as last reported.
        queued: Requests waiting for admission at it, as last reported.
    """

    deployment: str
    node_id: str
    state: str
    generation: int = 0
    port: int | None = None
    active: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class ControllerRow:
    """The elected controller.

    Attributes:
        node_id: The node holding the controller lease.
        epoch: The fencing epoch its writes carry.
        lease_expires_in_ms: Milliseconds until its lease runs out unless renewed (database
            time; negative once expired).
    """

    node_id: str
    epoch: int
    lease_expires_in_ms: int | None = None


@dataclass(frozen=True, slots=True)
class PlacementJobRow:
    """A placement job that has not ended.

    Attributes:
        job_id: The job's id (a ULID; its page is ``/admin/ui/jobs/<id>``).
        kind: What it does (e.g. ``place``, ``replace``, ``stop``, ``drain``).
        deployment: The deployment it moves.
        node_id: The node it acts on, when it names one.
        status: Its journal status (``pending``, ``running``, ...).
        age_ms: Milliseconds since it was created (database time).
    """

    job_id: str
    kind: str
    deployment: str
    node_id: str | None
    status: str
    age_ms: int


@dataclass(frozen=True, slots=True)
class ArtifactRow:
    """Where one artifact is cached in the fleet.

    Attributes:
        artifact_digest: The artifact's digest (hex SHA-256 of its canonical description).
        size_bytes: Its total size, as the members that hold it reported it.
        nodes: The members that hold it verified, sorted.
        fetching: The members pulling it now (reported unverified), sorted.
    """

    artifact_digest: str
    size_bytes: int
    nodes: tuple[str, ...]
    fetching: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``/admin/fleet/placements``, ``sbproxy models ps --fleet``)."""
        return {
            "artifact_digest": self.artifact_digest,
            "size_bytes": self.size_bytes,
            "nodes": list(self.nodes),
            "fetching": list(self.fetching),
        }


class _Member(Protocol):
    """What :func:`cached_artifacts` reads of a member's row (``store.fleet.NodeRow``)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def left(self) -> bool: ...
    @property
    def inventory(self) -> dict[str, dict[str, Any]]: ...


def cached_artifacts(members: Iterable[_Member], live: frozenset[str]) -> tuple[ArtifactRow, ...]:
    """:func:`artifact_rows` of the members whose state is in ``live`` (they serve their
    cache to peers): a lost or departed node's last report is not a place a file is cached."""
    return artifact_rows(
        (member.id, member.inventory)
        for member in members
        if not member.left and member.state in live
    )


def artifact_rows(
    inventories: Iterable[tuple[str, Mapping[str, Mapping[str, Any]]]],
) -> tuple[ArtifactRow, ...]:
    """Every artifact any member reported, by digest: ``inventories`` is ``(node id, its
    artifact inventory)`` per member (``{digest: {"bytes", "verified"}}``)."""
    held: dict[str, set[str]] = {}
    pulling: dict[str, set[str]] = {}
    sizes: dict[str, int] = {}
    for node, inventory in inventories:
        for digest, entry in inventory.items():
            if entry.get("verified"):
                held.setdefault(digest, set()).add(node)
                sizes[digest] = int(entry.get("bytes", 0))
            else:
                pulling.setdefault(digest, set()).add(node)
    return tuple(
        ArtifactRow(
            artifact_digest=digest,
            size_bytes=sizes.get(digest, 0),
            nodes=tuple(sorted(held.get(digest, ()))),
            fetching=tuple(sorted(pulling.get(digest, ()))),
        )
        for digest in sorted(set(held) | set(pulling))
    )


@dataclass(frozen=True, slots=True)
class FleetView:
    """A snapshot of the fleet for the console.

    Attributes:
        local_node_id: The node that made it (this host).
        nodes: Every member, sorted by id.
        desired: Desired replicas by deployment (the fleet's desired state).
        replicas: Every placed replica, sorted by deployment then node.
        controller: The elected controller; ``None`` when none holds the lease.
        jobs: The placement jobs that have not ended, oldest first.
        artifacts: Where each artifact is cached (:func:`artifact_rows`), by digest.
    """

    local_node_id: str
    nodes: tuple[NodeRow, ...]
    desired: Mapping[str, int]
    replicas: tuple[ReplicaRow, ...]
    controller: ControllerRow | None
    jobs: tuple[PlacementJobRow, ...] = ()
    artifacts: tuple[ArtifactRow, ...] = ()

    def replicas_of(self, deployment: str) -> tuple[ReplicaRow, ...]:
        """The replicas of ``deployment``."""
        return tuple(r for r in self.replicas if r.deployment == deployment)

    def deployments(self) -> list[str]:
        """Every deployment the view names (desired or placed), sorted."""
        return sorted(set(self.desired) | {r.deployment for r in self.replicas})


class FleetStatus(Protocol):
    """Where the console gets the fleet's view."""

    async def view(self) -> FleetView:
        """The fleet now (may read the shared database; answers within a few seconds or
        raises :class:`~sbproxy.errors.SbproxyError`, e.g. ``journal_unavailable``)."""
        ...
