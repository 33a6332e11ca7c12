"""The fleet under the faults of issue 30, with real ``sbproxy serve`` hosts on one real
PostgreSQL and the stand-in engine: a database outage for everyone fences nobody; a paused
host that comes back after it was declared lost gets nothing back over its healthy
replacement; a graceful stop is re-placed after ``rejoin_grace_ms``, not ``lost_after_ms``;
a cordoned node that dies shows its replica unreachable at once; a new controller places no
replica on the silent host it took the lease from. Fleet timing is short (heartbeat 200 ms,
fence 1.5 s, lost 3 s); every bound is stated where it is checked, and the times measured are
printed."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sbproxy.store.fleet import FleetStore
from tests.api.cluster_hosts import (
    FENCE_AFTER_MS,
    HEARTBEAT_MS,
    LOST_AFTER_MS,
    FleetHost,
    placements,
    ready_nodes,
)
from tests.api.pg_hosts import poll, query
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.model_host.engines.support import fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer, postgres_bin_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@contextmanager
def _replica_on_node_a(
    tmp_path: Path, url: str, mirror: HfMirror
) -> Iterator[tuple[FleetHost, FleetHost]]:
    """node-a and node-b of one fleet, with the one replica of ``tiny`` ready on node-a;
    both stopped after."""
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    try:
        start_all([a, b])
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
        yield a, b
    finally:
        stop_all([a, b])


def _runtime(host: FleetHost) -> dict[str, Any]:
    """``{node: runtime state}`` of the ``tiny`` placements as ``host`` shows them."""
    return {
        p["node"]: (p["node_state"], (p.get("runtime") or {}).get("state"))
        for p in placements(host)
        if p["deployment"] == "tiny"
    }


def test_a_database_outage_for_everyone_fences_no_host(tmp_path: Path, mirror: HfMirror) -> None:
    """Item 0: three hosts with a replica each, PostgreSQL stopped. Past fence_after_ms and
    lost_after_ms twice, every engine still runs and every gateway answers; nothing is
    re-placed when the database is back."""
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None
    server = PostgresServer(bin_dir)
    server.start()
    url = server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "abc"]
    try:
        start_all(hosts)
        apply(hosts[0], {"tiny": {**TINY, "replicas": 3}})
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 3, timeout_s=90, what="3 replicas")
        before = sorted((p["id"], p["node"]) for p in placements(hosts[0]))
        engines = {host.node: host.engines() for host in hosts}
        assert all(len(found) == 1 for found in engines.values()), engines
        server.stop_server("fast")
        deadline = time.monotonic() + 2 * LOST_AFTER_MS / 1000 + FENCE_AFTER_MS / 1000
        while time.monotonic() < deadline:
            for host in hosts:
                answer = host.chat()
                assert answer.status_code == 200, f"{host.node}: {answer.text}"
                assert all(e.is_running() for e in engines[host.node]), host.output[-4000:]
        for host in hosts:
            assert "fenced itself" not in host.output, host.output[-4000:]
        server.start_server()
        poll(lambda: bool(placements(hosts[0])), timeout_s=30, what="the journal back")
        after = sorted((p["id"], p["node"]) for p in placements(hosts[0]))
        assert after == before  # nothing re-placed
    finally:
        stop_all(hosts)
        server.stop()


def test_a_paused_host_declared_lost_gets_nothing_back_over_its_replacement(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Items 3 and 21, and the engine guard: node-a is paused (SIGSTOP); its engine is
    killed within fence_after_ms by the guard (a paused host cannot fence itself); once the
    fleet declared node-a lost and placed the replica on node-b, node-a resumes at once,
    before the replacement is ready. It gets no placement back, runs no engine, and the
    replacement is never stopped as a 'duplicate'."""
    url = postgres_server.create_database()
    with _replica_on_node_a(tmp_path, url, mirror) as (a, b):
        (old,) = [p["id"] for p in placements(b)]
        a.pause()
        paused = time.monotonic()
        try:
            poll(lambda: a.engines() == [], timeout_s=FENCE_AFTER_MS / 1000 + 3, what="guard")
            guarded_s = time.monotonic() - paused
            poll(
                lambda: any(p["node"] == "node-b" for p in placements(b)),
                timeout_s=60,
                what="the replacement placed on node-b",
            )
        finally:
            a.resume()
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=60, what="ready on node-b")
        (replacement,) = [p["id"] for p in placements(b) if p["node"] == "node-b"]
        # Long enough for node-a to rejoin and reconcile several times over.
        settle = time.monotonic() + 3 * LOST_AFTER_MS / 1000
        while time.monotonic() < settle:
            assert ready_nodes(b, "tiny") == ["node-b"]
            assert a.engines() == [], "node-a started its old replica again"
        assert [p["id"] for p in placements(b)] == [replacement]
        assert old != replacement
        stops = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stopping'")
        assert not [r for r in stops if "duplicate" in str(r[0])], stops
        assert len(b.engines()) == 1 and b.chat().status_code == 200
        print(f"SIGSTOP -> node-a's engine killed by its guard: {guarded_s:.2f} s")


