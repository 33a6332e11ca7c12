"""The controller's and the node's decisions over a fleet snapshot, as pure functions.

:mod:`sbproxy.fleet.agent` reads a :class:`~sbproxy.store.fleet.FleetSnapshot`, calls these,
and carries out what they return (fenced writes, a local reload). Nothing here does I/O or
reads a clock: database time comes in the snapshot.

* :func:`observe` -- each member's state on database time. A controller that took the lease
  less than ``lost_after_ms`` ago counts a member's silence only from its own take-over
  (ARCHITECTURE.md "No re-placement storms"): a new controller never declares a node lost
  for silence it did not witness.
* :func:`node_moves` -- the recorded state changes, each checked against the transition
  table (:func:`~sbproxy.fleet.membership.move`).
* :func:`placement_views` -- the recorded placements as the planner sees them: a placement
  whose definition is the deployment's current one counts as the current revision, so a
  change to one deployment does not roll every other one.
* :func:`judge_own_lease` -- whether a node that cannot renew fences itself.
* :func:`forgettable` -- placements on gone nodes whose replica now serves elsewhere.
* :func:`local_deployments` -- what one node must run: its placements' definitions.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sbproxy.fleet.membership import (
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
from sbproxy.fleet.placement import DeviceCapacity, NodeView, PlacementState, PlacementView

__all__ = [
    "PLACEMENT_FIELDS",
    "UNREACHED_ASKS_TO_FENCE",
    "NodeMove",
    "definition_digest",
    "forgettable",
    "judge_own_lease",
    "local_deployments",
    "node_moves",
    "observe",
    "placement_views",
]

logger = logging.getLogger(__name__)

_GONE = frozenset({NodeState.LOST, NodeState.LEFT})


UNREACHED_ASKS_TO_FENCE = 2
"""Asks in a row that reach no peer at all before a minority partition fences: one slow
answer on a busy host is not a partition."""


def judge_own_lease(
    *,
    since_own_renewal_ms: int,
    timing: FleetTiming,
    peers_known: int,
    answers: Sequence[PeerAnswer],
    unreached_before: int,
) -> tuple[FenceVerdict, int]:
    """:func:`~sbproxy.fleet.membership.fence_verdict`, with a minority-partition fence
    confirmed by a second ask.

    Returns:
        The verdict and the count of asks in a row that reached no peer (pass it back as
        ``unreached_before`` next time). A ``fence`` because no peer answered becomes
        ``hold`` until :data:`UNREACHED_ASKS_TO_FENCE` asks in a row reached none; a peer
        that renewed recently fences at once.
    """
    verdict = fence_verdict(
        since_own_renewal_ms=since_own_renewal_ms,
        timing=timing,
        peers_known=peers_known,
        answers=answers,
    )
    none_reached = bool(answers) and not any(answer.reached for answer in answers)
    unreached = unreached_before + 1 if none_reached else 0
    if none_reached and unreached < UNREACHED_ASKS_TO_FENCE:
        verdict = FenceVerdict.HOLD
    return verdict, unreached


@dataclass(frozen=True)
class NodeMove:
    """A member's recorded state that must change: ``node`` and the checked transition."""

    node: str
    transition: NodeTransition


PLACEMENT_FIELDS = frozenset({"replicas", "required_labels", "spread_by", "heterogeneous_variants"})
"""Fields that say where and how many replicas run, not what one replica runs: a change of
them re-plans, it does not roll the replicas that stay."""


