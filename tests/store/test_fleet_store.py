"""The fleet's rows on a real PostgreSQL server: membership on database time, one controller
at a time with a growing epoch, and a deposed controller's writes refused by the database."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from sbproxy.store.fleet import Deposed, NodeIdInUse, NodeRemoved
from sbproxy.store.fleet import FleetStore as Store
from sbproxy.store.postgres import JournalUnavailable
from tests.support.postgres import PostgresServer

LEASE_MS = 60_000


def _decision(node: str, *, replica: int = 0) -> dict[str, Any]:
    return {
        "kind": "start",
        "deployment": "chat",
        "replica": replica,
        "revision": 1,
        "node": node,
        "devices": [0],
        "engine": "llama_cpp",
        "reserved_bytes": 100,
    }


_OPEN: list[Store] = []


@pytest.fixture
def url(postgres_server: PostgresServer) -> Iterator[str]:
    yield postgres_server.create_database()
    while _OPEN:
        _OPEN.pop().close()


def _open(url: str) -> Store:
    """A store closed after the test."""
    store = Store(url)
    _OPEN.append(store)
    return store


def _join(
    store: Store,
    node: str,
    *,
    instance: str = "",
    live_within_ms: int | None = None,
    take_over: int | None = None,
) -> int:
    return store.join(
        node,
        advertise_url=f"http://127.0.0.1/{node}",
        labels={"zone": "a"},
        engines=["llama_cpp"],
        devices=[{"index": 0, "capacity_bytes": 1000}],
        artifacts=[],
        instance=instance,
        live_within_ms=live_within_ms,
        take_over_renewed_at_ms=take_over,
    )


def test_a_renewal_is_stamped_with_database_time_and_carries_replica_counts(url: str) -> None:
    store = _open(url)
    joined = _join(store, "n1")
    renewed = store.renew("n1", replicas={"chat": {"active": 2, "queued": 1}})
    assert renewed is not None and renewed.now_ms is not None
    now = renewed.now_ms
    assert now >= joined and renewed.left is False and renewed.state == "ready"
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
        ).fetchone()
    assert row is not None and 0 <= row[0] - now < 10_000
    (node,) = store.snapshot().nodes
    assert node.renewed_at_ms == now
    assert node.replicas == {"chat": {"active": 2, "queued": 1}}
    assert store.renew("unknown", replicas={}) is None


def test_a_rejoin_keeps_a_cordon_and_a_removed_node_joins_only_once_admitted(url: str) -> None:
    """Issue 30, items 8 and 26: a removed node's renewals are refused by the statement, its
    join is refused naming the command, and it may not take the controller lease."""
    store = _open(url)
    _join(store, "n1")
    assert store.set_flags("n1", by="op", cordoned=True) is not None
    _join(store, "n1")
    assert store.snapshot().nodes[0].cordoned is True
    assert store.set_flags("n1", by="op", left=True) is not None
    before = store.snapshot().nodes[0].renewed_at_ms
    renewed = store.renew("n1", replicas={})
    assert renewed is not None and renewed.left and not renewed.renewed
    assert store.snapshot().nodes[0].renewed_at_ms == before
    assert store.hold_controller("n1", lease_ms=LEASE_MS) is None
    with pytest.raises(NodeRemoved) as refused:
        _join(store, "n1")
    assert refused.value.code == "node_removed"
    assert "sbproxy nodes admit n1" in (refused.value.remediation or "")
    assert store.set_flags("n1", by="op", left=False) is not None  # nodes admit
    _join(store, "n1")
    node = store.snapshot().nodes[0]
    assert (node.cordoned, node.left, node.state) == (False, False, "lost")
    assert store.set_flags("nobody", by="op", cordoned=True) is None


def test_a_second_live_instance_of_one_node_id_is_refused_and_holds_nothing(url: str) -> None:
    """Issue 30, items 12 and 17: two processes with one node id (a copied cache) never
    share a membership or the controller lease."""
    first, twin = _open(url), _open(url)
    _join(first, "n1", instance="first")
    assert first.hold_controller("n1", lease_ms=LEASE_MS, instance="first") is not None
    with pytest.raises(NodeIdInUse) as refused:
        _join(twin, "n1", instance="twin", live_within_ms=60_000)
    assert refused.value.code == "node_id_in_use"
    renewal = twin.renew("n1", replicas={}, instance="twin")
    assert renewal is not None and renewal.held_elsewhere and not renewal.renewed
    assert twin.hold_controller("n1", lease_ms=LEASE_MS, instance="twin") is None
    # The holder's renewal standing still (a dead process) lets the new one take over;
    # the old instance then renews nothing and holds no lease.
    held = first.snapshot().nodes[0].renewed_at_ms
    _join(twin, "n1", instance="twin", live_within_ms=60_000, take_over=held)
    stale = first.renew("n1", replicas={}, instance="first")
    assert stale is not None and stale.held_elsewhere
    assert first.hold_controller("n1", lease_ms=LEASE_MS, instance="first") is None
    # A graceful leave releases the id: a restart takes it at once.
    assert twin.leave("n1", instance="twin")
    _join(first, "n1", instance="again", live_within_ms=60_000)


def test_a_restarted_node_reports_no_replica_until_it_renews(url: str) -> None:
    """A process that joins under a known id (a restart within the grace) runs nothing yet:
    its predecessor's replica report (ready engines, gone with it) is cleared, so no gateway
    routes to it before its own renewal says what runs (seen from outside: a 502 from a
    peer that routed to the restarting host's closed port)."""
    store = _open(url)
    _join(store, "n1", instance="first")
    assert store.renew("n1", replicas={"chat": {"state": "ready", "port": 1}}, instance="first")
    (before,) = store.snapshot().nodes
    assert before.replicas == {"chat": {"state": "ready", "port": 1}}
    assert store.leave("n1", instance="first")
    _join(store, "n1", instance="second", live_within_ms=60_000)
    (after,) = store.snapshot().nodes
    assert after.replicas == {}


def _wait_for_a_lock_wait(url: str, timeout_s: float = 10) -> None:
    """Return once some session of the database waits on a lock."""
    with psycopg.connect(url, autocommit=True) as watcher:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            waiting = watcher.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            if waiting is not None and waiting[0]:
                return
        raise AssertionError("no session waited on a lock")


def test_a_leave_is_marked_after_a_renewal_that_committed_while_it_waited(url: str) -> None:
    """A renewal in flight when the node leaves (it holds the row) commits first; the leave
    mark must not land before it, or the node would count as running (not leaving) until
    lost_after_ms (seen in CI: re-placed after 10.4 s, not after the 0.6 s grace)."""
    store = _open(url)
    _join(store, "n1", instance="me")
    with psycopg.connect(url, autocommit=False) as renewing:
        # A renewal's transaction, holding the row, whose clock reads later than any the
        # leave could have read before it got the row.
        renewing.execute(
            "UPDATE fleet_nodes SET renewed_at_ms = renewed_at_ms + 60000 WHERE id = 'n1'"
        )
        left: list[bool] = []
        leaving = threading.Thread(target=lambda: left.append(store.leave("n1", instance="me")))
        leaving.start()
        _wait_for_a_lock_wait(url)  # the leave is blocked on the row the renewal holds
        assert leaving.is_alive()
        renewing.commit()
        leaving.join(timeout=10)
    assert left == [True]
    (node,) = store.snapshot().nodes
    assert node.leaving_at_ms is not None
    assert node.leaving_at_ms >= node.renewed_at_ms


def test_a_leaving_controller_ends_its_lease_so_another_member_takes_it_at_once(
    url: str,
) -> None:
    """A graceful stop of the controller ends its lease in the leave's transaction: another
    member takes it at its next beat, not after fence_after_ms (seen from outside: the
    stopped controller's replica re-placed after fence_after_ms + rejoin_grace_ms)."""
    store = _open(url)
    _join(store, "n1", instance="a")
    _join(store, "n2", instance="b")
    lease = store.hold_controller("n1", lease_ms=600_000, instance="a")
    assert lease is not None
    assert store.hold_controller("n2", lease_ms=600_000, instance="b") is None  # held
    assert store.leave("n1", instance="a")
    taken = store.hold_controller("n2", lease_ms=600_000, instance="b")
    assert taken is not None and taken.fresh and taken.epoch == lease.epoch + 1
    with pytest.raises(Deposed):
        store.move_node(lease, "n2", from_state="ready", to="suspect")
    kinds = [event["type"] for event in store.snapshot(events=10).events]
    assert "controller_released" in kinds, kinds
    # A member that leaves without holding the lease ends nobody's.
    _join(store, "n3", instance="c")
    assert store.leave("n3", instance="c")
    assert store.move_node(taken, "n3", from_state="ready", to="suspect")  # still n2's


def test_a_node_declared_lost_loses_its_placements_with_the_move(url: str) -> None:
    """Issue 30, item 3: lost means over -- the placements end in the move's transaction."""
    store = _open(url)
    _join(store, "n1")
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    placement, _ = store.place(lease, _decision("n1"), definition={"model": "m"})
    assert store.move_node(lease, "n1", from_state="ready", to="lost")
    (row,) = store.snapshot().placements
    assert (row.id, row.state) == (placement, "stopping")
    assert store.placement_stopped("n1", placement)


def test_a_stuck_placement_s_move_stops_it_in_the_same_transaction(url: str) -> None:
    """Issue 30, item 20: one fenced transaction places the replacement and stops the
    stuck placement."""
    store = _open(url)
    _join(store, "n1")
    _join(store, "n2")
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    stuck, _ = store.place(lease, _decision("n1"), definition={"model": "m"})
    move = {**_decision("n2"), "kind": "replace", "replaces": stuck, "from_node": "n1"}
    moved, _ = store.place(
        lease, {**move, "cause": "placement_timeout"}, definition={"model": "m"}, avoid_ms=1_000
    )
    states = {p.id: p.state for p in store.snapshot().placements}
    assert states == {stuck: "stopping", moved: "pending"}


def test_a_split_placement_keeps_its_workers_and_a_whole_one_has_none(url: str) -> None:
    store = _open(url)
    _join(store, "n1")
    _join(store, "n2")
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    workers = [
        {"node": "n1", "devices": [0], "reserved_bytes": 70},
        {"node": "n2", "devices": [1], "reserved_bytes": 60},
    ]
    split, _ = store.place(
        lease, {**_decision("n1"), "workers": workers}, definition={"model": "m"}
    )
    whole, _ = store.place(lease, _decision("n2", replica=1), definition={"model": "m"})
    rows = {p.id: p for p in store.snapshot().placements}
    assert list(rows[split].workers) == workers
    assert rows[split].to_dict()["workers"] == workers
    assert rows[whole].workers == ()


def test_one_controller_at_a_time_and_the_epoch_grows_with_each_holder(url: str) -> None:
    a, b = _open(url), _open(url)
    first = a.hold_controller("a", lease_ms=LEASE_MS)
    assert first is not None and first.fresh and first.epoch == 1
    assert b.hold_controller("b", lease_ms=LEASE_MS) is None
    again = a.hold_controller("a", lease_ms=LEASE_MS)
    assert again is not None and not again.fresh and again.epoch == 1
    # The lease lapses on database time (a 1 ms lease): b takes it under epoch 2.
    assert a.hold_controller("a", lease_ms=1) is not None
    with psycopg.connect(url) as connection:
        connection.execute("SELECT pg_sleep(0.01)")
    taken = b.hold_controller("b", lease_ms=LEASE_MS)
    assert taken is not None and taken.fresh and taken.epoch == 2


def test_a_deposed_controller_s_writes_are_refused_by_the_database(url: str) -> None:
    a, b = _open(url), _open(url)
    _join(a, "n1")
    old = a.hold_controller("a", lease_ms=1)
    assert old is not None
    with psycopg.connect(url) as connection:
        connection.execute("SELECT pg_sleep(0.01)")
    new = b.hold_controller("b", lease_ms=LEASE_MS)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(Deposed) as refused:
        a.place(old, _decision("n1"), definition={"model": "m"})
    assert refused.value.code == "controller_deposed"
    with pytest.raises(Deposed):
        a.move_node(old, "n1", from_state="ready", to="suspect")
    placement, job = b.place(new, _decision("n1"), definition={"model": "m"})
    snapshot = b.snapshot()
    assert [(p.id, p.epoch, p.job_id) for p in snapshot.placements] == [(placement, 2, job)]
    with pytest.raises(Deposed):
        a.stop_placement(old, placement, cause="rollout")
    with psycopg.connect(url) as connection:
        kinds = connection.execute("SELECT kind, status, node FROM jobs").fetchall()
    assert kinds == [("fleet.place", "succeeded", "b")]


def test_a_take_over_waits_for_the_old_holder_s_write_in_flight(url: str) -> None:
    """The fence is a row lock: a take-over that starts while the old holder's write is
    open commits after it, so the write is never half-fenced."""
    a, b = _open(url), _open(url)
    _join(a, "n1")
    old = a.hold_controller("a", lease_ms=2_000)
    assert old is not None
    with psycopg.connect(url) as holder:
        with holder.transaction():
            holder.execute("SELECT epoch FROM fleet_controller WHERE id = 1 FOR SHARE")
            taken: list[object] = []
            thread = threading.Thread(
                target=lambda: taken.append(b.hold_controller("b", lease_ms=1))
            )
            thread.start()
            thread.join(timeout=0.5)
            assert thread.is_alive()  # blocked on the row lock
        thread.join(timeout=10)
    assert taken == [None]  # a's lease had not lapsed yet


def test_node_side_placement_moves_are_the_named_node_s_only(url: str) -> None:
    store = _open(url)
    _join(store, "n1")
    lease = store.hold_controller("c", lease_ms=LEASE_MS)
    assert lease is not None
    placement, _ = store.place(lease, _decision("n1"), definition={"model": "m"})
    assert store.placement_ready("n2", placement) is False
    assert store.placement_ready("n1", placement) is True
    assert store.placement_stopped("n1", placement) is False  # not stopping yet
    assert store.stop_placement(lease, placement, cause="scale_down") is True
    assert store.placement_stopped("n1", placement) is True
    assert store.snapshot().placements == ()


def test_an_unreachable_server_is_journal_unavailable() -> None:
    store = Store("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(JournalUnavailable):
        store.snapshot()
    store.close()


FACTS = {
    "architecture": "llama",
    "version": 3,
    "tensor_count": 10,
    "block_count": 4,
    "head_count": 8,
    "head_count_kv": 2,
    "key_length": 64,
    "value_length": 64,
    "embedding_length": 512,
    "context_length": 4096,
}


def test_a_node_reports_every_device_and_its_gguf_facts_with_membership(url: str) -> None:
    store = _open(url)
    gpus = [{"index": 0, "capacity_bytes": 80 << 30}, {"index": 1, "capacity_bytes": 40 << 30}]
    store.join(
        "n1",
        advertise_url=None,
        labels={},
        engines=["llama_cpp"],
        devices=gpus,
        artifacts=["d1"],
        artifact_facts={"d1": FACTS},
    )
    (node,) = store.snapshot().nodes
    assert node.devices == gpus
    assert node.artifact_facts == {"d1": FACTS}
    assert node.to_dict()["artifact_facts"] == {"d1": FACTS}
    # A renewal without facts keeps the reported ones; with facts, replaces them.
    store.renew("n1", replicas={}, artifacts=["d1"])
    assert store.snapshot().nodes[0].artifact_facts == {"d1": FACTS}
    store.renew("n1", replicas={}, artifacts=["d1", "d2"], artifact_facts={"d2": FACTS})
    assert store.snapshot().nodes[0].artifact_facts == {"d2": FACTS}


def test_a_placement_keeps_its_variant_and_estimate_basis(url: str) -> None:
    store = _open(url)
    _join(store, "n1")
    lease = store.hold_controller("n1", lease_ms=LEASE_MS)
    assert lease is not None
    decision = {**_decision("n1"), "variant": "q4_k_m", "estimate_basis": "gguf_header"}
    placement_id, _ = store.place(lease, decision, definition={"model": "m"})
    (placement,) = store.snapshot().placements
    assert (placement.id, placement.variant, placement.estimate_basis) == (
        placement_id,
        "q4_k_m",
        "gguf_header",
    )
    assert placement.to_dict()["estimate_basis"] == "gguf_header"


def test_a_stuck_re_placement_records_the_avoided_node_until_its_cooldown(url: str) -> None:
    store = _open(url)
    _join(store, "n1")
    _join(store, "n2")
    lease = store.hold_controller("n1", lease_ms=LEASE_MS)
    assert lease is not None
    stuck, _ = store.place(lease, _decision("n1"), definition={"model": "m"})
    replace = {
        **_decision("n2"),
        "kind": "replace",
        "replaces": stuck,
        "from_node": "n1",
        "cause": "crash_loop",
    }
    store.place(lease, replace, definition={"model": "m"}, avoid_ms=LEASE_MS)
    snapshot = store.snapshot(events=5)
    (avoid,) = snapshot.avoids
    assert (avoid.deployment, avoid.node, avoid.reason, avoid.placement) == (
        "chat",
        "n1",
        "crash_loop",
        stuck,
    )
    assert LEASE_MS - 5_000 < avoid.until_ms - snapshot.now_ms <= LEASE_MS
    kinds = [event["type"] for event in snapshot.events]
    assert "stuck_replaced" in kinds
    # A re-placement from a gone node avoids nothing; an expired avoidance is not shown.
    gone = {**replace, "replaces": "p-gone", "cause": "node_gone", "from_node": "n3"}
    store.place(lease, gone, definition={"model": "m"}, avoid_ms=LEASE_MS)
    again = {**replace, "replaces": "p-x", "from_node": "n2", "cause": "placement_timeout"}
    store.place(lease, again, definition={"model": "m"}, avoid_ms=0)
    assert [(a.node, a.reason) for a in store.snapshot().avoids] == [("n1", "crash_loop")]


def test_a_deposed_controller_records_no_avoidance(url: str) -> None:
    store = _open(url)
    _join(store, "n1")
    lease = store.hold_controller("n1", lease_ms=LEASE_MS)
    assert lease is not None
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute("UPDATE fleet_controller SET epoch = epoch + 1")
    replace = {**_decision("n1"), "replaces": "p0", "from_node": "n2", "cause": "load_failed"}
    with pytest.raises(Deposed):
        store.place(lease, replace, definition={"model": "m"}, avoid_ms=LEASE_MS)
    assert store.snapshot().avoids == ()


def test_the_controller_prunes_old_fleet_events_keeping_the_newest(url: str) -> None:
    """Issue 30, item 27: fleet events are pruned by age beyond a count, on database time."""
    store = _open(url)
    for node in ("n1", "n2", "n3", "n4"):
        _join(store, node)  # a node_joined event each
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    with psycopg.connect(url) as connection:
        connection.execute("UPDATE fleet_events SET at_ms = at_ms - 1000000")
    assert store.prune_events(lease, keep_ms=1_000, keep=2) == 3  # 5 old, newest 2 kept
    kept = [e["type"] for e in store.snapshot(events=10).events]
    assert len(kept) == 2
    assert store.prune_events(lease, keep_ms=10_000_000, keep=0) == 0  # none that old