def test_a_graceful_stop_is_re_placed_after_the_rejoin_grace_not_lost_after(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Item 5: SIGTERM of the host with the replica marks it leaving (out of rotation at
    once); the replica is re-placed after rejoin_grace_ms, well before lost_after_ms. Its
    engine ignores SIGTERM, so the stop lasts many heartbeats: the stopping host neither
    renews nor joins again meanwhile (its id is released; a join would undo the leave), and
    its engine is stopped when the grace ends, when the replacement may start."""
    url = postgres_server.create_database()
    grace_ms = 3_000
    timing = {
        "heartbeat_ms": HEARTBEAT_MS,
        "fence_after_ms": FENCE_AFTER_MS,
        "lost_after_ms": LOST_AFTER_MS * 3,  # 9 s: far from the grace
        "rejoin_grace_ms": grace_ms,
    }
    # A stop of node-a may wait 8 s for its engine, which only SIGKILL ends.
    slow_stop = {"shutdown_deadline_ms": 8_000}
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, timing=timing, settings=slow_stop)
    fake_llama_server(a.root / "bin", mode="ignore_sigterm")
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url, timing=timing)
    hosts = [a, b]
    try:
        # node-a is the controller too: its leave ends the lease for node-b to take at once.
        start_all([a])
        poll(lambda: _controller(url) == "node-a", timeout_s=30, what="node-a controls")
        b.start()
        poll(lambda: len(a.fleet("nodes")["nodes"]) == 2, timeout_s=90, what="node-b joined")
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
        stopping = time.monotonic()
        a.stop()
        stopped_s = time.monotonic() - stopping
        rows = query(url, "SELECT at_ms FROM fleet_events WHERE type = 'node_leaving'")
        assert len(rows) == 1, rows
        leaving_at = int(rows[0][0])
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=30, what="on node-b")
        (lost_at,) = query(
            url,
            "SELECT at_ms FROM fleet_events WHERE type = 'node_state' AND subject = 'node-a'"
            ' AND data_json LIKE \'%"to": "lost"%\'',
        )
        waited_ms = int(lost_at[0]) - leaving_at
        assert grace_ms <= waited_ms < LOST_AFTER_MS * 3 - 1_000, (waited_ms, a.output)
        states = query(
            url,
            "SELECT data_json FROM fleet_events WHERE type = 'node_state' AND subject = 'node-a'",
        )
        assert any('"to": "leaving"' in str(r[0]) for r in states), states
        assert "held by another sbproxy process" not in a.output, a.output
        (released,) = query(
            url, "SELECT at_ms FROM fleet_events WHERE type = 'controller_released'"
        )
        elected = query(
            url,
            "SELECT at_ms FROM fleet_events WHERE type = 'controller_elected'"
            " AND subject = 'node-b'",
        )
        # Taken at node-b's next beats, not after fence_after_ms.
        assert elected and int(elected[0][0]) - int(released[0]) < FENCE_AFTER_MS - 500, elected
        # A clean hand-over worries nobody: the new controller warns of no node going
        # suspect (itself included) and of no graceful leave.
        warned = [
            line
            for line in b.output.splitlines()
            if " WARNING " in line and ("'to': 'suspect'" in line or "'to': 'leaving'" in line)
        ]
        assert not warned, warned
        assert "leaving grace (3000 ms) is over" in a.output, a.output
        assert stopped_s < 8.0, stopped_s  # the engine stopped at the grace's end
        print(
            f"SIGTERM -> re-placed (node-a lost) after {waited_ms} ms (grace {grace_ms} ms);"
            f" node-a stopped in {stopped_s:.1f} s"
        )
    finally:
        stop_all(hosts)


def test_a_graceful_stop_leaves_the_rotation_at_once_while_its_requests_drain(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Item 5: the leaving mark comes with the signal, not after the drain: node-a is out of
    every gateway's rotation while a request in flight still runs there, and that request
    completes."""
    url = postgres_server.create_database()
    timing = {
        "heartbeat_ms": HEARTBEAT_MS,
        "fence_after_ms": FENCE_AFTER_MS,
        "lost_after_ms": LOST_AFTER_MS * 3,
        "rejoin_grace_ms": LOST_AFTER_MS * 2,  # 6 s: longer than the 3 s request
    }
    drain = {"shutdown_deadline_ms": 8_000}  # time for the request to end
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, timing=timing, settings=drain)
    requests = tmp_path / "node-a-requests.jsonl"
    fake_llama_server(a.root / "bin", mode=f"reply_delay_s=3,requests_log={requests}")
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url, timing=timing)
    hosts = [a, b]
    try:
        start_all(hosts)
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
        answers: list[int] = []
        inflight = threading.Thread(target=lambda: answers.append(a.chat().status_code))
        inflight.start()
        poll(requests.exists, timeout_s=30, what="node-a's engine has the request")
        assert a.process is not None
        a.process.send_signal(signal.SIGTERM)
        poll(
            lambda: bool(query(url, "SELECT 1 FROM fleet_events WHERE type = 'node_leaving'")),
            timeout_s=10,
            what="node-a marked leaving",
        )
        assert inflight.is_alive() and not answers  # marked while the request drains
        inflight.join(30)
        assert answers == [200], answers
        assert a.stop() == 0, a.output
    finally:
        stop_all(hosts)


