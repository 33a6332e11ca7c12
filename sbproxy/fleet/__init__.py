"""Several hosts as one fleet: membership (node states on database time, self-fencing) and
placement (a pure planner). Both are pure policy; nothing here is wired into serving yet
(``authority: cluster_authority`` is still refused)."""

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
