"""The placement planner, table by table: filters, scores, refusal reasons, re-placement,
rollouts; and a property run that it never over-commits memory or uses a non-ready node."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbproxy.config import DeploymentConfig, FleetConfig, KvQuant, PlacementStrategy, Rollout
from sbproxy.fleet.membership import NodeState
from sbproxy.fleet.placement import (
    DeferReason,
    DeferredReplica,
    DeploymentSpec,
    DeviceCapacity,
    EstimateBasis,
    NodeView,
    PlacementPlan,
    PlacementPolicy,
    PlacementReason,
    PlacementState,
    PlacementView,
    ReplaceReplica,
    StartReplica,
    StopReplica,
    StuckReason,
    UnplacedReplica,
    VariantChoice,
    plan,
)
from sbproxy.model_host.runtime.memory import GgufFacts, MemoryEstimate, estimate_memory

GIB = 2**30
S = NodeState
P = PlacementState


def node(
    node_id: str,
    *,
    state: NodeState = S.READY,
    gib: tuple[int, ...] = (16,),
    labels: dict[str, str] | None = None,
    engines: frozenset[str] = frozenset({"llama_cpp"}),
    cached: frozenset[str] = frozenset(),
) -> NodeView:
    return NodeView(
        id=node_id,
        state=state,
        labels=labels or {},
        engines=engines,
        devices=tuple(
            DeviceCapacity(index=i, capacity_bytes=size * GIB) for i, size in enumerate(gib)
        ),
        cached_artifacts=cached,
    )


def spec(
    deployment_id: str = "chat",
    *,
    replicas: int = 1,
    gib: int = 4,
    revision: int = 1,
    labels: dict[str, str] | None = None,
    engines: tuple[str, ...] = ("llama_cpp",),
    tensor_parallel: int = 1,
    rollout: Rollout = Rollout.ROLLING,
    spread_by: tuple[str, ...] = (),
    digest: str | None = None,
) -> DeploymentSpec:
    return DeploymentSpec(
        id=deployment_id,
        revision=revision,
        replicas=replicas,
        required_labels=labels or {},
        spread_by=spread_by,
        engines=engines,
        estimate=MemoryEstimate.from_total(gib * GIB),
        tensor_parallel=tensor_parallel,
        rollout=rollout,
        artifact_digest=digest,
    )


def placed(
    placement_id: str,
    node_id: str,
    *,
    deployment: str = "chat",
    replica: int = 0,
    revision: int = 1,
    gib: int = 4,
    devices: tuple[int, ...] = (0,),
    state: PlacementState = P.READY,
    replaces: str | None = None,
) -> PlacementView:
    return PlacementView(
        id=placement_id,
        deployment=deployment,
        replica=replica,
        revision=revision,
        node=node_id,
        devices=devices,
        reserved_bytes=gib * GIB,
        state=state,
        replaces=replaces,
    )


def summary(result: PlacementPlan) -> list[tuple[object, ...]]:
    """Each decision as a short tuple: (kind, deployment, replica, node-or-reason, ...)."""
    out: list[tuple[object, ...]] = []
    for d in result.decisions:
        if isinstance(d, StartReplica):
            out.append(("start", d.deployment, d.replica, d.node, d.devices, d.cause))
        elif isinstance(d, ReplaceReplica):
            out.append(("replace", d.deployment, d.replica, d.node, d.replaces))
        elif isinstance(d, StopReplica):
            out.append(("stop", d.placement, d.cause))
        else:
            out.append((d.kind, d.deployment, d.replica, d.reason.value))
    return out


SPREAD = PlacementPolicy(strategy=PlacementStrategy.SPREAD)
BINPACK = PlacementPolicy(strategy=PlacementStrategy.BINPACK)


# -- filters and refusal reasons ---------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "deployment", "expected"),
    [
        pytest.param(
            [node("a", labels={"gpu": "a100"}), node("b", labels={"gpu": "l4"})],
            spec(labels={"gpu": "l4"}),
            [("start", "chat", 0, "b", (0,), "missing")],
            id="labels-pick-the-matching-node",
        ),
        pytest.param(
            [node("a", labels={"gpu": "a100", "zone": "x"})],
            spec(labels={"gpu": "a100", "zone": "y"}),
            [("unplaced", "chat", 0, "no_matching_node")],
            id="every-label-must-match",
        ),
        pytest.param(
            [node("a", state=S.CORDONED), node("b", state=S.DRAINING), node("c", state=S.LOST)],
            spec(),
            [("unplaced", "chat", 0, "no_matching_node")],
            id="no-ready-node",
        ),
        pytest.param(
            [node("a", state=S.SUSPECT), node("b", state=S.LEFT), node("c")],
            spec(),
            [("start", "chat", 0, "c", (0,), "missing")],
            id="only-ready-nodes-take-new-replicas",
        ),
        pytest.param(
            [node("a", engines=frozenset({"vllm"}))],
            spec(engines=("llama_cpp",)),
            [("unplaced", "chat", 0, "engine_unavailable")],
            id="engine-unavailable",
        ),
        pytest.param(
            [node("a", engines=frozenset({"vllm"}), gib=(2,))],
            spec(engines=("llama_cpp",)),
            [("unplaced", "chat", 0, "engine_unavailable")],
            id="engine-is-checked-before-capacity",
        ),
        pytest.param(
            [node("a", engines=frozenset({"vllm"})), node("b")],
            spec(engines=("vllm", "llama_cpp")),
            [("start", "chat", 0, "a", (0,), "missing")],
            id="an-auto-engine-takes-any-listed",
        ),
        pytest.param(
            [node("a", gib=(3,)), node("b", gib=(2, 2))],
            spec(gib=4),
            [("unplaced", "chat", 0, "insufficient_capacity")],
            id="memory-does-not-fit-any-device",
        ),
        pytest.param(
            [node("a", gib=(4,))],
            spec(gib=4),
            [("start", "chat", 0, "a", (0,), "missing")],
            id="an-exact-fit-fits",
        ),
        pytest.param(
            [node("a", gib=(8, 8, 8))],
            spec(gib=6, tensor_parallel=2),
            [("start", "chat", 0, "a", (0, 1), "missing")],
            id="tensor-parallel-takes-distinct-devices",
        ),
        pytest.param(
            [node("a", gib=(8,)), node("b", gib=(8,))],
            spec(gib=6, tensor_parallel=2),
            [("unplaced", "chat", 0, "insufficient_capacity")],
            id="tensor-parallel-needs-its-devices-on-one-node",
        ),
    ],
)
def test_filters(nodes: list[NodeView], deployment: DeploymentSpec, expected: list[object]) -> None:
    assert summary(plan(nodes, [deployment], [])) == expected


def test_refusal_messages_say_why() -> None:
    result = plan([node("a", labels={"gpu": "l4"})], [spec(labels={"gpu": "a100"})], [])
    (decision,) = result.decisions
    assert decision.kind == "unplaced"
    assert "gpu=a100" in decision.message
    assert "1 ready" in decision.message
    result = plan([node("a", gib=(2,))], [spec(gib=4)], [])
    assert str(4 * GIB) in result.decisions[0].message  # type: ignore[union-attr]


def test_existing_placements_use_up_memory() -> None:
    nodes = [node("a", gib=(10,))]
    other = placed("p-other", "a", deployment="other", gib=7)
    assert summary(plan(nodes, [spec(gib=4), spec("other", gib=7)], [other])) == [
        ("unplaced", "chat", 0, "insufficient_capacity")
    ]


def test_stopping_placements_still_hold_memory() -> None:
    nodes = [node("a", gib=(10,))]
    going = placed("p-old", "a", deployment="gone", gib=7, state=P.STOPPING)
    assert summary(plan(nodes, [spec(gib=4)], [going])) == [
        ("unplaced", "chat", 0, "insufficient_capacity")
    ]


def test_placements_made_in_one_plan_count_against_each_other() -> None:
    nodes = [node("a", gib=(10,))]
    result = plan(nodes, [spec("one", gib=6), spec("two", gib=6)], [])
    assert summary(result) == [
        ("start", "one", 0, "a", (0,), "missing"),
        ("unplaced", "two", 0, "insufficient_capacity"),
    ]


def test_different_deployments_share_a_device_when_memory_fits() -> None:
    result = plan([node("a", gib=(10,))], [spec("one", gib=4), spec("two", gib=4)], [])
    assert [d.node for d in result.of_kind("start")] == ["a", "a"]  # type: ignore[union-attr]


# -- two replicas on one node --------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "policy", "expected"),
    [
        pytest.param(
            [node("a", gib=(64,))],
            SPREAD,
            [
                ("start", "chat", 0, "a", (0,), "missing"),
                ("unplaced", "chat", 1, "insufficient_capacity"),
            ],
            id="one-device-never-holds-two-replicas",
        ),
        pytest.param(
            [node("a", gib=(16, 16))],
            SPREAD,
            [
                ("start", "chat", 0, "a", (0,), "missing"),
                ("start", "chat", 1, "a", (1,), "missing"),
            ],
            id="two-devices-take-two-replicas",
        ),
        pytest.param(
            [node("a", gib=(16, 16)), node("b", gib=(16,))],
            SPREAD,
            [
                ("start", "chat", 0, "a", (0,), "missing"),
                ("start", "chat", 1, "b", (0,), "missing"),
            ],
            id="spread-prefers-another-node",
        ),
        pytest.param(
            [node("a", gib=(16, 16)), node("b", gib=(16, 16))],
            BINPACK,
            [
                ("start", "chat", 0, "a", (0,), "missing"),
                ("start", "chat", 1, "a", (1,), "missing"),
            ],
            id="binpack-fills-one-node",
        ),
        pytest.param(
            [node("a", gib=(16, 16)), node("b", gib=(16, 16))],
            SPREAD,
            [
                ("start", "chat", 0, "a", (0,), "missing"),
                ("start", "chat", 1, "b", (0,), "missing"),
            ],
            id="spread-uses-both-nodes",
        ),
    ],
)
def test_replicas_of_one_deployment(
    nodes: list[NodeView], policy: PlacementPolicy, expected: list[object]
) -> None:
    assert summary(plan(nodes, [spec(replicas=2)], [], policy=policy)) == expected


# -- scoring -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "chosen"),
    [(SPREAD, "roomy"), (BINPACK, "tight")],
)
def test_spread_takes_the_most_free_share_binpack_the_least(
    policy: PlacementPolicy, chosen: str
) -> None:
    nodes = [node("roomy", gib=(32,)), node("tight", gib=(32,))]
    busy = placed("p-busy", "tight", deployment="other", gib=20)
    result = plan(nodes, [spec(gib=4), spec("other", gib=20)], [busy], policy=policy)
    assert [d.node for d in result.of_kind("start")] == [chosen]  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", [SPREAD, BINPACK])
def test_ties_go_to_the_smaller_node_id(policy: PlacementPolicy) -> None:
    nodes = [node("n2"), node("n10"), node("n1")]
    result = plan(nodes, [spec()], [], policy=policy)
    assert [d.node for d in result.of_kind("start")] == ["n1"]  # type: ignore[union-attr]


def test_spread_by_label_domain() -> None:
    nodes = [
        node("a", labels={"zone": "x"}),
        node("b", labels={"zone": "x"}),
        node("c", labels={"zone": "y"}, gib=(8,)),
    ]
    result = plan(nodes, [spec(replicas=2, spread_by=("zone",))], [])
    assert sorted(d.node for d in result.of_kind("start")) == ["a", "c"]  # type: ignore[union-attr]


def test_spread_prefers_a_node_with_the_artifact_cached() -> None:
    nodes = [node("a"), node("b", cached=frozenset({"d1"}))]
    result = plan(nodes, [spec(digest="d1")], [])
    assert [d.node for d in result.of_kind("start")] == ["b"]  # type: ignore[union-attr]


DIGEST = "1f2e3d4c5b6a" + "0" * 52


@pytest.mark.parametrize(
    ("nodes", "strategy", "winner", "reason"),
    [
        pytest.param(
            [node("a"), node("b", cached=frozenset({DIGEST}))],
            PlacementStrategy.SPREAD,
            "b",
            f"b holds sha256:{DIGEST[:12]}... (1.0 GiB); 2 node(s) fit, then spread picked b",
            id="equal-nodes-the-holder-wins",
        ),
        pytest.param(
            # Locality ranks before the strategy: binpack would pick the tighter node a.
            [node("a", gib=(6,)), node("b", cached=frozenset({DIGEST}))],
            PlacementStrategy.BINPACK,
            "b",
            f"b holds sha256:{DIGEST[:12]}... (1.0 GiB); 2 node(s) fit, then binpack picked b",
            id="binpack-locality-before-tightness",
        ),
        pytest.param(
            # Spread would prefer the emptier node c.
            [node("b", gib=(8,), cached=frozenset({DIGEST})), node("c", gib=(64,))],
            PlacementStrategy.SPREAD,
            "b",
            f"b holds sha256:{DIGEST[:12]}... (1.0 GiB); 2 node(s) fit, then spread picked b",
            id="spread-locality-before-free-memory",
        ),
        pytest.param(
            # Fit first: the holder has no room, so a node that must fetch it wins.
            [node("a", gib=(2,), cached=frozenset({DIGEST})), node("c")],
            PlacementStrategy.SPREAD,
            "c",
            f"no fitting node holds sha256:{DIGEST[:12]}..., it is fetched; 1 node(s) fit, "
            "then spread picked c",
            id="fit-before-locality",
        ),
        pytest.param(
            [node("a"), node("b")],
            PlacementStrategy.SPREAD,
            "a",
            f"no fitting node holds sha256:{DIGEST[:12]}..., it is fetched; 2 node(s) fit, "
            "then spread picked a",
            id="nobody-holds-it-strategy-decides",
        ),
    ],
)
def test_score_is_fit_then_locality_then_strategy(
    nodes: list[NodeView], strategy: PlacementStrategy, winner: str, reason: str
) -> None:
    sized = [
        n.model_copy(update={"cached_bytes": dict.fromkeys(n.cached_artifacts, GIB)}) for n in nodes
    ]
    result = plan(sized, [spec(digest=DIGEST)], [], policy=PlacementPolicy(strategy=strategy))
    (start,) = result.of_kind("start")
    assert isinstance(start, StartReplica)
    assert (start.node, start.reason) == (winner, reason)


def test_spreading_replicas_ranks_before_locality() -> None:
    # Replica 0 runs on a (which holds the artifact, and has a second device); replica 1
    # goes to the empty zone z2 that must fetch it, not beside replica 0.
    nodes = [
        node("a", gib=(16, 16), labels={"zone": "z1"}, cached=frozenset({DIGEST})),
        node("b", labels={"zone": "z2"}),
    ]
    wanted = spec(replicas=2, spread_by=("zone",), digest=DIGEST)
    result = plan(nodes, [wanted], [placed("p0", "a", replica=0)])
    (start,) = result.of_kind("start")
    assert isinstance(start, StartReplica)
    assert (start.node, start.replica) == ("b", 1)
    assert start.reason == (
        f"a hold(s) sha256:{DIGEST[:12]}... but run more replicas of it (spreading first); "
        "b fetches it; 2 node(s) fit, then spread picked b"
    )
    # Without spread_by, spread still puts the second replica on the other node.
    result = plan(nodes, [spec(replicas=2, digest=DIGEST)], [placed("p0", "a", replica=0)])
    assert [d.node for d in result.of_kind("start")] == ["b"]  # type: ignore[union-attr]


def test_a_replacement_says_why_its_node_won() -> None:
    nodes = [node("a", state=S.LOST), node("b"), node("c", cached=frozenset({DIGEST}))]
    result = plan(nodes, [spec(digest=DIGEST)], [placed("p0", "a")])
    (moved,) = result.of_kind("replace")
    assert isinstance(moved, ReplaceReplica)
    assert moved.node == "c"
    assert moved.reason.startswith(f"c holds sha256:{DIGEST[:12]}...;")


def test_the_plan_does_not_depend_on_input_order() -> None:
    nodes = [node("a", gib=(16, 16)), node("b"), node("c", state=S.LOST)]
    deployments = [spec("x", replicas=2), spec("y", replicas=2, gib=8)]
    placements = [placed("p1", "c", deployment="x"), placed("p2", "b", deployment="y", gib=8)]
    first = plan(nodes, deployments, placements)
    second = plan(nodes[::-1], deployments[::-1], placements[::-1])
    assert first == second
    assert first.model_dump_json() == second.model_dump_json()


# -- existing placements: steady state, scale, removal ------------------------------------


def test_a_satisfied_fleet_plans_nothing() -> None:
    nodes = [node("a"), node("b")]
    placements = [placed("p0", "a", replica=0), placed("p1", "b", replica=1)]
    assert plan(nodes, [spec(replicas=2)], placements).decisions == ()


def test_a_starting_replica_is_left_alone() -> None:
    placements = [placed("p0", "a", state=P.STARTING)]
    assert plan([node("a")], [spec()], placements).decisions == ()


@pytest.mark.parametrize("state", [S.SUSPECT, S.CORDONED])
def test_suspect_and_cordoned_nodes_keep_their_replicas(state: NodeState) -> None:
    nodes = [node("a", state=state), node("b")]
    placements = [placed("p0", "a")]
    assert plan(nodes, [spec()], placements).decisions == ()


def test_cordoned_node_takes_no_new_replica() -> None:
    nodes = [node("a", state=S.CORDONED, gib=(16, 16)), node("b", gib=(2,))]
    placements = [placed("p0", "a")]
    assert summary(plan(nodes, [spec(replicas=2)], placements)) == [
        ("unplaced", "chat", 1, "insufficient_capacity")
    ]


def test_scale_down_stops_the_highest_replicas() -> None:
    placements = [placed(f"p{i}", n, replica=i) for i, n in enumerate("abc")]
    result = plan([node("a"), node("b"), node("c")], [spec(replicas=1)], placements)
    assert summary(result) == [("stop", "p1", "scale_down"), ("stop", "p2", "scale_down")]


def test_a_removed_deployment_is_stopped() -> None:
    result = plan([node("a")], [], [placed("p0", "a", deployment="old")])
    assert summary(result) == [("stop", "p0", "removed")]


def test_a_stopping_placement_is_not_stopped_again() -> None:
    result = plan([node("a")], [], [placed("p0", "a", deployment="old", state=P.STOPPING)])
    assert result.decisions == ()


def test_a_duplicate_of_a_replica_is_stopped_keeping_the_ready_one() -> None:
    placements = [placed("p-b", "b", state=P.STARTING), placed("p-a", "a")]
    result = plan([node("a"), node("b")], [spec()], placements)
    assert summary(result) == [("stop", "p-b", "duplicate")]


def test_replicas_zero_stops_everything() -> None:
    result = plan([node("a")], [spec(replicas=0)], [placed("p0", "a")])
    assert summary(result) == [("stop", "p0", "scale_down")]


# -- lost nodes: re-placement, capped ------------------------------------------------------


def test_a_replica_on_a_lost_node_is_replaced_elsewhere() -> None:
    nodes = [node("a", state=S.LOST), node("b")]
    result = plan(nodes, [spec()], [placed("p0", "a")])
    assert summary(result) == [("replace", "chat", 0, "b", "p0")]
    (decision,) = result.decisions
    assert isinstance(decision, ReplaceReplica)
    assert decision.from_node == "a"


@pytest.mark.parametrize("gone", ["left", "unknown"])
def test_replicas_on_left_or_unknown_nodes_are_replaced(gone: str) -> None:
    nodes = [node("b")] + ([node("a", state=S.LEFT)] if gone == "left" else [])
    assert summary(plan(nodes, [spec()], [placed("p0", "a")])) == [
        ("replace", "chat", 0, "b", "p0")
    ]


def test_a_lost_node_frees_its_memory_for_replacements() -> None:
    nodes = [node("a", state=S.LOST, gib=(4,)), node("b", gib=(4,))]
    result = plan(nodes, [spec()], [placed("p0", "a")])
    assert [d.kind for d in result.decisions] == ["replace"]


def test_replacements_are_capped() -> None:
    nodes = [node("lost", state=S.LOST, gib=(64, 64, 64, 64)), node("b", gib=(64, 64, 64, 64))]
    deployments = [spec(f"d{i}") for i in range(4)]
    placements = [placed(f"p{i}", "lost", deployment=f"d{i}", devices=(i,)) for i in range(4)]
    result = plan(
        nodes, deployments, placements, policy=PlacementPolicy(max_replacements_in_flight=2)
    )
    assert summary(result) == [
        ("replace", "d0", 0, "b", "p0"),
        ("replace", "d1", 0, "b", "p1"),
        ("deferred", "d2", 0, "replacements_capped"),
        ("deferred", "d3", 0, "replacements_capped"),
    ]


def test_replacements_in_flight_count_against_the_cap() -> None:
    nodes = [node("lost", state=S.LOST, gib=(64, 64)), node("b", gib=(64, 64, 64))]
    deployments = [spec("d0"), spec("d1")]
    placements = [
        placed("p0", "lost", deployment="d0"),
        placed("p1", "lost", deployment="d1", devices=(1,)),
        # d0's replacement is already starting on b: one slot of the cap is taken.
        placed("r0", "b", deployment="d0", state=P.STARTING, replaces="p0"),
    ]
    policy = PlacementPolicy(max_replacements_in_flight=1)
    assert summary(plan(nodes, deployments, placements, policy=policy)) == [
        ("deferred", "d1", 0, "replacements_capped")
    ]
    ready = [*placements[:2], placed("r0", "b", deployment="d0", replaces="p0")]
    assert summary(plan(nodes, deployments, ready, policy=policy)) == [
        ("replace", "d1", 0, "b", "p1")
    ]


def test_the_cap_serves_the_deployment_with_fewest_serving_replicas_first() -> None:
    nodes = [node("lost", state=S.LOST, gib=(64, 64)), node("b", gib=(64, 64)), node("c")]
    deployments = [spec("a-big", replicas=2), spec("z-solo")]
    placements = [
        placed("pa0", "lost", deployment="a-big"),
        placed("pa1", "c", deployment="a-big", replica=1),
        placed("pz", "lost", deployment="z-solo", devices=(1,)),
    ]
    policy = PlacementPolicy(max_replacements_in_flight=1)
    assert summary(plan(nodes, deployments, placements, policy=policy)) == [
        ("replace", "z-solo", 0, "b", "pz"),
        ("deferred", "a-big", 0, "replacements_capped"),
    ]


def test_a_replacement_that_fits_nowhere_says_why() -> None:
    nodes = [node("a", state=S.LOST), node("b", gib=(2,))]
    result = plan(nodes, [spec()], [placed("p0", "a")])
    assert summary(result) == [("unplaced", "chat", 0, "insufficient_capacity")]
    assert "gone node a" in result.decisions[0].message  # type: ignore[union-attr]


# -- rollouts and drains -------------------------------------------------------------------


def test_rolling_makes_room_where_the_new_replica_fits_when_no_node_has_a_spare_device() -> None:
    # c has one free device; replica 0 surges there. Replica 1 has nowhere to surge, so its
    # old placement is stopped to make room, while replica 0's old one still serves.
    nodes = [node("a"), node("b"), node("c")]
    old = [placed("p0", "a", replica=0), placed("p1", "b", replica=1)]
    assert summary(plan(nodes, [spec(replicas=2, revision=2)], old)) == [
        ("start", "chat", 0, "c", (0,), "rollout"),
        ("stop", "p1", "make_room"),
    ]


def test_rolling_one_replica_surges_then_stops_the_old_once_ready() -> None:
    nodes = [node("a"), node("b")]
    old = placed("p-old", "a")
    new = spec(revision=2)
    assert summary(plan(nodes, [new], [old])) == [("start", "chat", 0, "b", (0,), "rollout")]
    starting = placed("p-new", "b", revision=2, state=P.STARTING)
    assert plan(nodes, [new], [old, starting]).decisions == ()
    ready = placed("p-new", "b", revision=2)
    assert summary(plan(nodes, [new], [old, ready])) == [("stop", "p-old", "rollout")]


def test_rolling_orders_starts_before_stops() -> None:
    nodes = [node("a"), node("b"), node("c"), node("d")]
    placements = [
        placed("old0", "a", replica=0),
        placed("new0", "c", replica=0, revision=2),
        placed("old1", "b", replica=1),
    ]
    result = plan(nodes, [spec(replicas=2, revision=2)], placements)
    assert summary(result) == [
        ("start", "chat", 1, "d", (0,), "rollout"),
        ("stop", "old0", "rollout"),
    ]


def test_rolling_without_room_stops_one_old_replica_first_keeping_replicas_minus_one() -> None:
    nodes = [node("a", gib=(4,)), node("b", gib=(4,)), node("c", gib=(4,))]
    old = [placed(f"p{i}", n, replica=i) for i, n in enumerate("abc")]
    new = spec(replicas=3, revision=2)
    paced = [("deferred", "chat", 1, "rollout_paced"), ("deferred", "chat", 2, "rollout_paced")]
    assert summary(plan(nodes, [new], old)) == [("stop", "p0", "make_room"), *paced]
    # While p0 stops, nobody else is stopped: two of three still serve.
    stopping = [placed("p0", "a", state=P.STOPPING), *old[1:]]
    assert summary(plan(nodes, [new], stopping)) == [
        ("deferred", "chat", 0, "awaiting_stop"),
        *paced,
    ]
    # p0 gone: the new replica 0 starts where it was; the others still wait for it.
    assert summary(plan(nodes, [new], old[1:])) == [
        ("start", "chat", 0, "a", (0,), "missing"),
        *paced,
    ]
    # Replica 0's new placement ready: replica 1 is next.
    done = [placed("n0", "a", revision=2), *old[1:]]
    assert summary(plan(nodes, [new], done)) == [
        ("stop", "p1", "make_room"),
        ("deferred", "chat", 2, "rollout_paced"),
    ]


def test_rolling_without_room_does_not_stop_the_old_when_the_new_cannot_fit_either() -> None:
    nodes = [node("a", gib=(4,))]
    result = plan(nodes, [spec(revision=2, gib=6)], [placed("p0", "a")])
    assert summary(result) == [("unplaced", "chat", 0, "insufficient_capacity")]


def test_recreate_stops_the_old_first_one_replica_at_a_time() -> None:
    nodes = [node("a"), node("b"), node("c"), node("d")]
    old = [placed("p0", "a", replica=0), placed("p1", "b", replica=1)]
    new = spec(replicas=2, revision=2, rollout=Rollout.RECREATE)
    assert summary(plan(nodes, [new], old)) == [
        ("stop", "p0", "make_room"),
        ("deferred", "chat", 1, "rollout_paced"),
    ]
    stopping = [placed("p0", "a", state=P.STOPPING), old[1]]
    # Replica 0 starts once its old one is stopping (here on a free node); replica 1 keeps
    # serving: stopping it too would leave fewer than replicas - 1.
    assert summary(plan(nodes, [new], stopping)) == [
        ("start", "chat", 0, "c", (0,), "missing"),
        ("deferred", "chat", 1, "rollout_paced"),
    ]
    started = [*stopping, placed("n0", "c", revision=2, state=P.STARTING)]
    assert summary(plan(nodes, [new], started)) == [("deferred", "chat", 1, "rollout_paced")]
    # Replica 0's new one is ready and its old one gone: now replica 1 is recreated.
    ready = [old[1], placed("n0", "c", revision=2)]
    assert summary(plan(nodes, [new], ready)) == [("stop", "p1", "make_room")]


def test_a_draining_node_keeps_its_replica_until_the_move_is_ready() -> None:
    nodes = [node("a", state=S.DRAINING), node("b")]
    old = placed("p0", "a")
    assert summary(plan(nodes, [spec()], [old])) == [("start", "chat", 0, "b", (0,), "drain")]
    moved = placed("p1", "b")
    assert summary(plan(nodes, [spec()], [old, moved])) == [("stop", "p0", "drain")]


def test_a_draining_node_with_nowhere_to_go_keeps_serving() -> None:
    nodes = [node("a", state=S.DRAINING), node("b", gib=(2,))]
    result = plan(nodes, [spec()], [placed("p0", "a")])
    assert summary(result) == [("unplaced", "chat", 0, "insufficient_capacity")]


# -- the decisions' JSON form --------------------------------------------------------------


def test_decisions_have_a_stable_json_form() -> None:
    nodes = [node("a", state=S.LOST), node("b"), node("c", engines=frozenset())]
    deployments = [spec(), spec("other", labels={"gpu": "h100"})]
    result = plan(nodes, deployments, [placed("p0", "a"), placed("x", "b", deployment="gone")])
    payload = json.loads(result.model_dump_json())
    assert payload == {
        "decisions": [
            {
                "kind": "replace",
                "deployment": "chat",
                "replica": 0,
                "revision": 1,
                "node": "b",
                "devices": [0],
                "engine": "llama_cpp",
                "reserved_bytes": 4 * GIB,
                "replaces": "p0",
                "from_node": "a",
                "cause": "node_gone",
                "variant": None,
                "estimate_basis": "file_size",
                "reason": "the artifact is resolved on the node; 1 node(s) fit, then spread "
                "picked b",
                "workers": [],
            },
            {
                "kind": "stop",
                "placement": "x",
                "deployment": "gone",
                "replica": 0,
                "revision": 1,
                "node": "b",
                "cause": "removed",
            },
            {
                "kind": "unplaced",
                "deployment": "other",
                "replica": 0,
                "revision": 1,
                "reason": "no_matching_node",
                "message": "no ready node for other: 3 node(s), 2 ready, none of them "
                "labelled gpu=h100",
            },
        ]
    }
    assert PlacementPlan.model_validate_json(result.model_dump_json()) == result


def test_duplicate_ids_are_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="node ids must be distinct; repeated: a"):
        plan([node("a"), node("a")], [], [])
    with pytest.raises(ValueError, match="placement ids"):
        plan([node("a")], [spec()], [placed("p", "a"), placed("p", "a", replica=1)])


def test_spec_from_config_and_a_gguf_estimate() -> None:
    config = DeploymentConfig.model_validate(
        {
            "model": "m",
            "variant": "q4",
            "replicas": 2,
            "required_labels": {"gpu": "l4"},
            "spread_by": ["zone"],
            "tensor_parallel": 2,
            "rollout": "recreate",
        }
    )
    facts = GgufFacts(
        architecture="llama",
        version=3,
        tensor_count=1,
        block_count=24,
        head_count=14,
        head_count_kv=2,
        key_length=64,
        value_length=64,
        embedding_length=896,
        context_length=32_768,
    )
    estimate = estimate_memory(
        weights_bytes=400_000_000,
        facts=facts,
        seq_len=4_096,
        concurrency=1,
        kv_quant=KvQuant.AUTO,
        safety_margin=0.10,
    )
    deployment = DeploymentSpec.from_config(
        "chat", config, revision=3, estimate=estimate, engines=["llama_cpp"]
    )
    assert (deployment.replicas, deployment.tensor_parallel, deployment.rollout) == (
        2,
        2,
        Rollout.RECREATE,
    )
    assert deployment.required_labels == {"gpu": "l4"}
    assert deployment.spread_by == ("zone",)
    assert deployment.estimate.safety_margin_bytes > 0
    policy = PlacementPolicy.from_config(
        FleetConfig(placement=PlacementStrategy.BINPACK, max_replacements_in_flight=5)
    )
    assert (policy.strategy, policy.max_replacements_in_flight) == (PlacementStrategy.BINPACK, 5)


def test_reason_codes_are_the_documented_ones() -> None:
    assert {r.value for r in PlacementReason} == {
        "no_matching_node",
        "engine_unavailable",
        "insufficient_capacity",
    }
    assert {r.value for r in DeferReason} == {
        "replacements_capped",
        "awaiting_stop",
        "rollout_paced",
    }


# -- properties ----------------------------------------------------------------------------

_LABELS = st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["x", "y"]), max_size=2)
_ENGINES = st.frozensets(st.sampled_from(["llama_cpp", "vllm"]), max_size=2)


@st.composite
def _fleets(
    draw: st.DrawFn,
) -> tuple[list[NodeView], list[DeploymentSpec], list[PlacementView], PlacementPolicy]:
    nodes = [
        NodeView(
            id=f"n{i}",
            state=draw(st.sampled_from(list(NodeState))),
            labels=draw(_LABELS),
            engines=draw(_ENGINES),
            devices=tuple(
                DeviceCapacity(index=d, capacity_bytes=draw(st.integers(0, 32)) * GIB)
                for d in range(draw(st.integers(1, 3)))
            ),
        )
        for i in range(draw(st.integers(1, 5)))
    ]
    deployments = [
        DeploymentSpec(
            id=f"d{i}",
            revision=draw(st.integers(1, 2)),
            replicas=draw(st.integers(0, 3)),
            required_labels=draw(_LABELS),
            engines=tuple(sorted(draw(_ENGINES))) or ("llama_cpp",),
            estimate=MemoryEstimate.from_total(draw(st.integers(1, 16)) * GIB),
            tensor_parallel=draw(st.integers(1, 2)),
            rollout=draw(st.sampled_from(list(Rollout))),
        )
        for i in range(draw(st.integers(1, 4)))
    ]
    node_ids = [n.id for n in nodes] + ["gone-node"]
    placements = [
        PlacementView(
            id=f"p{i}",
            deployment=draw(st.sampled_from([d.id for d in deployments] + ["removed"])),
            replica=draw(st.integers(0, 3)),
            revision=draw(st.integers(1, 2)),
            node=draw(st.sampled_from(node_ids)),
            devices=(draw(st.integers(0, 2)),),
            reserved_bytes=draw(st.integers(1, 16)) * GIB,
            state=draw(st.sampled_from(list(PlacementState))),
            replaces=draw(st.none() | st.just("earlier")),
        )
        for i in range(draw(st.integers(0, 8)))
    ]
    policy = PlacementPolicy(
        strategy=draw(st.sampled_from(list(PlacementStrategy))),
        max_replacements_in_flight=draw(st.integers(1, 3)),
    )
    return nodes, deployments, placements, policy


@settings(max_examples=300, deadline=None)
@given(fleet=_fleets())
def test_plan_never_overcommits_memory_nor_uses_a_non_ready_node(
    fleet: tuple[list[NodeView], list[DeploymentSpec], list[PlacementView], PlacementPolicy],
) -> None:
    nodes, deployments, placements, policy = fleet
    result = plan(nodes, deployments, placements, policy=policy)
    by_id = {n.id: n for n in nodes}
    gone = {S.LOST, S.LEFT}
    live = [p for p in placements if p.node in by_id and by_id[p.node].state not in gone]
    used: Counter[tuple[str, int]] = Counter()
    held: set[tuple[str, str, int]] = set()
    for p in live:
        for index in p.devices:
            used[(p.node, index)] += p.reserved_bytes
            held.add((p.deployment, p.node, index))
    added: Counter[tuple[str, int]] = Counter()
    for d in result.decisions:
        if not isinstance(d, StartReplica | ReplaceReplica):
            continue
        target = by_id[d.node]
        assert target.state is S.READY, f"{d} lands on a {target.state} node"
        spec_of = next(s for s in deployments if s.id == d.deployment)
        assert d.engine in target.engines and d.engine in spec_of.engines
        assert all(target.labels.get(k) == v for k, v in spec_of.required_labels.items())
        assert len(set(d.devices)) == len(d.devices) == spec_of.tensor_parallel
        for index in d.devices:
            assert (d.deployment, d.node, index) not in held, "two replicas on one device"
            held.add((d.deployment, d.node, index))
            added[(d.node, index)] += d.reserved_bytes
    capacity = {(n.id, dev.index): dev.capacity_bytes for n in nodes for dev in n.devices}
    for key, extra in added.items():
        assert used[key] + extra <= capacity[key], f"{key} over-committed"
    # Deterministic whatever the input order.
    assert plan(nodes[::-1], deployments[::-1], placements[::-1], policy=policy) == result
    # Starts and replaces come before stops.
    kinds = [d.kind for d in result.decisions]
    if "stop" in kinds:
        assert all(k not in ("start", "replace") for k in kinds[kinds.index("stop") :])


def test_a_lost_replica_is_placed_before_another_deployments_rollout_surge() -> None:
    # One free device on b: the replica lost with node a gets it; "aaa" (a smaller id,
    # planned first otherwise) cannot surge and, with one replica, recreates in place on c.
    nodes = [node("a", state=S.LOST), node("b"), node("c")]
    placements = [
        placed("lost", "a", deployment="zzz"),
        placed("old", "c", deployment="aaa"),
    ]
    deployments = [spec("aaa", revision=2, gib=16), spec("zzz", gib=16)]
    assert summary(plan(nodes, deployments, placements)) == [
        ("replace", "zzz", 0, "b", "lost"),
        ("stop", "old", "make_room"),
    ]


def started(result: PlacementPlan) -> list[StartReplica]:
    return [d for d in result.decisions if isinstance(d, StartReplica)]


def replaced(result: PlacementPlan) -> list[ReplaceReplica]:
    return [d for d in result.decisions if isinstance(d, ReplaceReplica)]


def note(result: PlacementPlan, index: int) -> UnplacedReplica | DeferredReplica:
    """Decision ``index``, which must be an unplaced or deferred replica."""
    decision = result.decisions[index]
    assert isinstance(decision, UnplacedReplica | DeferredReplica), decision
    return decision


# -- several devices per node ------------------------------------------------------------


def test_tensor_parallel_takes_two_devices_of_one_node() -> None:
    nodes = [node("a", gib=(16,)), node("b", gib=(16, 16))]
    result = plan(nodes, [spec(tensor_parallel=2)], [])
    assert summary(result) == [("start", "chat", 0, "b", (0, 1), "missing")]


def test_two_replicas_share_a_node_only_when_it_has_a_device_for_each() -> None:
    two_gpus = [node("a", gib=(16, 16))]
    assert summary(plan(two_gpus, [spec(replicas=2)], [])) == [
        ("start", "chat", 0, "a", (0,), "missing"),
        ("start", "chat", 1, "a", (1,), "missing"),
    ]
    one_gpu = [node("a", gib=(32,))]
    assert summary(plan(one_gpu, [spec(replicas=2)], [])) == [
        ("start", "chat", 0, "a", (0,), "missing"),
        ("unplaced", "chat", 1, "insufficient_capacity"),
    ]


def test_max_replicas_per_node_keeps_a_second_replica_off_a_node_with_devices_for_both() -> None:
    nodes = [node("a", gib=(16, 16))]
    policy = PlacementPolicy(max_replicas_per_node=1)
    result = plan(nodes, [spec(replicas=2)], [], policy=policy)
    assert summary(result) == [
        ("start", "chat", 0, "a", (0,), "missing"),
        ("unplaced", "chat", 1, "insufficient_capacity"),
    ]
    assert "fewer than 1 other replica(s) of it on the node" in note(result, 1).message
    # The same replica's next revision still rolls onto the node beside its old one.
    old = [placed("p0", "a", devices=(0,))]
    rolled = plan(nodes, [spec(revision=2)], old, policy=policy)
    assert summary(rolled) == [("start", "chat", 0, "a", (1,), "rollout")]


def test_the_fleet_policy_from_config_takes_as_many_replicas_as_a_node_has_devices() -> None:
    assert PlacementPolicy.from_config(FleetConfig()).max_replicas_per_node is None


# -- variant choices (heterogeneous_variants) ---------------------------------------------


def choice(variant: str, gib: int, *engines: str, digest: str | None = None) -> VariantChoice:
    return VariantChoice(
        variant=variant,
        engines=engines or ("llama_cpp",),
        estimate=MemoryEstimate.from_total(gib * GIB),
        artifact_digest=digest,
        estimate_basis=EstimateBasis.GGUF_HEADER,
    )


def varied(replicas: int = 2) -> DeploymentSpec:
    """A deployment whose first choice is a 12 GiB vllm variant, then a 6 GiB and a 3 GiB
    llama.cpp one."""
    return DeploymentSpec(
        id="chat",
        revision=1,
        replicas=replicas,
        engines=("vllm",),
        estimate=MemoryEstimate.from_total(12 * GIB),
        variant="fp16",
        alternatives=(choice("q8_0", 6), choice("q4_k_m", 3)),
    )


def test_each_replica_takes_the_first_variant_that_fits_its_node() -> None:
    nodes = [
        node("big", gib=(16,), engines=frozenset({"vllm", "llama_cpp"})),
        node("mid", gib=(8,)),
        node("small", gib=(4,)),
    ]
    result = plan(nodes, [varied(replicas=3)], [])
    chosen = {(d.node, d.variant, d.reserved_bytes) for d in started(result)}
    assert chosen == {
        ("big", "fp16", 12 * GIB),
        ("mid", "q8_0", 6 * GIB),
        ("small", "q4_k_m", 3 * GIB),
    }
    assert {d.estimate_basis for d in started(result)} == {
        EstimateBasis.FILE_SIZE,
        EstimateBasis.GGUF_HEADER,
    }


def test_a_variant_the_node_has_no_engine_for_is_skipped_even_when_it_would_fit() -> None:
    result = plan([node("a", gib=(64,))], [varied(replicas=1)], [])
    (start,) = started(result)
    assert (start.variant, start.engine, start.reserved_bytes) == ("q8_0", "llama_cpp", 6 * GIB)


def test_no_variant_fitting_any_node_is_refused_naming_every_size() -> None:
    result = plan([node("a", gib=(2,))], [varied(replicas=1)], [])
    assert len(result.decisions) == 1
    refused = note(result, 0)
    assert refused.reason is PlacementReason.INSUFFICIENT_CAPACITY
    assert str(6 * GIB) in refused.message and str(3 * GIB) in refused.message
    no_engine = plan([node("a", engines=frozenset({"sglang"}))], [varied(replicas=1)], [])
    assert summary(no_engine) == [("unplaced", "chat", 0, "engine_unavailable")]
    assert "llama_cpp or vllm" in note(no_engine, 0).message


def test_a_variant_choice_fills_the_ledger_with_its_own_size() -> None:
    # Node a (two 8 GiB devices, no vllm) takes q8_0 (6 GiB) on each device; node b (4 GiB)
    # only fits q4_k_m. No device holds two replicas, though 2 GiB is left on each of a's.
    nodes = [node("a", gib=(8, 8)), node("b", gib=(4,))]
    result = plan(nodes, [varied(replicas=3)], [])
    chosen = sorted((d.node, d.devices, d.variant) for d in started(result))
    assert chosen == [("a", (0,), "q8_0"), ("a", (1,), "q8_0"), ("b", (0,), "q4_k_m")]


# -- hardware a variant needs -------------------------------------------------------------


def gpu_node(node_id: str, *capabilities: tuple[int, int] | None, gib: int = 16) -> NodeView:
    """A ready node with one CUDA device of ``gib`` GiB per compute capability given."""
    devices = tuple(
        DeviceCapacity(index=i, capacity_bytes=gib * GIB, accelerator="cuda", compute_capability=cc)
        for i, cc in enumerate(capabilities)
    )
    return NodeView(id=node_id, state=S.READY, engines=frozenset({"llama_cpp"}), devices=devices)


def needing(accelerators: frozenset[str], minimum: tuple[int, int] | None = None) -> DeploymentSpec:
    return spec().model_copy(
        update={"variant": "v", "accelerators": accelerators, "min_compute_capability": minimum}
    )


CUDA = frozenset({"cuda"})


@pytest.mark.parametrize(
    ("nodes", "wanted", "expected"),
    [
        # A CUDA-only variant skips the roomier CPU node.
        ([node("a", gib=(64,)), gpu_node("g", (8, 0))], needing(CUDA), [("g", (0,))]),
        # Compute capability: the device below the minimum is skipped, on the same node too.
        ([gpu_node("g", (7, 5), (8, 9))], needing(CUDA, (8, 0)), [("g", (1,))]),
        (
            [gpu_node("old", (7, 0)), gpu_node("new", (9, 0))],
            needing(CUDA, (8, 0)),
            [("new", (0,))],
        ),
        # An unknown capability does not pass a minimum.
        ([gpu_node("g", None)], needing(CUDA, (8, 0)), [("unplaced", "engine_unavailable")]),
        # No minimum: any CUDA device; a variant with no named needs runs anywhere.
        ([gpu_node("g", None)], needing(CUDA), [("g", (0,))]),
        ([node("a")], needing(frozenset()), [("a", (0,))]),
        # A cpu-or-cuda variant takes the CPU node too.
        ([node("a")], needing(frozenset({"cpu", "cuda"})), [("a", (0,))]),
        # CUDA only, CPU nodes only: refused as the engine's hardware missing.
        ([node("a"), node("b")], needing(CUDA), [("unplaced", "engine_unavailable")]),
    ],
)
def test_a_variant_is_placed_only_on_devices_it_runs_on(
    nodes: list[NodeView], wanted: DeploymentSpec, expected: list[tuple[object, ...]]
) -> None:
    result = plan(nodes, [wanted], [])
    got: list[tuple[object, ...]] = [(d.node, d.devices) for d in started(result)]
    got += [
        ("unplaced", d.reason.value) for d in result.decisions if isinstance(d, UnplacedReplica)
    ]
    assert got == expected


def test_a_hardware_refusal_says_what_the_variant_runs_on() -> None:
    result = plan([node("a")], [needing(CUDA, (8, 0))], [])
    message = note(result, 0).message
    assert "none has a device its variant runs on" in message
    assert "cuda with compute capability 8.0 or newer" in message


def test_each_replica_takes_the_first_variant_its_node_s_hardware_runs() -> None:
    # fp16 needs CUDA 8.0+; the CPU node falls back to the q4 variant, the GPU node keeps fp16.
    fp16 = choice("fp16", 6).model_copy(
        update={"accelerators": CUDA, "min_compute_capability": (8, 0)}
    )
    wanted = spec(replicas=2).model_copy(
        update={
            "variant": fp16.variant,
            "estimate": fp16.estimate,
            "accelerators": fp16.accelerators,
            "min_compute_capability": fp16.min_compute_capability,
            "alternatives": (choice("q4_k_m", 3),),
        }
    )
    result = plan([node("cpu", gib=(64,)), gpu_node("gpu", (9, 0))], [wanted], [])
    assert sorted((d.node, d.variant) for d in started(result)) == [
        ("cpu", "q4_k_m"),
        ("gpu", "fp16"),
    ]


# -- stuck placements ---------------------------------------------------------------------


def stuck(
    placement_id: str,
    node_id: str,
    why: StuckReason,
    *,
    replica: int = 0,
    devices: tuple[int, ...] = (0,),
) -> PlacementView:
    pending = placed(placement_id, node_id, state=P.PENDING, replica=replica, devices=devices)
    return pending.model_copy(update={"stuck": why})


@pytest.mark.parametrize("why", list(StuckReason))
def test_a_stuck_placement_is_re_placed_on_another_node_and_stopped(why: StuckReason) -> None:
    nodes = [node("a"), node("b")]
    result = plan(nodes, [spec()], [stuck("p0", "a", why)])
    assert summary(result) == [("replace", "chat", 0, "b", "p0"), ("stop", "p0", "stuck")]
    (replace,) = replaced(result)
    assert (replace.cause, replace.from_node) == (why.value, "a")


def test_a_stuck_placement_with_no_other_node_stays_and_says_why() -> None:
    result = plan(
        [node("a"), node("b", gib=(2,))], [spec()], [stuck("p0", "a", StuckReason.CRASH_LOOP)]
    )
    assert summary(result) == [("unplaced", "chat", 0, "insufficient_capacity")]
    message = note(result, 0).message
    assert "p0 is stuck on a (crash_loop) and stays there" in message
    assert "1 set aside after a stuck placement" in message
    alone = plan([node("a")], [spec()], [stuck("p0", "a", StuckReason.PLACEMENT_TIMEOUT)])
    assert summary(alone) == [("unplaced", "chat", 0, "no_matching_node")]


def test_a_placement_not_marked_stuck_is_left_alone() -> None:
    nodes = [node("a"), node("b")]
    assert plan(nodes, [spec()], [placed("p0", "a", state=P.PENDING)]).decisions == ()
    assert plan(nodes, [spec()], [placed("p0", "a")]).decisions == ()


def test_a_ready_placement_whose_engine_crash_loops_is_re_placed_and_stopped() -> None:
    nodes = [node("a"), node("b")]
    looping = placed("p0", "a").model_copy(update={"stuck": StuckReason.CRASH_LOOP})
    result = plan(nodes, [spec()], [looping])
    assert summary(result) == [("replace", "chat", 0, "b", "p0"), ("stop", "p0", "stuck")]
    (replace,) = replaced(result)
    assert (replace.cause, replace.from_node) == ("crash_loop", "a")


def test_stuck_re_placements_share_the_in_flight_cap() -> None:
    nodes = [node(n) for n in "abcd"]
    placements = [
        stuck("s0", "a", StuckReason.LOAD_FAILED, replica=0),
        stuck("s1", "a", StuckReason.LOAD_FAILED, replica=1, devices=(0,)),
    ]
    result = plan(
        nodes,
        [spec(replicas=2)],
        placements,
        policy=PlacementPolicy(max_replacements_in_flight=1),
    )
    kinds = summary(result)
    assert kinds[0][0] == "replace" and ("stop", "s0", "stuck") in kinds
    assert kinds[-1] == ("deferred", "chat", 1, "replacements_capped")
    assert "stuck on a (load_failed)" in note(result, -1).message


def test_avoided_nodes_take_no_replica_of_the_deployment() -> None:
    nodes = [node("a", gib=(64,)), node("b", gib=(8,))]
    avoiding = spec().model_copy(update={"avoid_nodes": frozenset({"a"})})
    assert summary(plan(nodes, [avoiding], [])) == [("start", "chat", 0, "b", (0,), "missing")]
    # Another deployment still goes to a.
    assert summary(plan(nodes, [spec("other")], [])) == [
        ("start", "other", 0, "a", (0,), "missing")
    ]
    only_a = spec().model_copy(update={"avoid_nodes": frozenset({"a", "b"})})
    refused = plan(nodes, [only_a], [])
    assert summary(refused) == [("unplaced", "chat", 0, "no_matching_node")]
    assert "2 set aside after a stuck placement of it" in note(refused, 0).message


# -- issue 30: lost means over, frozen deployments, a draining node that goes quiet --------


def test_a_returning_node_never_wins_over_its_ready_replacement() -> None:
    """Item 3: the lost node's placement ended (stopping) when it was declared lost; once it
    renews again its old placement is not current -- the ready replacement stays, nothing
    is stopped as a duplicate, and nothing starts on the returning node."""
    nodes = [node("a"), node("b")]
    old = placed("p-old", "a", state=P.STOPPING)  # ended with the move to lost
    replacement = placed("p-new", "b", replaces="p-old")
    assert plan(nodes, [spec()], [old, replacement]).decisions == ()
    # Before its replacement is ready, the returning node gets only a new placement.
    pending = placed("p-new", "b", replaces="p-old", state=P.PENDING)
    assert plan(nodes, [spec()], [old, pending]).decisions == ()


def test_a_returning_node_whose_replica_was_not_replaced_gets_a_new_placement() -> None:
    """Its ended placement still holds the device until the node has stopped it; then the
    replica is placed afresh -- a new placement, never the old one back."""
    nodes = [node("a"), node("b", gib=(2,))]
    waiting = plan(nodes, [spec()], [placed("p0", "a", state=P.STOPPING)])
    assert summary(waiting) == [("deferred", "chat", 0, "awaiting_stop")]
    assert summary(plan(nodes, [spec()], [])) == [("start", "chat", 0, "a", (0,), "missing")]


def test_a_deployment_the_controller_cannot_plan_is_frozen_never_removed() -> None:
    """Item 16: a deployment without a spec (the controller's catalog is older, its own
    hardware cannot resolve it) keeps its placements and their memory."""
    placements = [placed("p0", "a", deployment="gpu-only", gib=12), placed("p1", "b")]
    result = plan([node("a"), node("b")], [spec()], placements, frozen=frozenset({"gpu-only"}))
    assert result.decisions == ()
    # Its memory still counts: another deployment does not squeeze onto its device.
    big = spec("other", gib=8)
    squeezed = plan([node("a")], [big], placements[:1], frozen=frozenset({"gpu-only"}))
    assert summary(squeezed) == [("unplaced", "other", 0, "insufficient_capacity")]
    # Without the freeze the same input stops it as removed (what used to happen).
    assert summary(plan([node("a"), node("b")], [spec()], placements)) == [
        ("stop", "p0", "removed")
    ]


def test_a_draining_node_that_turns_suspect_keeps_its_move() -> None:
    """Item 6: a draining node that misses a renewal is suspect; its move started there
    first is not undone (its old replica is not made current again)."""
    nodes = [
        NodeView(
            id="a",
            state=S.SUSPECT,
            draining=True,
            devices=(DeviceCapacity(index=0, capacity_bytes=16 * GIB),),
            engines=frozenset({"llama_cpp"}),
        ),
        node("b"),
    ]
    old, moved = placed("p0", "a"), placed("p1", "b", state=P.STARTING)
    assert plan(nodes, [spec()], [old, moved]).decisions == ()