def _controller(url: str) -> str | None:
    rows = query(url, "SELECT holder FROM fleet_controller WHERE id = 1")
    return str(rows[0][0]) if rows else None


def test_a_cordoned_node_that_dies_shows_its_replica_unreachable_at_once(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Items 6 and 7: a cordoned node that stops renewing is suspect (not cordoned, not
    ready) and its replica unreachable well before lost_after_ms; the node listing shows the
    controller's one state with the heartbeat age beside it."""
    url = postgres_server.create_database()
    with _replica_on_node_a(tmp_path, url, mirror) as (a, b):
        assert json.loads(cli(b, "nodes", "cordon", "node-a").stdout)["job_id"]
        poll(lambda: _runtime(b).get("node-a", ("",))[0] == "cordoned", timeout_s=10, what="c")
        a.kill()
        killed = time.monotonic()
        poll(
            lambda: _runtime(b).get("node-a") == ("suspect", "unreachable"),
            timeout_s=LOST_AFTER_MS / 1000,
            what="node-a's replica unreachable before lost_after_ms",
        )
        shown_s = time.monotonic() - killed
        (row,) = [n for n in b.fleet("nodes")["nodes"] if n["id"] == "node-a"]
        assert row["state"] == "suspect" and row["cordoned"] is True
        assert row["heartbeat_age_ms"] >= HEARTBEAT_MS
        assert "recorded_state" not in row  # one state, the controller's
        print(f"SIGKILL of a cordoned node -> replica shown unreachable: {shown_s:.2f} s")


def test_a_new_controller_places_nothing_on_the_silent_host_it_took_the_lease_from(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Item 4: the controller (node-a, holding no replica) is killed and a second replica is
    asked for at once: the new controller must not count the silent node-a eligible during
    its take-over wait; the replica lands on node-c."""
    url = postgres_server.create_database()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url, labels={"role": "serve"})
    c = FleetHost("node-c", tmp_path / "node-c", url, mirror.url, labels={"role": "serve"})
    hosts = [a, b, c]
    try:
        a.start()
        poll(
            lambda: (a.fleet("controller").get("controller") or {}).get("holder") == "node-a",
            timeout_s=60,
            what="node-a the controller",
        )
        b.start()
        c.start()
        # node-b's own admin API answers too: the apply goes through it, and node-a may list
        # node-b before node-b's admin listener is up.
        poll(
            lambda: all(len(h.fleet("nodes").get("nodes", [])) == 3 for h in (a, b)),
            timeout_s=60,
            what="3 nodes",
        )
        apply(b, {"tiny": {**TINY, "required_labels": {"role": "serve"}}})
        poll(lambda: len(ready_nodes(b, "tiny")) == 1, timeout_s=60, what="one replica")
        (first,) = ready_nodes(b, "tiny")
        other = "node-c" if first == "node-b" else "node-b"
        a.kill()
        # Two replicas, now without the label: node-a would be the emptiest node.
        apply(b, {"tiny": {**TINY, "replicas": 2}})
        poll(lambda: len(ready_nodes(b, "tiny")) == 2, timeout_s=60, what="two replicas")
        assert ready_nodes(b, "tiny") == sorted([first, other])
        placed = query(
            url, "SELECT data_json FROM fleet_events WHERE type IN ('placed', 'replaced')"
        )
        assert [json.loads(str(r[0]))["node"] for r in placed].count("node-a") == 0, placed
    finally:
        stop_all(hosts)


def test_a_replica_shown_ready_is_routable_through_every_gateway_at_once(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Item 11: with a one-second heartbeat, a replica that becomes ready on node-a is
    routed by node-b's gateway within a fraction of that heartbeat of being shown ready
    (the routing table follows LISTEN/NOTIFY; the heartbeat is only the fallback)."""
    url = postgres_server.create_database()
    timing = {
        "heartbeat_ms": 1_000,
        "fence_after_ms": 3_000,
        "lost_after_ms": 8_000,
        "rejoin_grace_ms": 8_000,
    }
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, labels={"role": "serve"})
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url, timing=timing)
    a.timing = timing
    hosts = [a, b]
    try:
        start_all(hosts)
        apply(b, {"tiny": {**TINY, "required_labels": {"role": "serve"}}})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="ready on node-a")
        shown = time.monotonic()
        while (answer := b.chat()).status_code != 200:
            assert answer.json()["error"]["code"] == "no_ready_replica", answer.text
            assert time.monotonic() - shown < 0.4, "node-b's gateway did not route it yet"
        routed_ms = (time.monotonic() - shown) * 1000
        assert answer.headers.get("x-sbproxy-peer-node") == "node-a"
        print(f"shown ready -> routed through another gateway: {routed_ms:.0f} ms")
    finally:
        stop_all(hosts)


