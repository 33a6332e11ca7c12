"""The fleet's routing table as the gateway reads it: which node serves which deployment,
how busy each replica said it was, and where to reach it.

This is the seam between the fleet's control side (membership, placement, the
``FleetDirectory`` that builds tables from them) and peer dispatch in the gateway
(``sbproxy/api/peers.py``). Pure values and one protocol: no I/O, no clock reads -- the
directory stamps each table with the monotonic time it was made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "FleetDirectory",
    "FleetWaker",
    "PeerReplica",
    "RoutingTable",
    "replica_deployment_id",
    "replica_id_clashes",
]

_REPLICA_ID = re.compile(r"^(?P<deployment>.+)\.r(?P<replica>[1-9][0-9]*)$")


def replica_deployment_id(deployment: str, replica: int) -> str:
    """The id a node's runtime runs replica ``replica`` of fleet deployment ``deployment``
    under: the deployment's own id for replica 0, ``<deployment>.r<replica>`` for the others
    (``chat``, ``chat.r1``, ``chat.r2``). A pure function of the placement, so a replica
    keeps its local id (its engine, its logs, its generations) for its whole life on a node,
    whichever other replicas come and go there; a node can run several replicas of one
    deployment side by side, each on its own devices. The fleet refuses a desired state
    with a deployment id that another deployment's replicas may run under
    (:func:`replica_id_clashes`, ``invalid_desired``).

    Raises:
        ValueError: ``replica`` < 0 (a caller bug).
    """
    if replica < 0:
        raise ValueError(f"replica must be >= 0, got {replica}")
    return deployment if replica == 0 else f"{deployment}.r{replica}"


def replica_id_clashes(deployments: Iterable[str]) -> list[tuple[str, str, int]]:
    """The deployment ids of a fleet's desired state that another deployment's replicas
    may run under on a node (``chat.r1`` beside ``chat``, whatever its replica count: a
    replica of an earlier revision may still hold that id while it stops), as
    ``(id, deployment, replica)``, sorted; empty when none clash."""
    ids = set(deployments)
    clashes = []
    for name in sorted(ids):
        found = _REPLICA_ID.match(name)
        if found is not None and found["deployment"] in ids:
            clashes.append((name, found["deployment"], int(found["replica"])))
    return clashes


@dataclass(frozen=True, slots=True)
class PeerReplica:
    """One replica of a deployment on one node, as last reported.

    Attributes:
        deployment: The deployment's operator id.
        node_id: The node serving it.
        base_url: That node's gateway URL (its ``node.advertise_url``), e.g.
            ``http://127.0.0.1:8081`` -- no trailing slash.
        generation: The replica's runtime generation on that node.
        ready: The node is ``ready`` and the replica can take a request (ready, or idle and
            loadable).
        active: Requests in flight at the replica when it last reported (heartbeat or
            health answer).
        queued: Requests waiting for admission at the replica when it last reported.
        loaded: Its engine runs now. ``False`` with ``ready``: idle and loadable -- keep-alive
            stopped its engine, and the node loads it again for the first request (hop or
            its own), as a single host does; the gateway picks such a replica only when no
            loaded one is ready.
        local_id: The id its node's runtime runs it under (:func:`replica_deployment_id`);
            the deployment id when not given.
        routing: Its deployment's ``routing`` (``least_outstanding`` or ``prefix``), as its
            placement's definition says: how a gateway picks among the replicas.
    """

    deployment: str
    node_id: str
    base_url: str
    generation: int
    ready: bool
    active: int
    queued: int
    loaded: bool = True
    local_id: str = ""
    routing: str = "least_outstanding"

    @property
    def runtime_id(self) -> str:
        """``local_id``, or the deployment id when the table did not name one."""
        return self.local_id or self.deployment

    @property
    def replica_key(self) -> str:
        """The replica's id for prefix routing (:mod:`sbproxy.fleet.prefix`), the same on
        every gateway: ``<node>/<runtime id>``."""
        return f"{self.node_id}/{self.runtime_id}"


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """A snapshot of every replica of the fleet, by deployment.

    Attributes:
        local_node_id: The node this table was made on (its own replicas are in the table
            too, under this id).
        replicas: The replicas of each deployment, by deployment name.
        taken_at: Monotonic seconds (``time.monotonic()`` of the node that made it) when the
            snapshot was taken.
        wakeable: ``{deployment: queue_timeout_ms}`` of the fleet's deployments that scale
            to zero (``replicas: {min: 0, ...}``): with no replica, a request asks the fleet
            for one and waits up to that long.
    """

    local_node_id: str
    replicas: Mapping[str, tuple[PeerReplica, ...]]
    taken_at: float
    wakeable: Mapping[str, int] = field(default_factory=dict)

    def for_deployment(self, name: str) -> tuple[PeerReplica, ...]:
        """The replicas of deployment ``name``; empty when the fleet has none."""
        return self.replicas.get(name, ())


class FleetDirectory(Protocol):
    """Where the gateway gets the fleet's routing table."""

    def routing(self) -> RoutingTable:
        """The current routing table: a snapshot, cheap to call on every request, never
        blocking on the database (the directory refreshes it in the background)."""
        ...


@runtime_checkable
class FleetWaker(Protocol):
    """What asks the fleet for a replica of a deployment scaled to zero."""

    async def wake(self, deployment: str) -> bool:
        """Record that a request wants ``deployment``; whether this call wrote the demand.

        Raises:
            JournalUnavailable: ``journal_unavailable``.
        """
        ...
