"""The fleet's routing table as the gateway reads it (the seam of FLEET-INTERFACE.md).

Pure values and one Protocol; no I/O. The membership side (``fleet/agent.py``) builds a
:class:`RoutingTable` from the members, their placements and the active/queued counts each
replica reported with its last heartbeat, and swaps it in after every heartbeat; the gateway
reads the snapshot it holds, never the database.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["FleetDirectory", "PeerReplica", "RoutingTable"]


@dataclass(frozen=True, slots=True)
class PeerReplica:
    """One replica of a deployment on one node.

    Attributes:
        deployment: Deployment name.
        node_id: The node serving it.
        base_url: That node's gateway URL (its ``advertise_url``).
        generation: Its runtime generation.
        ready: The node is ``ready`` and the replica's runtime state is ready or idle-loadable.
        active: In-flight requests the replica reported.
        queued: Queued requests the replica reported.
    """

    deployment: str
    node_id: str
    base_url: str
    generation: int
    ready: bool
    active: int
    queued: int


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """A snapshot of every replica by deployment name.

    Attributes:
        local_node_id: This host's node id.
        replicas: Replicas by deployment name.
        taken_at: Monotonic seconds when the snapshot was made.
    """

    local_node_id: str
    replicas: Mapping[str, tuple[PeerReplica, ...]]
    taken_at: float

    def for_deployment(self, name: str) -> tuple[PeerReplica, ...]:
        """The replicas of deployment ``name`` (empty when it has none)."""
        return tuple(self.replicas.get(name, ()))


class FleetDirectory(Protocol):
    """Where the gateway gets the fleet's routing table."""

    def routing(self) -> RoutingTable:
        """A snapshot: cheap, never blocks on the database."""
        ...
