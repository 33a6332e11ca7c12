"""Several hosts as one fleet (``authority: cluster_authority``, docs/cluster.md).

Pure policy: membership (node states on database time, self-fencing: ``membership.py``),
placement (a pure planner: ``placement.py``) and the controller's and node's decisions over
a snapshot (``control.py``). Effects: ``agent.py`` (one host's heartbeat, the controller
when elected, its own placements' reconcile, the routing table) over the fleet store
(``sbproxy.store.fleet``); ``cluster.py`` assembles a cluster host. ``routing.py`` and
``view.py`` are the seams the gateway and the console read."""

from __future__ import annotations

from sbproxy.fleet.membership import (
    NODE_TRANSITIONS,
    FenceVerdict,
    FleetTiming,
    IllegalNodeTransition,
    NodeState,
    NodeTransition,
    PeerAnswer,
    derive_state,
    fence_verdict,
    move,
)
from sbproxy.fleet.placement import (
    Decision,
    DeferReason,
    DeferredReplica,
    DeploymentSpec,
    DeviceCapacity,
    NodeView,
    PlacementPlan,
    PlacementPolicy,
    PlacementReason,
    PlacementState,
    PlacementView,
    ReplaceReplica,
    StartReplica,
    StopReplica,
    UnplacedReplica,
    plan,
)

__all__ = [
    "NODE_TRANSITIONS",
    "Decision",
    "DeferReason",
    "DeferredReplica",
    "DeploymentSpec",
    "DeviceCapacity",
    "FenceVerdict",
    "FleetTiming",
    "IllegalNodeTransition",
    "NodeState",
    "NodeTransition",
    "NodeView",
    "PeerAnswer",
    "PlacementPlan",
    "PlacementPolicy",
    "PlacementReason",
    "PlacementState",
    "PlacementView",
    "ReplaceReplica",
    "StartReplica",
    "StopReplica",
    "UnplacedReplica",
    "derive_state",
    "fence_verdict",
    "move",
    "plan",
]
