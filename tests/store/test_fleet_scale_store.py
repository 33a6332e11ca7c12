"""The autoscaler's records on a real PostgreSQL server: a ``fleet.scale`` decision is a
fenced job with its figures and a compare-and-set on the count it changes; a deposed
controller's decision is refused; a gateway's demand is one row however often it asks, and
the decision consumes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from sbproxy.store.fleet import Deposed, FleetStore
from sbproxy.store.fleet_scale import record_demand, record_scale
from tests.support.postgres import PostgresServer

LEASE_MS = 60_000


def _decision(was: int, now: int, reason: str = "above_target") -> dict[str, Any]:
    return {
        "deployment": "chat",
        "from_replicas": was,
        "to_replicas": now,
        "reason": reason,
        "direction": "up" if now > was else "down",
        "message": "why",
        "figures": {"stable_in_flight": 5.0, "replicas": was},
    }


@pytest.fixture
def store(postgres_server: PostgresServer) -> Iterator[FleetStore]:
    opened = FleetStore(postgres_server.create_database())
    yield opened
    opened.close()


def _jobs(store: FleetStore) -> list[tuple[str, str, dict[str, Any]]]:
    with psycopg.connect(store.target.conninfo) as connection:
        rows = connection.execute(
            "SELECT kind, node, input_json FROM jobs ORDER BY created_at_ms, id"
        ).fetchall()
    return [(str(k), str(n), json.loads(str(i))) for k, n, i in rows]


def test_a_decision_is_a_fenced_job_with_its_figures_and_sets_the_count(
    store: FleetStore,
) -> None:
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    job = record_scale(store, lease, _decision(1, 3))
    assert job is not None
    (row,) = store.snapshot().scales
    assert (row.deployment, row.replicas, row.reason, row.epoch, row.job_id) == (
        "chat", 3, "above_target", lease.epoch, job,
    )  # fmt: skip
    ((kind, node, body),) = _jobs(store)
    assert (kind, node) == ("fleet.scale", "ctl")
    assert body["figures"]["stable_in_flight"] == 5.0 and body["epoch"] == lease.epoch
    events = store.snapshot(events=5).events
    assert events[0]["type"] == "scaled" and events[0]["data"]["to"] == 3


def test_a_decision_from_a_stale_count_is_not_applied(store: FleetStore) -> None:
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    assert record_scale(store, lease, _decision(1, 2)) is not None
    assert record_scale(store, lease, _decision(1, 3)) is None  # the count is 2 now
    assert [r.replicas for r in store.snapshot().scales] == [2]
    assert len(_jobs(store)) == 1


def test_a_deposed_controller_s_decision_is_refused(store: FleetStore) -> None:
    old = store.hold_controller("a", lease_ms=1)
    assert old is not None
    with psycopg.connect(store.target.conninfo) as connection:
        connection.execute("SELECT pg_sleep(0.01)")
    new = store.hold_controller("b", lease_ms=LEASE_MS)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(Deposed) as refused:
        record_scale(store, old, _decision(1, 2))
    assert refused.value.code == "controller_deposed"
    assert store.snapshot().scales == () and _jobs(store) == []


def test_demand_is_one_row_and_the_decision_consumes_it(store: FleetStore) -> None:
    assert record_demand(store, "chat", node="gw-1") is True
    assert record_demand(store, "chat", node="gw-2") is False
    (demand,) = store.snapshot().demands
    assert (demand.deployment, demand.node) == ("chat", "gw-1")
    lease = store.hold_controller("ctl", lease_ms=LEASE_MS)
    assert lease is not None
    assert record_scale(store, lease, _decision(0, 1, "demand")) is not None
    assert store.snapshot().demands == ()
    # A gateway that still saw zero replicas asks once more: the count is one already, so
    # nothing is left behind to wake the deployment when it next goes idle.
    assert record_demand(store, "chat", node="gw-2") is False
    assert store.snapshot().demands == ()
    assert record_scale(store, lease, _decision(1, 0, "idle")) is not None
    assert record_demand(store, "chat", node="gw-2") is True
