"""The controller's and the node's pure decisions over a fleet snapshot (fleet/control.py),
table-tested: states on database time with the take-over grace, checked moves, placements
shown at the current revision by definition, gone placements forgotten only once replaced,
and what one node must run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from sbproxy.fleet.control import (
    definition_digest,
    forgettable,
    judge_own_lease,
    local_deployments,
    node_moves,
    observe,
    placement_views,
)
from sbproxy.fleet.membership import FenceVerdict, FleetTiming, NodeState, PeerAnswer
from sbproxy.fleet.placement import NodeView, PlacementState

TIMING = FleetTiming(heartbeat_ms=1_000, fence_after_ms=5_000, lost_after_ms=10_000)
NOW = 1_000_000


@dataclass
class Node:
    id: str
    renewed_at_ms: int = NOW
    state: str = "ready"
    cordoned: bool = False
    draining: bool = False
    left: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    engines: list[str] = field(default_factory=lambda: ["llama_cpp"])
    devices: list[dict[str, int]] = field(
        default_factory=lambda: [{"index": 0, "capacity_bytes": 100}]
    )
    artifacts: list[str] = field(default_factory=list)


@dataclass
class Placement:
    id: str
    node: str
    deployment: str = "chat"
    replica: int = 0
    revision: int = 1
    state: str = "ready"
    definition: dict[str, Any] = field(default_factory=lambda: {"model": "m"})
    devices: tuple[int, ...] = (0,)
    reserved_bytes: int = 10
    replaces: str | None = None


@pytest.mark.parametrize(
    ("silence_ms", "flags", "watching_since", "expected"),
    [
        (0, {}, None, NodeState.READY),
        (1_500, {}, None, NodeState.READY),
        (1_501, {}, None, NodeState.SUSPECT),
        (10_000, {}, None, NodeState.LOST),
        (10_000, {"cordoned": True}, None, NodeState.LOST),
        (0, {"cordoned": True}, None, NodeState.CORDONED),
        (0, {"cordoned": True, "draining": True}, None, NodeState.DRAINING),
        (0, {"left": True}, None, NodeState.LEFT),
        # A controller that took over 2 s ago counts silence from its take-over only.
        (60_000, {}, NOW - 2_000, NodeState.SUSPECT),
        (60_000, {}, NOW - 500, NodeState.READY),
    ],
)
def test_observe_derives_states_on_database_time(
    silence_ms: int, flags: dict[str, bool], watching_since: int | None, expected: NodeState
) -> None:
    node = Node("n1", renewed_at_ms=NOW - silence_ms, **flags)  # type: ignore[arg-type]
    (view,) = observe([node], now_ms=NOW, timing=TIMING, watching_since_ms=watching_since)
    assert view.state is expected


def test_node_moves_are_checked_and_a_forbidden_one_is_skipped() -> None:
    nodes = [Node("a"), Node("b", state="left"), Node("c", state="suspect")]
    views = [
        NodeView(id="a", state=NodeState.LOST),
        NodeView(id="b", state=NodeState.READY),  # out of left: forbidden
        NodeView(id="c", state=NodeState.SUSPECT),  # unchanged
    ]
    moves = node_moves(nodes, views)
    assert [(m.node, m.transition.to_dict()) for m in moves] == [
        ("a", {"from": "ready", "to": "lost"})
    ]


def test_a_placement_with_the_current_definition_counts_at_the_current_revision() -> None:
    same = Placement("p1", "a", revision=1, definition={"model": "m"})
    changed = Placement("p2", "b", revision=1, definition={"model": "old"})
    current = {"chat": (7, definition_digest({"model": "m"}))}
    views = placement_views([same, changed], current)
    assert [(v.id, v.revision) for v in views] == [("p1", 7), ("p2", 1)]


def test_a_change_of_where_or_how_many_is_not_a_new_definition() -> None:
    base = {"model": "m", "replicas": 2, "required_labels": {"zone": "a"}}
    moved = {"model": "m", "replicas": 1, "required_labels": {"zone": "b"}, "spread_by": ["z"]}
    assert definition_digest(base) == definition_digest(moved)
    assert definition_digest(base) != definition_digest({**base, "max_concurrency": 2})


def test_a_gone_node_s_placement_is_forgotten_only_once_its_replica_is_ready_elsewhere() -> None:
    nodes = [
        NodeView(id="a", state=NodeState.LOST),
        NodeView(id="b", state=NodeState.READY),
    ]
    old = Placement("old", "a")
    starting = Placement("new", "b", state="pending", replaces="old")
    views = placement_views([old, starting], {})
    assert forgettable(views, nodes) == []
    ready = Placement("new", "b", state="ready", replaces="old")
    assert forgettable(placement_views([old, ready], {}), nodes) == ["old"]
    # A node missing from the membership is gone too.
    stray = Placement("stray", "zz", replica=0)
    assert forgettable(placement_views([stray, ready], {}), nodes) == ["stray"]
    assert PlacementState.READY.value == "ready"


def test_local_deployments_are_the_node_s_own_placements_warm_newest_first() -> None:
    placements = [
        Placement("p1", "a", deployment="chat", revision=1, definition={"model": "old"}),
        Placement("p2", "a", deployment="chat", revision=2, definition={"model": "new"}),
        Placement("p3", "a", deployment="gone", state="stopping"),
        Placement("p4", "b", deployment="other"),
        Placement(
            "p5", "a", deployment="embed", definition={"model": "e", "replicas": 3, "warm": False}
        ),
    ]
    assert local_deployments(placements, "a") == {
        "chat": {"model": "new", "warm": True, "pull": "on_boot", "replicas": 1},
        "embed": {"model": "e", "warm": True, "pull": "on_boot", "replicas": 1},
    }
    assert local_deployments(placements, "c") == {}


UNREACHED = PeerAnswer(node_id="b", reached=False)
FRESH = PeerAnswer(node_id="b", reached=True, renewed_recently=True)
STUCK = PeerAnswer(node_id="b", reached=True, renewed_recently=False)


@pytest.mark.parametrize(
    ("since_ms", "answers", "unreached_before", "expected"),
    [
        (4_999, [], 0, (FenceVerdict.SERVE, 0)),
        # A peer renewed recently: this node is the one cut off, fence at once.
        (5_000, [FRESH], 0, (FenceVerdict.FENCE, 0)),
        # Nobody can renew: the database is down for everyone, keep serving.
        (5_000, [STUCK], 0, (FenceVerdict.HOLD, 0)),
        # No peer answered: hold once, fence when the next ask reaches none either.
        (5_000, [UNREACHED], 0, (FenceVerdict.HOLD, 1)),
        (5_200, [UNREACHED], 1, (FenceVerdict.FENCE, 2)),
        # A peer answering again resets the count.
        (5_400, [STUCK], 1, (FenceVerdict.HOLD, 0)),
    ],
)
def test_judge_own_lease(
    since_ms: int,
    answers: list[PeerAnswer],
    unreached_before: int,
    expected: tuple[FenceVerdict, int],
) -> None:
    got = judge_own_lease(
        since_own_renewal_ms=since_ms,
        timing=TIMING,
        peers_known=1,
        answers=answers,
        unreached_before=unreached_before,
    )
    assert got == expected
