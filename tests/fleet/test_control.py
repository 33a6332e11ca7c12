"""The controller's and the node's pure decisions over a fleet snapshot (fleet/control.py),
table-tested: states on database time with the take-over grace, checked moves, placements
shown at the current revision by definition, gone placements forgotten only once replaced,
and what one node must run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from sbproxy.catalog import Catalog, ResolvedArtifact, parse_catalog, pinned_artifact
from sbproxy.config import DeploymentConfig
from sbproxy.fleet.control import (
    UNREACHED_ASKS_TO_FENCE,
    avoided_nodes,
    definition_digest,
    deployment_spec,
    facts_of,
    failed_workers,
    forgettable,
    judge_own_lease,
    local_deployments,
    local_placements,
    node_moves,
    observe,
    partition_peers,
    placement_views,
    reported_facts,
    rpc_report_key,
    stuck_placements,
)
from sbproxy.fleet.membership import FenceVerdict, FleetTiming, NodeState, PeerAnswer
from sbproxy.fleet.placement import (
    DeploymentSpec,
    EstimateBasis,
    NodeView,
    PlacementState,
    StuckReason,
)
from sbproxy.model_host.runtime.memory import GgufFacts, estimate_memory

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
    variant: str | None = None
    workers: tuple[dict[str, Any], ...] = ()


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
        # ... but a member it has not seen renew is never ready: no new replica goes to a
        # node silent since before the take-over (issue 30, item 4).
        (60_000, {}, NOW - 500, NodeState.SUSPECT),
        (60_000, {}, NOW - 10_000, NodeState.LOST),
        (0, {}, NOW - 500, NodeState.READY),  # renewed since the take-over
        # A member already recorded lost gets no take-over grace (item 21).
        (60_000, {"state": "lost"}, NOW - 500, NodeState.LOST),
        # A cordoned or draining member that stops renewing is suspect (item 6).
        (1_501, {"cordoned": True}, None, NodeState.SUSPECT),
        (1_501, {"cordoned": True, "draining": True}, None, NodeState.SUSPECT),
    ],
)
def test_observe_derives_states_on_database_time(
    silence_ms: int, flags: dict[str, bool], watching_since: int | None, expected: NodeState
) -> None:
    node = Node("n1", renewed_at_ms=NOW - silence_ms, **flags)  # type: ignore[arg-type]
    (view,) = observe([node], now_ms=NOW, timing=TIMING, watching_since_ms=watching_since)
    assert view.state is expected
    assert view.draining is bool(flags.get("draining"))


def test_a_new_controller_is_not_suspect_to_itself() -> None:
    # It renewed in the beat that took the lease, just before the take-over: the same
    # renewal time leaves a peer unconfirmed, but not the controller's own node.
    own, peer = Node("own", renewed_at_ms=NOW - 300), Node("peer", renewed_at_ms=NOW - 300)
    views = observe(
        [own, peer], now_ms=NOW, timing=TIMING, watching_since_ms=NOW - 200, renewed_here="own"
    )
    assert [(view.id, view.state) for view in views] == [
        ("own", NodeState.READY),
        ("peer", NodeState.SUSPECT),
    ]


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


def test_node_moves_tell_routine_moves_from_worrying_ones() -> None:
    # A new controller sees "fresh" (renewed 300 ms ago) as suspect only because it has
    # not seen it renew yet: routine. "late" missed its renewals, "gone" is lost: not.
    nodes = [
        Node("fresh", renewed_at_ms=NOW - 300),
        Node("late", renewed_at_ms=NOW - 1_600),
        Node("gone", renewed_at_ms=NOW - 10_000),
        Node("back", state="suspect", renewed_at_ms=NOW),
        Node("stopping", renewed_at_ms=NOW - 100),
    ]
    views = [
        NodeView(id="fresh", state=NodeState.SUSPECT),
        NodeView(id="late", state=NodeState.SUSPECT),
        NodeView(id="gone", state=NodeState.LOST),
        NodeView(id="back", state=NodeState.READY),
        NodeView(id="stopping", state=NodeState.LEAVING),
    ]
    moves = node_moves(nodes, views, now_ms=NOW, timing=TIMING)
    assert {m.node: m.routine for m in moves} == {
        "fresh": True,
        "late": False,
        "gone": False,
        "back": True,
        "stopping": True,
    }


def test_a_placement_with_the_current_definition_counts_at_the_current_revision() -> None:
    same = Placement("p1", "a", revision=1, definition={"model": "m"})
    changed = Placement("p2", "b", revision=1, definition={"model": "old"})
    current = {"chat": (7, definition_digest({"model": "m"}))}
    views = placement_views([same, changed], current)
    assert [(v.id, v.revision) for v in views] == [("p1", 7), ("p2", 1)]


def test_a_placement_of_the_current_definition_holds_what_its_variant_is_sized_at_now() -> None:
    # Placed on file sizes (10 bytes); the header-based estimate (7) arrived since.
    current_one = Placement("p1", "a", definition={"model": "m"})
    older = Placement("p2", "b", definition={"model": "old"})
    pinned = Placement("p3", "c", deployment="pinned", definition={"model": "m"}, variant="q8")
    current = {
        "chat": (2, definition_digest({"model": "m"})),
        "pinned": (1, definition_digest({"model": "m"})),
    }
    sizes = {("chat", None): 7, ("pinned", "q8"): 5, ("pinned", "q4"): 3}
    views = placement_views([current_one, older, pinned], current, sizes=sizes)
    assert [(v.id, v.reserved_bytes) for v in views] == [("p1", 7), ("p2", 10), ("p3", 5)]


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


def test_an_older_revision_or_removed_deployment_on_a_dead_node_is_forgotten() -> None:
    """Issue 30, item 21: a dead node's placement of an older revision (its replica runs a
    newer one elsewhere) or of a deployment no longer desired is deleted, so the node finds
    nothing of it to start when it returns."""
    nodes = [NodeView(id="a", state=NodeState.LOST), NodeView(id="b", state=NodeState.READY)]
    old = Placement("old", "a", revision=1)
    newer = Placement("newer", "b", revision=2)
    assert forgettable(placement_views([old, newer], {}), nodes) == ["old"]
    gone = Placement("gone", "a", deployment="retired")
    views = placement_views([gone], {})
    assert forgettable(views, nodes) == []  # not told what is wanted: kept
    assert forgettable(views, nodes, wanted=frozenset({"chat"})) == ["gone"]
    assert forgettable(views, nodes, wanted=frozenset({"chat", "retired"})) == []


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
    placed = {"warm": True, "pull": "on_boot", "replicas": 1, "devices": [0]}
    assert local_deployments(placements, "a") == {
        "chat": {"model": "new", **placed},
        "embed": {"model": "e", **placed},
    }
    assert local_deployments(placements, "c") == {}


def test_two_replicas_on_one_node_run_under_their_own_ids_on_their_own_devices() -> None:
    placements = [
        Placement("p1", "a", replica=1, devices=(1,), definition={"model": "m", "replicas": 3}),
        Placement("p2", "a", replica=0, devices=(0,), definition={"model": "m", "replicas": 3}),
        Placement("p3", "b", replica=2, devices=(0,), definition={"model": "m", "replicas": 3}),
        Placement("p4", "a", replica=2, devices=(2, 3), state="stopping"),
    ]
    placed = {"model": "m", "warm": True, "pull": "on_boot", "replicas": 1}
    assert local_deployments(placements, "a") == {
        "chat": {**placed, "devices": [0]},
        "chat.r1": {**placed, "devices": [1]},
    }
    assert {k: p.id for k, p in local_placements(placements, "a").items()} == {
        "chat": "p2",
        "chat.r1": "p1",
    }
    assert list(local_deployments(placements, "b")) == ["chat.r2"]


UNREACHED = PeerAnswer(node_id="b", reached=False)
# This node lost the database at database time 10_000 (its cut-off).
CUT_OFF_MS = 10_000
FRESH = PeerAnswer(node_id="b", reached=True, renewed_at_ms=CUT_OFF_MS + 1, streak_since_ms=1)
STUCK = PeerAnswer(node_id="b", reached=True, renewed_at_ms=CUT_OFF_MS - 50, streak_since_ms=1)


@pytest.mark.parametrize(
    ("since_ms", "answers", "unreached_before", "expected"),
    [
        (4_999, [], 0, (FenceVerdict.SERVE, 0)),
        # A peer renewed after this node lost the database: it is the one cut off.
        (5_000, [FRESH], 0, (FenceVerdict.FENCE, 0)),
        # The peer's last renewal is older than this node's loss: down for everyone.
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
        cut_off_at_ms=CUT_OFF_MS,
        timing=TIMING,
        peers_known=1,
        answers=answers,
        unreached_before=unreached_before,
    )
    assert got == expected


@dataclass
class Member:
    """A ``NodeRow``-shaped member for :func:`partition_peers`."""

    id: str
    renewed_at_ms: int
    left: bool = False
    advertise_url: str | None = "http://10.0.0.9:8080"


def test_only_members_alive_at_the_last_renewal_are_partition_peers() -> None:
    """Issue 30, item 19: a member dead for longer than lost_after_ms before this node's
    last renewal is not asked and not counted, so the survivor of a two-node fleet holds in
    an outage for everyone instead of fencing as a 'minority'."""
    nodes = [
        Member("me", 100_000),
        Member("alive", 99_000),
        Member("dead", 100_000 - TIMING.lost_after_ms - 1),
        Member("removed", 99_500, left=True),
        Member("no-url", 99_500, advertise_url=None),
    ]
    peers = partition_peers(nodes, node_id="me", at_ms=100_000, timing=TIMING)
    assert [p.id for p in peers] == ["alive"]
    only_dead = partition_peers(nodes[:1] + nodes[2:3], node_id="me", at_ms=100_000, timing=TIMING)
    assert only_dead == []
    # With no live peer the verdict past the deadline is hold, never a minority fence.
    verdict, _ = judge_own_lease(
        since_own_renewal_ms=TIMING.fence_after_ms,
        cut_off_at_ms=100_200,
        timing=TIMING,
        peers_known=len(only_dead),
        answers=[],
        unreached_before=UNREACHED_ASKS_TO_FENCE,
    )
    assert verdict is FenceVerdict.HOLD


# -- stuck placements, avoided nodes, reported facts, specs --------------------------------


@dataclass
class Reported:
    """A ``NodeRow``-shaped member with its replica reports and GGUF facts."""

    id: str
    replicas: dict[str, dict[str, Any]] = field(default_factory=dict)
    artifact_facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    left: bool = False


@dataclass
class Pending:
    id: str
    node: str
    state: str = "pending"
    deployment: str = "chat"
    updated_at_ms: int = NOW
    replica: int = 0
    workers: tuple[dict[str, Any], ...] = ()


TIMEOUT = 60_000


@pytest.mark.parametrize(
    ("placement", "report", "expected"),
    [
        (Pending("p1", "a"), {}, None),
        (Pending("p1", "a", updated_at_ms=NOW - TIMEOUT), {}, None),
        (Pending("p1", "a", updated_at_ms=NOW - TIMEOUT - 1), {}, StuckReason.PLACEMENT_TIMEOUT),
        (
            Pending("p1", "a", state="starting", updated_at_ms=NOW - TIMEOUT - 1),
            {},
            StuckReason.PLACEMENT_TIMEOUT,
        ),
        # A ready or stopping placement is never stuck for its age.
        (Pending("p1", "a", state="ready", updated_at_ms=0), {}, None),
        (Pending("p1", "a", state="stopping", updated_at_ms=0), {}, None),
        # A ready placement whose engine its node reports held in a crash loop is stuck;
        # a stopping one is already on its way out.
        (
            Pending("p1", "a", state="ready"),
            {"chat": {"placement": "p1", "crash_looped": True}},
            StuckReason.CRASH_LOOP,
        ),
        (
            Pending("p1", "a", state="ready"),
            {"chat": {"placement": "p0", "crash_looped": True}},
            None,
        ),
        (
            Pending("p1", "a", state="stopping"),
            {"chat": {"placement": "p1", "crash_looped": True}},
            None,
        ),
        # The node reports the failure for this placement: at once.
        (
            Pending("p1", "a"),
            {"chat": {"placement": "p1", "failure": "load_failed"}},
            StuckReason.LOAD_FAILED,
        ),
        (
            Pending("p1", "a"),
            {"chat": {"placement": "p1", "crash_looped": True}},
            StuckReason.CRASH_LOOP,
        ),
        # ...but a failure reported for another placement says nothing about this one.
        (Pending("p2", "a"), {"chat": {"placement": "p1", "failure": "load_failed"}}, None),
        (Pending("p1", "a"), {"chat": {"placement": "p1", "crash_looped": False}}, None),
    ],
)
def test_stuck_placements(
    placement: Pending, report: dict[str, Any], expected: StuckReason | None
) -> None:
    nodes = [Reported("a", replicas=report)]
    found = stuck_placements([placement], nodes, now_ms=NOW, timeout_ms=TIMEOUT)
    assert found == ({} if expected is None else {placement.id: expected})


def test_a_ready_placement_whose_load_failed_on_its_node_is_stuck() -> None:
    # It served, then its node restarted without the device it holds: the launch fails.
    ready = Pending("p1", "a", state="ready", replica=1)
    failed = {"placement": "p1", "state": "failed", "failure": "load_failed"}
    nodes = [Reported("a", replicas={"chat.r1": failed})]
    assert stuck_placements([ready], nodes, now_ms=NOW, timeout_ms=TIMEOUT) == {
        "p1": StuckReason.LOAD_FAILED
    }
    # A failure reported for another placement of that local id is not this one's.
    other = [Reported("a", replicas={"chat.r1": {**failed, "placement": "p0"}})]
    assert stuck_placements([ready], other, now_ms=NOW, timeout_ms=TIMEOUT) == {}


def test_a_replica_s_report_is_read_under_its_local_id() -> None:
    # Node a runs replicas 0 and 1 of chat: its report names them chat and chat.r1.
    first = Pending("p0", "a", state="ready")
    second = Pending("p1", "a", state="ready", replica=1)
    looping = {"placement": "p1", "crash_looped": True}
    report = {"chat": {"placement": "p0", "routable": True}, "chat.r1": looping}
    nodes = [Reported("a", replicas=report)]
    found = stuck_placements([first, second], nodes, now_ms=NOW, timeout_ms=TIMEOUT)
    assert found == {"p1": StuckReason.CRASH_LOOP}


def test_a_placement_on_a_node_that_is_not_a_member_is_left_to_the_gone_path() -> None:
    old = Pending("p1", "gone", updated_at_ms=0)
    left = Reported("gone", left=True)
    assert stuck_placements([old], [left], now_ms=NOW, timeout_ms=TIMEOUT) == {}
    assert stuck_placements([old], [], now_ms=NOW, timeout_ms=TIMEOUT) == {}


def test_placement_views_carry_the_stuck_reason() -> None:
    views = placement_views(
        [Placement("p1", "a", state="pending"), Placement("p2", "b")],
        {},
        {"p1": StuckReason.CRASH_LOOP},
    )
    assert [(v.id, v.stuck) for v in views] == [("p1", StuckReason.CRASH_LOOP), ("p2", None)]


SPLIT_WORKERS = (
    {"node": "a", "devices": [0], "reserved_bytes": 60},
    {"node": "b", "devices": [1], "reserved_bytes": 50},
)


@pytest.mark.parametrize(
    ("b_reports", "state", "expected"),
    [
        ({"state": "ready", "gate_port": 4000}, "ready", {}),
        ({"state": "starting"}, "pending", {}),
        ({"state": "failed", "error": "rpc_worker_exited"}, "ready", {"p1": "b"}),
        ({"state": "failed", "error": "engine_provision_failed"}, "pending", {"p1": "b"}),
        # A split being stopped is not moved again.
        ({"state": "failed"}, "stopping", {}),
    ],
)
def test_a_split_whose_worker_reports_failed_is_stuck_on_that_worker(
    b_reports: dict[str, Any], state: str, expected: dict[str, str]
) -> None:
    split = Pending("p1", "a", state=state, workers=SPLIT_WORKERS)
    nodes = [
        Reported("a", replicas={rpc_report_key("p1"): {"state": "ready", "gate_port": 1}}),
        Reported("b", replicas={rpc_report_key("p1"): b_reports}),
    ]
    assert failed_workers([split], nodes) == expected
    stuck = stuck_placements([split], nodes, now_ms=NOW, timeout_ms=TIMEOUT)
    assert stuck == dict.fromkeys(expected, StuckReason.WORKER_FAILED)
    # Another placement's report is not this one's.
    other = [Reported("b", replicas={rpc_report_key("p0"): {"state": "failed"}})]
    assert failed_workers([split], other) == {}


def test_placement_views_carry_a_split_and_keep_its_shares() -> None:
    split = Placement("p1", "a", reserved_bytes=60, workers=SPLIT_WORKERS)
    views = placement_views(
        [split],
        {"chat": (1, definition_digest(split.definition))},
        {"p1": StuckReason.WORKER_FAILED},
        sizes={("chat", None): 500},
        failed_on={"p1": "b"},
    )
    (view,) = views
    assert [(w.node, w.devices, w.reserved_bytes) for w in view.workers] == [
        ("a", (0,), 60),
        ("b", (1,), 50),
    ]
    # The whole model's size now is not the leader's share.
    assert view.reserved_bytes == 60
    assert (view.stuck, view.stuck_node) == (StuckReason.WORKER_FAILED, "b")


@dataclass
class Avoid:
    deployment: str
    node: str
    until_ms: int


def test_avoided_nodes_are_those_still_in_their_cooldown() -> None:
    rows = [Avoid("chat", "a", NOW + 1), Avoid("chat", "b", NOW), Avoid("embed", "a", NOW + 5)]
    assert avoided_nodes(rows, now_ms=NOW) == {
        "chat": frozenset({"a"}),
        "embed": frozenset({"a"}),
    }


FACTS = GgufFacts(
    architecture="llama",
    version=3,
    tensor_count=10,
    block_count=24,
    head_count=14,
    head_count_kv=2,
    key_length=64,
    value_length=64,
    embedding_length=896,
    context_length=32_768,
)


def test_reported_facts_take_the_smallest_node_id_and_skip_a_malformed_report() -> None:
    other = GgufFacts(**{**facts_of(FACTS), "block_count": 99})
    nodes = [
        Reported("b", artifact_facts={"d1": facts_of(other)}),
        Reported("a", artifact_facts={"d1": facts_of(FACTS), "d2": {"architecture": "x"}}),
    ]
    assert reported_facts(nodes) == {"d1": FACTS}


def test_local_deployments_pin_the_variant_a_placement_names() -> None:
    placements = [
        Placement(
            "p1", "a", definition={"model": "m", "heterogeneous_variants": True}, variant="q8"
        ),
        Placement("p2", "a", deployment="other", definition={"model": "o"}),
    ]
    assert local_deployments(placements, "a") == {
        "chat": {
            "model": "m",
            "heterogeneous_variants": True,
            "variant": "q8",
            "warm": True,
            "pull": "on_boot",
            "replicas": 1,
            "devices": [0],
        },
        "other": {"model": "o", "warm": True, "pull": "on_boot", "replicas": 1, "devices": [0]},
    }


CATALOG = """
schema_version: 2
catalog_revision: fleet-test-1
models:
  chat:
    params: 1B
    license: apache-2.0
    family: test
    context_length: 8192
    variants:
