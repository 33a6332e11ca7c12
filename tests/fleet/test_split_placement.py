"""The planner's splits: one replica over several nodes' llama.cpp RPC workers -- when it
splits (``split: rpc`` always, ``auto`` only when no single node has room, ``none`` never),
over how many nodes, who leads, what each node reserves, and the whole split placed again
when one of its workers is gone."""

from __future__ import annotations

import pytest

from sbproxy.config import DeploymentConfig, SplitMode
from sbproxy.fleet.membership import NodeState
from sbproxy.fleet.placement import (
    DeploymentSpec,
    DeviceCapacity,
    NodeView,
    PlacementPlan,
    PlacementReason,
    PlacementState,
    PlacementView,
    ReplaceReplica,
    SplitWorker,
    StartReplica,
    StopReplica,
    StuckReason,
    UnplacedReplica,
    plan,
    split_share,
)
from sbproxy.model_host.runtime.memory import MemoryEstimate

GIB = 2**30
# 6 GiB of weights, 1 of KV cache, 0.5 of compute buffer, 0.5 of margin: 8 GiB in all.
ESTIMATE = MemoryEstimate(
    weight_bytes=6 * GIB,
    kv_bytes=GIB,
    runtime_overhead_bytes=GIB // 2,
    safety_margin_bytes=GIB // 2,
    total_bytes=8 * GIB,
)
DIGEST = "ab" * 32


def node(
    node_id: str,
    gib: float = 6,
    *,
    state: NodeState = NodeState.READY,
    cached: bool = False,
    engines: frozenset[str] = frozenset({"llama_cpp"}),
) -> NodeView:
    return NodeView(
        id=node_id,
        state=state,
        engines=engines,
        devices=(DeviceCapacity(index=0, capacity_bytes=int(gib * GIB)),),
        cached_artifacts=frozenset({DIGEST}) if cached else frozenset(),
    )


def spec(
    split: SplitMode, *, deployment: str = "big", estimate: MemoryEstimate = ESTIMATE
) -> DeploymentSpec:
    return DeploymentSpec(
        id=deployment,
        revision=1,
        replicas=1,
        engines=("llama_cpp",),
        estimate=estimate,
        artifact_digest=DIGEST,
        split=split,
    )


def only(result: PlacementPlan) -> StartReplica | ReplaceReplica | UnplacedReplica:
    starts = [d for d in result.decisions if not isinstance(d, StopReplica)]
    assert len(starts) == 1, result
    decision = starts[0]
    assert isinstance(decision, StartReplica | ReplaceReplica | UnplacedReplica)
    return decision


def test_the_share_is_even_over_the_workers_plus_a_compute_buffer_each() -> None:
    assert split_share(ESTIMATE, 2) == (7.5 * GIB) / 2 + GIB // 2
    assert split_share(ESTIMATE, 3) == int(2.5 * GIB) + GIB // 2


