"""The console's fleet view (FleetStatus) of a real fleet snapshot on PostgreSQL: nodes with
their states and heartbeat ages on database time, replicas as their nodes reported them
(``placing`` before), placements in progress as jobs, the controller and its epoch."""

from __future__ import annotations

import json
from typing import Any

from sbproxy.fleet.agent import fleet_view
from sbproxy.fleet.membership import LIVE_STATES, FleetTiming
from sbproxy.fleet.view import cached_artifacts
from sbproxy.store.fleet import FleetStore, NodeRow
from sbproxy.store.revisions import SharedRevisions
from tests.support.postgres import PostgresServer

TIMING = FleetTiming(heartbeat_ms=1_000, fence_after_ms=5_000, lost_after_ms=60_000)


def test_the_view_of_a_snapshot(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database()
    store = FleetStore(url)
    try:
        for node in ("a", "b"):
            store.join(
                node,
                advertise_url=f"http://127.0.0.1:1/{node}",
                labels={"zone": node},
                engines=["llama_cpp"],
                devices=[{"index": 0, "capacity_bytes": 1000}],
                artifacts=[],
            )
        document = {"deployments": {"chat": {"model": "m", "replicas": 2}}}
        assert (
            SharedRevisions(url).insert_next(
                expected=None, revision=1, document=json.dumps(document)
            )
            is None
        )
        lease = store.hold_controller("a", lease_ms=60_000)
        assert lease is not None
        decision = {
            "deployment": "chat", "replica": 0, "revision": 1, "devices": [0],
            "engine": "llama_cpp", "reserved_bytes": 10,
        }  # fmt: skip
        ready, _ = store.place(lease, {**decision, "node": "a"}, definition={"model": "m"})
        _, job = store.place(lease, {**decision, "replica": 1, "node": "b"}, definition={})
        assert store.placement_ready("a", ready)
        store.renew("a", replicas={"chat": {"state": "ready", "generation": 3, "port": 9,
                                            "active": 1, "queued": 2}})  # fmt: skip
        snapshot = store.snapshot()
        view = fleet_view(snapshot, "b", TIMING)
        # The controller records both lost (no renewal past lost_after_ms): node a's last
        # report is history, its replica shown unreachable, never ready.
        for node in ("a", "b"):
            assert store.move_node(lease, node, from_state="ready", to="lost")
        later = store.snapshot()
    finally:
        store.close()
    assert [(n.node_id, n.state, n.labels) for n in view.nodes] == [
        ("a", "ready", {"zone": "a"}),
        ("b", "ready", {"zone": "b"}),
    ]
    assert all(0 <= (n.heartbeat_age_ms or 0) < 10_000 for n in view.nodes)
    assert view.desired == {"chat": 2}
    assert [
        (r.node_id, r.state, r.generation, r.port, r.active, r.queued) for r in view.replicas
    ] == [
        ("a", "ready", 3, 9, 1, 2),
        ("b", "placing", 0, None, 0, 0),
    ]
    assert [(j.job_id, j.kind, j.node_id, j.status) for j in view.jobs] == [
        (job, "place", "b", "pending")
    ]
    assert view.controller is not None and (view.controller.node_id, view.controller.epoch) == (
        "a",
        1,
    )
    assert view.local_node_id == "b"

    # One state, the controller's: the view shows what it recorded, not its own judgement.
    lost = fleet_view(later, "b", TIMING)
    assert {n.node_id: n.state for n in lost.nodes} == {"a": "lost", "b": "lost"}
    assert [(r.node_id, r.state) for r in lost.replicas] == [
        ("a", "unreachable"),
        ("b", "unreachable"),
    ]


def _member(
    node: str, state: str, inventory: dict[str, dict[str, Any]], *, left: bool = False
) -> NodeRow:
    return NodeRow(
        id=node, advertise_url=None, labels={}, engines=[], devices=[], artifacts=[],
        replicas={}, state=state, cordoned=False, draining=False, left=left, joined_at_ms=0,
        renewed_at_ms=0, inventory=inventory,
    )  # fmt: skip


def test_an_artifact_is_cached_only_on_members_that_still_serve_their_cache() -> None:
    """A node lost (killed) or gone keeps its last report in its row; it is not a place the
    file can be had from, so neither `models ps --fleet` nor the console lists it."""
    held: dict[str, dict[str, Any]] = {"sha256:aa": {"bytes": 10, "verified": True}}
    pulling: dict[str, dict[str, Any]] = {"sha256:aa": {"bytes": 4, "verified": False}}
    members = [
        _member("a", "lost", held),
        _member("b", "ready", held),
        _member("c", "draining", held),
        _member("d", "ready", held, left=True),
        _member("e", "suspect", pulling),
        _member("f", "left", pulling),
    ]
    (row,) = cached_artifacts(members, LIVE_STATES)
    assert row.artifact_digest == "sha256:aa"
    assert row.nodes == ("b", "c")
    assert row.fetching == ("e",)
    assert row.size_bytes == 10