def test_a_loopback_advertise_url_is_refused_when_a_member_is_on_another_machine(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Item 18: a host that would advertise a loopback address to a fleet with a member on
    another machine is refused at start (exit 2, naming the setting): its peers could not
    reach it, and its own fence ask would reach its own gateway."""
    url = postgres_server.create_database()
    remote = FleetStore(url)
    remote.join(
        "remote-1",
        advertise_url="http://10.20.30.40:8080",
        labels={},
        engines=["llama_cpp"],
        devices=[],
        artifacts=[],
        instance="elsewhere",
    )
    # The remote member stays live (it renews) however long the host takes to start.
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(HEARTBEAT_MS / 1000):
            remote.renew("remote-1", replicas={}, instance="elsewhere")

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    try:
        a.start()
        assert a.process is not None
        assert a.process.wait(timeout=60) == 2
        assert "invalid_advertise_url" in a.output
        assert "proxy.model_host.node.advertise_url" in a.output
    finally:
        stop.set()
        renewer.join(timeout=5)
        remote.close()
        a.stop()


def test_a_running_node_removed_stops_its_engines_and_serves_again_once_admitted(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """Items 8 and 26: a node removed while it runs stops its engine, renews nothing and
    takes no controller lease; its replica is re-placed. Admitted again, it renews and is
    ready (and takes new replicas); the moved replica stays where it went."""
    url = postgres_server.create_database()
    with _replica_on_node_a(tmp_path, url, mirror) as (a, b):
        assert json.loads(cli(b, "nodes", "remove", "node-a").stdout)["job_id"]
        poll(lambda: a.engines() == [], timeout_s=10, what="node-a stopped its engine")
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=60, what="moved to b")
        assert "sbproxy nodes admit node-a" in a.output
        (renewed,) = query(url, "SELECT renewed_at_ms FROM fleet_nodes WHERE id = 'node-a'")
        holder = b.fleet("controller")["controller"]["holder"]
        assert holder == "node-b"
        assert json.loads(cli(b, "nodes", "admit", "node-a").stdout)["job_id"]
        poll(
            lambda: (
                {n["id"]: n["state"] for n in b.fleet("nodes")["nodes"]}.get("node-a") == "ready"
            ),
            timeout_s=30,
            what="node-a ready again",
        )
        (again,) = query(url, "SELECT renewed_at_ms FROM fleet_nodes WHERE id = 'node-a'")
        assert again[0] > renewed[0]
        assert ready_nodes(b, "tiny") == ["node-b"]
        assert a.chat().status_code == 200  # through its peer