def definition_digest(definition: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys) of what one replica runs: the
    definition without :data:`PLACEMENT_FIELDS`."""
    body = {k: v for k, v in definition.items() if k not in PLACEMENT_FIELDS}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def observe(
    nodes: Sequence[Any],
    *,
    now_ms: int,
    timing: FleetTiming,
    watching_since_ms: int | None = None,
) -> list[NodeView]:
    """Every member as the planner sees it, its state derived on database time.

    Args:
        nodes: ``NodeRow``-shaped members.
        now_ms: Database now.
        timing: The fleet's timing.
        watching_since_ms: When this controller took the lease (database time); silence
            before it is not counted while it is younger than ``lost_after_ms``.
    """
    views = []
    for node in nodes:
        last = node.renewed_at_ms
        if watching_since_ms is not None:
            last = max(last, watching_since_ms)
        state = derive_state(
            last_renewal_ms=last,
            now_ms=now_ms,
            timing=timing,
            cordoned=node.cordoned,
            draining=node.draining,
            left=node.left,
        )
        views.append(
            NodeView(
                id=node.id,
                state=state,
                labels=dict(node.labels),
                engines=frozenset(node.engines),
                devices=tuple(DeviceCapacity.model_validate(d) for d in node.devices),
                cached_artifacts=frozenset(node.artifacts),
            )
        )
    return views


def node_moves(nodes: Sequence[Any], views: Sequence[NodeView]) -> list[NodeMove]:
    """The recorded states that differ from the observed ones, each a checked move; a move
    the table forbids is logged and skipped (a stale read: the next pass sees it again)."""
    observed = {view.id: view.state for view in views}
    moves = []
    for node in nodes:
        recorded = NodeState(node.state)
        now = observed.get(node.id)
        if now is None or now == recorded:
            continue
        try:
            moves.append(NodeMove(node.id, move(recorded, now)))
        except IllegalNodeTransition as exc:
            logger.warning("node %s: %s", node.id, exc)
    return moves


def placement_views(
    placements: Sequence[Any], current: Mapping[str, tuple[int, str]]
) -> list[PlacementView]:
    """Recorded placements for :func:`~sbproxy.fleet.placement.plan`.

    Args:
        placements: ``PlacementRow``-shaped placements.
        current: ``{deployment: (revision, definition digest)}`` of the desired state; a
            placement with that digest is shown at that revision.
    """
    views = []
    for placement in placements:
        revision = placement.revision
        wanted = current.get(placement.deployment)
        if wanted is not None and definition_digest(placement.definition) == wanted[1]:
            revision = wanted[0]
        views.append(
            PlacementView(
                id=placement.id,
                deployment=placement.deployment,
                replica=placement.replica,
                revision=revision,
                node=placement.node,
                devices=tuple(placement.devices),
                reserved_bytes=placement.reserved_bytes,
                state=PlacementState(placement.state),
                replaces=placement.replaces,
            )
        )
    return views


def forgettable(views: Sequence[PlacementView], nodes: Sequence[NodeView]) -> list[str]:
    """Placements on gone (lost, left or unknown) nodes whose replica has a ``ready``
    placement of the same revision on a live node: their rows can go."""
    states = {node.id: node.state for node in nodes}

    def gone(view: PlacementView) -> bool:
        return states.get(view.node, NodeState.LEFT) in _GONE

    serving = {
        (v.deployment, v.replica, v.revision)
        for v in views
        if v.state is PlacementState.READY and not gone(v)
    }
    return sorted(
        v.id for v in views if gone(v) and (v.deployment, v.replica, v.revision) in serving
    )


def local_deployments(placements: Sequence[Any], node_id: str) -> dict[str, dict[str, Any]]:
    """The deployment definitions node ``node_id`` must run: every placement of it that is
    not ``stopping``, the newest revision when one deployment has several; each warm and
    pulled on boot (a placed replica is started, not left for the first request)."""
    chosen: dict[str, Any] = {}
    for placement in placements:
        if placement.node != node_id or placement.state == PlacementState.STOPPING.value:
            continue
        held = chosen.get(placement.deployment)
        if held is None or placement.revision > held.revision:
            chosen[placement.deployment] = placement
    return {
        deployment: {**placement.definition, "warm": True, "pull": "on_boot", "replicas": 1}
        for deployment, placement in sorted(chosen.items())
    }
