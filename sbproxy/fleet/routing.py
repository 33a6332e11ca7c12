"""The fleet's routing table as the gateway reads it: which node serves which deployment,
how busy each replica said it was, and where to reach it.

This is the seam between the fleet's control side (membership, placement, the
``FleetDirectory`` that builds tables from them) and peer dispatch in the gateway
(``sbproxy/api/peers.py``). Pure values and one protocol: no I/O, no clock reads -- the
directory stamps each table with the monotonic time it was made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["FleetDirectory", "PeerReplica", "RoutingTable"]


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
    """

    deployment: str
    node_id: str
    base_url: str
    generation: int
    ready: bool
    active: int
    queued: int
    loaded: bool = True


@dataclass(frozen=True, slots=True)
class RoutingTable:
    """A snapshot of every replica of the fleet, by deployment.

    Attributes:
        local_node_id: The node this table was made on (its own replicas are in the table
            too, under this id).
        replicas: The replicas of each deployment, by deployment name.
        taken_at: Monotonic seconds (``time.monotonic()`` of the node that made it) when the
            snapshot was taken.
    """

    local_node_id: str
    replicas: Mapping[str, tuple[PeerReplica, ...]]
    taken_at: float

    def for_deployment(self, name: str) -> tuple[PeerReplica, ...]:
        """The replicas of deployment ``name``; empty when the fleet has none."""
        return self.replicas.get(name, ())


class FleetDirectory(Protocol):
    """Where the gateway gets the fleet's routing table."""

    def routing(self) -> RoutingTable:
        """The current routing table: a snapshot, cheap to call on every request, never
        blocking on the database (the directory refreshes it in the background)."""
        ...