""" + "".join(
    f"""
      - id: {variant}
        format: {fmt}
        quant: {quant}
        engines: [{engines}]
        source: hf:acme/chat
        revision: 0123456789abcdef0123456789abcdef01234567
        files: [{{path: {path}, sha256: "{digit * 64}", size_bytes: {size}}}]
        requirements: {{{needs}, min_memory_bytes: 1}}
        stability: preview
        certification: test
"""
    for variant, fmt, quant, engines, path, digit, size, needs in (
        (
            "bf16",
            "safetensors",
            "BF16",
            "vllm",
            "model.safetensors",
            "a",
            2_000_000_000,
            "accelerators: [cuda], min_compute_capability: {major: 8, minor: 0}",
        ),
        (
            "q8_0",
            "gguf",
            "Q8_0",
            "llama_cpp",
            "chat-q8.gguf",
            "b",
            1_000_000_000,
            "accelerators: [cpu, cuda]",
        ),
        (
            "q4_k_m",
            "gguf",
            "Q4_K_M",
            "llama_cpp",
            "chat-q4.gguf",
            "c",
            500_000_000,
            "accelerators: [cpu, cuda]",
        ),
    )
)


def catalog_and_artifacts() -> tuple[Catalog, dict[str, ResolvedArtifact]]:
    catalog = parse_catalog(CATALOG, source="test")
    entry = catalog.models["chat"]
    artifacts = {
        v.id: pinned_artifact(catalog, "chat", entry, v, engine=v.engines[0])
        for v in entry.variants
    }
    return catalog, artifacts


def expected(artifact: ResolvedArtifact, facts: GgufFacts | None, **config: Any) -> int:
    chosen = DeploymentConfig.model_validate({"model": "chat", **config})
    return estimate_memory(
        weights_bytes=artifact.total_size_bytes,
        facts=facts,
        seq_len=chosen.max_context or artifact.context_length,
        concurrency=chosen.max_concurrency,
        kv_quant=chosen.kv_quant,
        safety_margin=0.1,
        format_quant=artifact.quant,
        tensor_parallel=chosen.tensor_parallel or 1,
    ).total_bytes


def test_a_spec_is_sized_from_reported_gguf_facts_when_a_node_has_them() -> None:
    catalog, artifacts = catalog_and_artifacts()
    q8 = artifacts["q8_0"]
    config = DeploymentConfig.model_validate({"model": "chat", "variant": "q8_0"})

    def spec_with(facts: dict[str, GgufFacts]) -> DeploymentSpec:
        return deployment_spec(
            "chat",
            config,
            revision=3,
            resolved=q8,
            catalog=catalog,
            facts=facts,
            safety_margin=0.1,
            avoid=frozenset({"n9"}),
        )

    sized = spec_with({q8.digest: FACTS})
    assert sized.estimate_basis is EstimateBasis.GGUF_HEADER
    assert sized.estimate.total_bytes == expected(q8, FACTS, variant="q8_0")
    assert (sized.variant, sized.engines, sized.alternatives) == ("q8_0", ("llama_cpp",), ())
    assert sized.avoid_nodes == frozenset({"n9"})
    # A pinned variant carries the hardware it needs from the catalog.
    assert (sized.accelerators, sized.min_compute_capability) == (frozenset({"cpu", "cuda"}), None)
    guessed = spec_with({"some-other-digest": FACTS})
    assert guessed.estimate_basis is EstimateBasis.FILE_SIZE
    assert guessed.estimate.total_bytes == expected(q8, None, variant="q8_0")
    # The model's real shape gives another figure than the guess from its size.
    assert guessed.estimate.total_bytes != sized.estimate.total_bytes


def test_a_heterogeneous_spec_offers_every_variant_with_its_own_estimate() -> None:
    catalog, artifacts = catalog_and_artifacts()
    body = {"model": "chat", "replicas": 2, "heterogeneous_variants": True}
    config = DeploymentConfig.model_validate(body)
    spec = deployment_spec(
        "chat",
        config,
        revision=1,
        resolved=artifacts["q8_0"],
        catalog=catalog,
        facts={artifacts["q4_k_m"].digest: FACTS},
        safety_margin=0.1,
    )
    choices = [
        (c.variant, c.engines, c.estimate.total_bytes, c.estimate_basis) for c in spec.choices()
    ]
    assert choices == [
        ("bf16", ("vllm",), expected(artifacts["bf16"], None, **body), EstimateBasis.FILE_SIZE),
        ("q8_0", ("llama_cpp",), expected(artifacts["q8_0"], None, **body), "file_size"),
        ("q4_k_m", ("llama_cpp",), expected(artifacts["q4_k_m"], FACTS, **body), "gguf_header"),
    ]
    needs = [(c.accelerators, c.min_compute_capability) for c in spec.choices()]
    assert needs == [
        (frozenset({"cuda"}), (8, 0)),
        (frozenset({"cpu", "cuda"}), None),
        (frozenset({"cpu", "cuda"}), None),
    ]
    # An explicit engine keeps only the variants it serves.
    forced = DeploymentConfig.model_validate({**body, "engine": "llama_cpp"})
    only = deployment_spec(
        "chat",
        forced,
        revision=1,
        resolved=artifacts["q8_0"],
        catalog=catalog,
        facts={},
        safety_margin=0.1,
    )
    assert [c.variant for c in only.choices()] == ["q8_0", "q4_k_m"]