def test_auto_splits_a_replica_no_single_node_holds_and_says_why() -> None:
    nodes = [node("a"), node("b"), node("c", cached=True)]
    decision = only(plan(nodes, [spec(SplitMode.AUTO)], []))
    assert isinstance(decision, StartReplica)
    share = split_share(ESTIMATE, 2)
    # The leader is the node holding the GGUF (it sends the weights); it reserves a second
    # compute buffer for its own llama-server.
    assert decision.node == "c"
    assert [(w.node, w.reserved_bytes) for w in decision.workers] == [
        ("c", share + GIB // 2),
        ("a", share),
    ]
    assert decision.reserved_bytes == share + GIB // 2
    assert decision.engine == "llama_cpp"
    assert "none has 1 device(s) with 8589934592 bytes free" in decision.reason
    assert "split: auto: split over 2 nodes with llama.cpp RPC, leader c (holds the artifact)" in (
        decision.reason
    )


def test_auto_places_a_replica_that_fits_one_node_on_that_node() -> None:
    decision = only(plan([node("a", 16), node("b", 16)], [spec(SplitMode.AUTO)], []))
    assert isinstance(decision, StartReplica)
    assert decision.workers == ()
    assert decision.reserved_bytes == 8 * GIB


def test_none_never_splits() -> None:
    decision = only(plan([node("a"), node("b"), node("c")], [spec(SplitMode.NONE)], []))
    assert isinstance(decision, UnplacedReplica)
    assert decision.reason is PlacementReason.INSUFFICIENT_CAPACITY


def test_rpc_splits_even_a_replica_that_fits_one_node() -> None:
    decision = only(plan([node("a", 16), node("b", 16)], [spec(SplitMode.RPC)], []))
    assert isinstance(decision, StartReplica)
    assert sorted(w.node for w in decision.workers) == ["a", "b"]
    assert decision.reason.startswith("split: rpc: split over 2 nodes")


def test_a_split_takes_the_fewest_nodes_that_hold_it() -> None:
    # 2 nodes would need 4.25 GiB each; 3 nodes need 3 GiB (3.5 for the leader).
    nodes = [node(name, 3.5) for name in "abcd"]
    decision = only(plan(nodes, [spec(SplitMode.AUTO)], []))
    assert isinstance(decision, StartReplica)
    assert len(decision.workers) == 3
    assert decision.workers[0].reserved_bytes == split_share(ESTIMATE, 3) + GIB // 2


def test_a_split_that_fits_nowhere_is_unplaced_with_both_reasons() -> None:
    decision = only(plan([node("a", 2), node("b", 2)], [spec(SplitMode.AUTO)], []))
    assert isinstance(decision, UnplacedReplica)
    assert decision.reason is PlacementReason.INSUFFICIENT_CAPACITY
    assert "no split either: big does not fit split over all 2 ready node(s)" in decision.message


def test_a_split_needs_two_ready_llama_cpp_nodes() -> None:
    nodes = [node("a", 16), node("b", 16, engines=frozenset({"vllm"}))]
    decision = only(plan(nodes, [spec(SplitMode.RPC)], []))
    assert isinstance(decision, UnplacedReplica)
    assert "needs two or more ready nodes with llama.cpp; 1 found" in decision.message


def test_a_split_reserves_on_every_worker_node() -> None:
    existing = split_of_a_and_b()
    small = DeploymentSpec(
        id="small",
        revision=1,
        replicas=1,
        engines=("llama_cpp",),
        estimate=MemoryEstimate.from_total(2 * GIB),
    )
    # a and b have 1.25 and 1.75 GiB left: only c takes the 2 GiB replica.
    result = plan([node("a"), node("b"), node("c")], [spec(SplitMode.AUTO), small], [existing])
    (start,) = [d for d in result.decisions if isinstance(d, StartReplica)]
    assert (start.deployment, start.node) == ("small", "c")
    assert not [d for d in result.decisions if d.deployment == "big"]


def test_a_gone_worker_places_the_whole_split_again_and_stops_the_old_one() -> None:
    existing = split_of_a_and_b()
    nodes = [node("a"), node("b", state=NodeState.LOST), node("c"), node("d")]
    result = plan(nodes, [spec(SplitMode.AUTO)], [existing])
    (replace,) = [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    assert replace.cause == "worker_failed"
    assert replace.from_node == "b"
    assert replace.replaces == "p1"
    # The old split serves nothing without b: its devices are the new split's (a again).
    assert [w.node for w in replace.workers] == ["a", "c"]
    (stop,) = [d for d in result.decisions if isinstance(d, StopReplica)]
    assert (stop.placement, stop.cause) == ("p1", "stuck")


def test_a_split_whose_worker_is_gone_stops_even_when_no_new_split_fits_yet() -> None:
    existing = split_of_a_and_b()
    nodes = [node("a"), node("b", state=NodeState.LOST)]
    result = plan(nodes, [spec(SplitMode.AUTO)], [existing])
    assert not [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    (stop,) = [d for d in result.decisions if isinstance(d, StopReplica)]
    assert (stop.placement, stop.cause) == ("p1", "stuck")
    (note,) = [d for d in result.decisions if isinstance(d, UnplacedReplica)]
    assert "lost its RPC worker on b and stops; no other split fits" in note.message


def test_a_split_whose_leader_is_gone_holds_nothing_on_its_workers() -> None:
    # Its workers stop when they see their leader gone: b's only device takes the new split.
    nodes = [node("a", state=NodeState.LOST), node("b"), node("c")]
    result = plan(nodes, [spec(SplitMode.AUTO)], [split_of_a_and_b()])
    (replace,) = [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    assert (replace.cause, replace.replaces) == ("node_gone", "p1")
    assert sorted(w.node for w in replace.workers) == ["b", "c"]


def test_a_gone_worker_outranks_the_leader_s_crash_loop() -> None:
    # The leader's engine crash-looped for want of b: the split moves off b, not off a.
    crashed = split_of_a_and_b(stuck=StuckReason.CRASH_LOOP)
    nodes = [node("a"), node("b", state=NodeState.LOST), node("c")]
    result = plan(nodes, [spec(SplitMode.AUTO)], [crashed])
    (replace,) = [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    assert (replace.cause, replace.from_node) == ("worker_failed", "b")
    assert [w.node for w in replace.workers] == ["a", "c"]


def test_a_split_with_a_leaving_worker_moves_at_once() -> None:
    nodes = [node("a"), node("b", state=NodeState.LEAVING), node("c")]
    result = plan(nodes, [spec(SplitMode.AUTO)], [split_of_a_and_b()])
    (replace,) = [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    assert (replace.cause, replace.from_node) == ("worker_failed", "b")
    assert [w.node for w in replace.workers] == ["a", "c"]
    # A leaving leader is another matter: it may be back within its grace.
    leader_leaving = [node("a", state=NodeState.LEAVING), node("b"), node("c")]
    assert not plan(leader_leaving, [spec(SplitMode.AUTO)], [split_of_a_and_b()]).decisions


def test_a_worker_the_caller_marks_failed_is_avoided_by_the_new_split() -> None:
    existing = split_of_a_and_b(stuck=StuckReason.WORKER_FAILED, stuck_node="b")
    nodes = [node(name, 12) for name in "abcd"]
    result = plan(nodes, [spec(SplitMode.RPC)], [existing])
    (replace,) = [d for d in result.decisions if isinstance(d, ReplaceReplica)]
    assert (replace.cause, replace.from_node) == ("worker_failed", "b")
    # Not b (it failed there); a's device is free again (the old split serves nothing).
    assert [w.node for w in replace.workers] == ["a", "c"]


@pytest.mark.parametrize(
    ("body", "path", "words"),
    [
        ({"engine": "vllm", "split": "rpc"}, "split", "vLLM has no such split"),
        ({"tensor_parallel": 2, "split": "rpc"}, "split", "tensor_parallel 2"),
        ({"split": "both"}, "split", "'auto', 'rpc' or 'none'"),
    ],
)
def test_split_config_refusals_name_the_field(
    body: dict[str, object], path: str, words: str
) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        DeploymentConfig.model_validate({"model": "m", **body})
    assert path in str(caught.value)


def test_a_spec_takes_its_split_from_the_definition() -> None:
    config = DeploymentConfig.model_validate({"model": "m", "split": "rpc"})
    made = DeploymentSpec.from_config(
        "big", config, revision=1, estimate=ESTIMATE, engines=("llama_cpp",)
    )
    assert made.split is SplitMode.RPC
    assert DeploymentConfig.model_validate({"model": "m"}).split is SplitMode.AUTO


def split_of_a_and_b(**fields: object) -> PlacementView:
    """A ready split of ``big`` over a (leading) and b, as the planner placed it."""
    share = split_share(ESTIMATE, 2)
    return PlacementView.model_validate(
        {
            "id": "p1",
            "deployment": "big",
            "replica": 0,
            "revision": 1,
            "node": "a",
            "devices": (0,),
            "reserved_bytes": share + GIB // 2,
            "state": PlacementState.READY,
            "workers": (
                SplitWorker(node="a", devices=(0,), reserved_bytes=share + GIB // 2),
                SplitWorker(node="b", devices=(0,), reserved_bytes=share),
            ),
            **fields,
        }
    )
