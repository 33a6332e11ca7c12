"""Real ``sbproxy serve`` hosts as one fleet (issue 20): ``authority: cluster_authority`` on
one real PostgreSQL journal, the stand-in llama-server, an HF-shaped mirror.

A two-replica deployment applied with ``sbproxy apply`` lands on two of three nodes; a
SIGKILLed replica host's replica is re-placed once, on the third; a host cut off from the
database (a TCP relay cut) fences itself -- kills its engines -- before the fleet re-places
its replica, and rejoins with no orphan; the database down for everyone keeps every host
serving; drain moves a replica, cordon keeps it; every host restarted at once serves its
placements again with no re-pull. Fleet timing is short (heartbeat 200 ms, fence 1.5 s,
lost 3 s); bounds are stated per test.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.cluster_hosts import (
    CREDENTIAL,
    LOST_AFTER_MS,
    FleetHost,
    placements,
    ready_nodes,
)
from tests.api.pg_hosts import PASSWORD, poll, query
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer, postgres_bin_dir
from tests.support.tcp_relay import TcpRelay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TINY = {"model": "tiny", "variant": "q4_k_m"}


def cli(host: FleetHost, *args: str) -> subprocess.CompletedProcess[str]:
    """``sbproxy <args> --format json`` against ``host``'s admin API."""
    return subprocess.run(
        [sys.executable, "-m", "sbproxy.cli", *args, "--admin-url",
         f"http://127.0.0.1:{host.admin}", "--password", PASSWORD, "--format", "json"],
        env=host.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def apply(host: FleetHost, deployments: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write ``deployments`` into ``host``'s sb.yml and ``sbproxy apply`` it."""
    host.write(deployments)
    done = cli(host, "apply", "-f", str(host.config))
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def start_all(hosts: Sequence[FleetHost], *, fault: str | None = None) -> None:
    """Start ``hosts`` (``fault`` armed on the first) and wait until each joined; a host that
    exits fails at once with its stderr."""
    for host in hosts:
        host.start(fault=fault if host is hosts[0] else None)

    def joined() -> bool:
        for host in hosts:
            if not host.alive():
                raise AssertionError(f"{host.node} exited: {host.output[-4000:]}")
        return len(hosts[0].fleet("nodes").get("nodes", [])) == len(hosts)

    poll(joined, timeout_s=90, what="every host joined")


def stop_all(hosts: Sequence[FleetHost]) -> None:
    for host in hosts:
        host.stop()


def node_state(host: FleetHost, node: str) -> str | None:
    """``node``'s state as ``host`` reports it."""
    return {n["id"]: n["state"] for n in host.fleet("nodes").get("nodes", [])}.get(node)


def controller_first(
    root: Path, url: str, mirror: HfMirror, *, fault: str | None = None
) -> list[FleetHost]:
    """node-a (no labels; ``fault`` armed) started alone, so that it is the controller,
    then node-b and node-c (``role: serve``); returns them once all three joined. The
    caller stops them."""
    a = FleetHost("node-a", root / "node-a", url, mirror.url)
    b = FleetHost("node-b", root / "node-b", url, mirror.url, labels={"role": "serve"})
    c = FleetHost("node-c", root / "node-c", url, mirror.url, labels={"role": "serve"})
    a.start(fault=fault)
    poll(
        lambda: (a.fleet("controller").get("controller") or {}).get("holder") == "node-a",
        timeout_s=60,
        what="node-a the controller",
    )
    b.start()
    c.start()
    poll(lambda: len(a.fleet("nodes").get("nodes", [])) == 3, timeout_s=60, what="3 nodes")
    return [a, b, c]


def fleet_jobs(url: str) -> list[tuple[str, str]]:
    return [
        (str(k), str(s))
        for k, s in query(url, "SELECT kind, status FROM jobs WHERE kind LIKE 'fleet.%'")
    ]


def test_a_two_replica_deployment_lands_on_two_nodes_and_each_serves(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "abc"]
    try:
        start_all(hosts)
        applied = apply(hosts[2], {"tiny": {**TINY, "replicas": 2}})
        assert applied["fleet"]["revision"] == 1
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 2, timeout_s=60, what="2 replicas")
        placed = placements(hosts[1])
        assert len(placed) == 2 and len({p["node"] for p in placed}) == 2
        assert fleet_jobs(url) == [("fleet.place", "succeeded")] * 2
        by_node = {h.node: h for h in hosts}
        for placement in placed:
            holder = by_node[placement["node"]]
            assert holder.chat().status_code == 200
            assert len(holder.engines()) == 1
        (empty,) = [h for h in hosts if h.node not in {p["node"] for p in placed}]
        assert empty.deployments() == {} and empty.engines() == []
        # Every host shows the fleet's desired state; a stale compare-and-set is refused.
        shown = empty.admin_call("GET", "/admin/model-host/deployments").json()
        assert (shown["authority"], shown["revision"]) == ("cluster_authority", 1)
        assert shown["deployments"]["tiny"]["replicas"] == 2
        stale = empty.admin_call(
            "PUT",
            "/admin/model-host/deployments",
            json={"expected_revision": None, "deployments": {"tiny": TINY}},
        )
        assert (stale.status_code, stale.json()["code"]) == (409, "revision_conflict")
        unknown = empty.admin_call(
            "PUT",
            "/admin/model-host/deployments",
            json={"expected_revision": 1, "deployments": {"x": {"model": "no-such-model"}}},
        )
        assert (unknown.status_code, unknown.json()["code"]) == (400, "unknown_catalog_model")
        # tiny.r1 is the id a node runs tiny's second replica under: refused, nothing written.
        clash = {"tiny": TINY, "tiny.r1": TINY}
        clashing = empty.admin_call(
            "PUT",
            "/admin/model-host/deployments",
            json={"expected_revision": 1, "deployments": clash},
        )
        assert (clashing.status_code, clashing.json()["code"]) == (400, "invalid_desired")
        assert "tiny.r1" in clashing.json()["error"]
        # A fleet chooses each replica's devices: a definition naming some is refused.
        pinned = empty.admin_call(
            "PUT",
            "/admin/model-host/deployments",
            json={"expected_revision": 1, "deployments": {"tiny": {**TINY, "devices": [0]}}},
        )
        assert (pinned.status_code, pinned.json()["code"]) == (400, "invalid_desired")
        assert pinned.json()["path"] == "proxy.model_host.deployments.tiny.devices"
        listed = json.loads(cli(empty, "nodes", "list").stdout)
        assert sorted(n["state"] for n in listed["nodes"]) == ["ready"] * 3
        ps = json.loads(cli(empty, "models", "ps", "--fleet").stdout)
        assert sorted(p["runtime"]["state"] for p in ps["placements"]) == ["ready", "ready"]
        # The shared credential still admits and is accepted, with a warning at start.
        assert "the shared fleet credential is deprecated" in empty.output
        # The peer lease route answers the fleet credential only.
        lease_url = f"http://127.0.0.1:{empty.gateway}/fleet/v1/lease"
        refused = httpx.get(lease_url, headers={"Authorization": f"Bearer {PASSWORD}"})
        assert (refused.status_code, refused.json()["code"]) == (401, "peer_unauthorized")
        lease = httpx.get(lease_url, headers={"Authorization": f"Bearer {CREDENTIAL}"}).json()
        renewed_at, since = lease.pop("renewed_at_ms"), lease.pop("streak_since_ms")
        assert isinstance(since, int) and since <= renewed_at  # its unbroken run of renewals
        assert lease == {"node_id": empty.node, "renewed_recently": True, "fenced": False}
        # Its last renewal on database time: what a peer cut off compares with its own loss.
        assert isinstance(renewed_at, int) and renewed_at > 0
        controller = next(h for h in hosts if h.node == listed["controller"]["holder"])
        metrics = controller.admin_call("GET", "/metrics").text
        assert 'sbproxy_fleet_replicas_ready{deployment="tiny"} 2.0' in metrics
        assert 'sbproxy_fleet_nodes{state="ready"} 3.0' in metrics
    finally:
        stop_all(hosts)


def test_a_sigkilled_replica_host_is_re_placed_once_and_the_other_replica_keeps_answering(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "abc"]
    try:
        start_all(hosts)
        apply(hosts[0], {"tiny": {**TINY, "replicas": 2}})
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 2, timeout_s=60, what="2 replicas")
        holders = ready_nodes(hosts[0], "tiny")
        controller = hosts[0].fleet("controller")["controller"]
        # Kill the controller when it holds a replica (its take-over is tested too).
        victim_id = controller["holder"] if controller["holder"] in holders else holders[0]
        victim = next(h for h in hosts if h.node == victim_id)
        survivor = next(h for h in hosts if h.node in holders and h.node != victim_id)
        spare = next(h for h in hosts if h.node not in holders)
        victim.kill()
        killed_at = time.monotonic()
        answers = []

        def replaced() -> bool:
            answers.append(survivor.chat().status_code)
            return ready_nodes(spare, "tiny") == sorted([survivor.node, spare.node])

        poll(replaced, timeout_s=LOST_AFTER_MS / 1000 + 30, what="the replica re-placed")
        took_s = time.monotonic() - killed_at
        assert took_s >= LOST_AFTER_MS / 1000 - 0.5  # not before the node was lost
        assert set(answers) == {200}
        assert spare.chat().status_code == 200
        rows = query(url, "SELECT type FROM fleet_events WHERE type IN ('placed', 'replaced')")
        assert sorted(t for (t,) in rows) == ["placed", "placed", "replaced"]
        # The gone placement ended with the move to lost (stopping), and is forgotten once
        # its replacement serves.
        poll(lambda: len(placements(spare)) == 2, timeout_s=10, what="the gone one forgotten")
        lease = spare.fleet("controller")["controller"]
        if victim_id == controller["holder"]:
            assert lease["epoch"] == controller["epoch"] + 1 and lease["holder"] != victim_id
        print(f"SIGKILL -> ready replacement: {took_s:.2f} s")
        # The killed host comes back: it serves nothing of the moved replica.
        for engine in victim.engines():  # its orphan engine dies with the restart's reaping
            engine.kill()
        victim.start()
        poll(
            lambda: victim.fleet("nodes").get("local_node") == victim.node,
            timeout_s=60,
            what="the killed host back",
        )
        assert victim.deployments() == {}
    finally:
        stop_all(hosts)


@pytest.mark.parametrize("fault", ["refused", "blackholed"])
def test_a_host_cut_off_from_the_database_fences_itself_before_it_is_re_placed(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror, fault: str
) -> None:
    """A refused link (connections closed) and a blackholed one (every byte dropped, as a
    dead route: issue 30, item 1) both fence the host before lost_after_ms."""
    url = postgres_server.create_database()
    with TcpRelay(postgres_server.port) as relay:
        cut_url = url.replace(f":{postgres_server.port}/", f":{relay.port}/")
        assert cut_url != url
        a = FleetHost("node-a", tmp_path / "node-a", cut_url, mirror.url)
        b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
        hosts = [a, b]
        try:
            start_all(hosts)
            apply(b, {"tiny": TINY})
            poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
            (engine,) = a.engines()
            if fault == "refused":
                relay.cut()
            else:
                relay.blackhole()
            cut_at = time.monotonic()
            poll(lambda: not engine.is_running(), timeout_s=30, what="node-a fenced")
            fenced_s = time.monotonic() - cut_at
            assert fenced_s < LOST_AFTER_MS / 1000, fenced_s
            # Fenced before the fleet gave up on it and started the replica elsewhere.
            assert "node-b" not in ready_nodes(b, "tiny")
            poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=60, what="re-placed")
            assert a.chat().status_code != 200  # no traffic served by the fenced host
            relay.heal()
            poll(lambda: a.deployments() == {}, timeout_s=30, what="node-a dropped its replica")
            assert a.engines() == []
            nodes = {n["id"]: n["state"] for n in b.fleet("nodes")["nodes"]}
            poll(
                lambda: (
                    {n["id"]: n["state"] for n in b.fleet("nodes")["nodes"]}["node-a"] == "ready"
                ),
                timeout_s=30,
                what="node-a rejoined",
            )
            assert nodes["node-b"] == "ready"
            print(f"journal link {fault} -> fenced: {fenced_s:.2f} s")
        finally:
            relay.heal()
            stop_all(hosts)


def test_the_database_down_for_everyone_keeps_every_host_serving(
    tmp_path: Path, mirror: HfMirror
) -> None:
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None
    server = PostgresServer(bin_dir)
    server.start()
    url = server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "ab"]
    try:
        start_all(hosts)
        apply(hosts[1], {"tiny": TINY})
        poll(lambda: ready_nodes(hosts[1], "tiny") == ["node-a"], timeout_s=60, what="placed")
        (before,) = placements(hosts[1])
        (engine,) = hosts[0].engines()
        server.stop_server("fast")
        deadline = time.monotonic() + 3 * LOST_AFTER_MS / 1000
        while time.monotonic() < deadline:  # past fence_after_ms and lost_after_ms, twice
            answer = hosts[0].chat()
            if answer.status_code != 200:
                hosts[0].stop()
                raise AssertionError(f"{answer.text}\n{hosts[0].output[-6000:]}")
            assert engine.is_running()
        refused = hosts[1].admin_call(
            "PUT",
            "/admin/model-host/deployments",
            json={"expected_revision": 1, "deployments": {}},
        )
        assert (refused.status_code, refused.json()["code"]) == (503, "journal_unavailable")
        server.start_server()
        poll(lambda: bool(placements(hosts[1])), timeout_s=30, what="the journal back")
        (after,) = placements(hosts[1])
        assert (after["id"], after["node"]) == (before["id"], "node-a")  # nothing re-placed
        assert hosts[0].chat().status_code == 200
    finally:
        stop_all(hosts)
        server.stop()


def test_drain_moves_a_replica_and_cordon_keeps_it(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "ab"]
    a, b = hosts
    try:
        start_all(hosts)
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
        cordoned = json.loads(cli(b, "nodes", "cordon", "node-a").stdout)
        assert cordoned["command"] == "nodes.cordon" and cordoned["job_id"]
        poll(
            lambda: (
                {n["id"]: n["state"] for n in b.fleet("nodes")["nodes"]}["node-a"] == "cordoned"
            ),
            timeout_s=10,
            what="node-a cordoned",
        )
        assert ready_nodes(b, "tiny") == ["node-a"]  # a cordon keeps what runs
        drained = json.loads(cli(b, "nodes", "drain", "node-a").stdout)
        assert drained["job_id"]
        poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=60, what="moved to b")
        poll(lambda: a.deployments() == {}, timeout_s=30, what="node-a stopped its replica")
        assert b.chat().status_code == 200
        assert a.engines() == []
        shown = json.loads(cli(b, "nodes", "show", "node-a").stdout)
        assert shown["node"]["state"] == "draining" and shown["node"]["placements"] == []
        missing = cli(b, "nodes", "cordon", "node-z")
        assert missing.returncode == 2 and "unknown_node" in missing.stdout
        kinds = [k for k, _ in fleet_jobs(url)]
        assert kinds.count("fleet.node") == 2
        # Removed, the member is left and leaves the default listing (issue 30, item 8);
        # restarted, it is refused until admitted, then joins with no operator flag kept.
        assert json.loads(cli(b, "nodes", "remove", "node-a").stdout)["job_id"]
        poll(
            lambda: "node-a" not in [n["id"] for n in b.fleet("nodes").get("nodes", [])],
            timeout_s=10,
            what="node-a out of the listing",
        )

        def recorded_left() -> bool:
            listed = json.loads(cli(b, "nodes", "list", "--all").stdout)["nodes"]
            return {n["id"]: n["state"] for n in listed}.get("node-a") == "left"

        poll(recorded_left, timeout_s=10, what="node-a recorded left (nodes list --all)")
        a.stop()
        a.start()
        assert a.process is not None
        assert a.process.wait(timeout=60) == 2
        assert "node_removed" in a.output and "sbproxy nodes admit node-a" in a.output
        assert json.loads(cli(b, "nodes", "admit", "node-a").stdout)["job_id"]
        a.start()
        poll(lambda: node_state(b, "node-a") == "ready", timeout_s=60, what="node-a back")
        assert ready_nodes(b, "tiny") == ["node-b"]
    finally:
        stop_all(hosts)


def test_every_host_restarted_at_once_serves_its_placements_again_without_a_re_pull(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "ab"]
    try:
        start_all(hosts)
        apply(hosts[0], {"tiny": {**TINY, "replicas": 2}})
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 2, timeout_s=60, what="2 replicas")
        before = {p["id"] for p in placements(hosts[0])}
        # Each node runs its replica under the replica's own id (tiny, tiny.r1).
        local = {p["node"]: p["local_id"] for p in placements(hosts[0])}
        assert sorted(local.values()) == ["tiny", "tiny.r1"]
        served = mirror.bytes_served()
        stop_all(hosts)
        restarted_at = time.monotonic()
        for host in hosts:
            host.start()
        for host in hosts:
            host.wait_ready(local[host.node], timeout_s=60)
            answer = host.chat()
            assert answer.status_code == 200, (host.node, answer.text)
        took_s = time.monotonic() - restarted_at
        assert took_s < 30
        assert {p["id"] for p in placements(hosts[0])} == before
        assert mirror.bytes_served() == served  # no byte downloaded again
        print(f"restart -> serving: {took_s:.2f} s")
    finally:
        stop_all(hosts)


def test_a_host_paused_past_lost_after_stops_its_engine_at_once_when_it_resumes(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """SIGSTOP freezes the host (its engine, another process, keeps running); once it
    resumes it stops that engine before anything else, and its moved replica stays moved."""
    url = postgres_server.create_database()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url)
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    hosts = [a, b]
    try:
        start_all(hosts)
        apply(b, {"tiny": TINY})
        poll(lambda: ready_nodes(b, "tiny") == ["node-a"], timeout_s=60, what="on node-a")
        (engine,) = a.engines()
        assert a.process is not None
        a.process.send_signal(signal.SIGSTOP)
        try:
            poll(lambda: ready_nodes(b, "tiny") == ["node-b"], timeout_s=60, what="re-placed")
        finally:
            a.process.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        poll(lambda: not engine.is_running(), timeout_s=10, what="node-a's engine stopped")
        stopped_s = time.monotonic() - resumed_at
        poll(lambda: a.deployments() == {}, timeout_s=30, what="node-a dropped its replica")
        assert a.engines() == [] and ready_nodes(b, "tiny") == ["node-b"]
        print(f"SIGCONT -> engine stopped: {stopped_s:.2f} s")
    finally:
        stop_all(hosts)


def test_a_killed_controller_is_taken_over_under_a_higher_epoch_and_the_fleet_converges(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = controller_first(tmp_path, url, mirror)
    a, b, c = hosts
    try:
        apply(a, {"tiny": {**TINY, "replicas": 2, "required_labels": {"role": "serve"}}})
        poll(lambda: ready_nodes(b, "tiny") == ["node-b", "node-c"], timeout_s=60, what="b, c")
        a.kill()
        poll(
            lambda: (b.fleet("controller").get("controller") or {}).get("epoch") == 2,
            timeout_s=30,
            what="a new controller",
        )
        holder = b.fleet("controller")["controller"]["holder"]
        assert holder in ("node-b", "node-c")
        # The new controller carries out a change: one replica fewer.
        apply(b, {"tiny": {**TINY, "replicas": 1, "required_labels": {"role": "serve"}}})
        poll(lambda: len(placements(b)) == 1, timeout_s=60, what="scaled down to one")
        poll(
            lambda: sum(1 for h in (b, c) if h.deployments().get("tiny") == "ready") == 1,
            timeout_s=30,
            what="one engine left",
        )
        (kept,) = placements(b)
        assert kept["state"] == "ready" and kept["epoch"] == 1  # placed before the take-over
        stops = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stopping'")
        assert [json.loads(data)["epoch"] for (data,) in stops] == [2]
    finally:
        for engine in a.engines():
            engine.kill()
        stop_all(hosts)


def test_a_changed_definition_rolls_across_nodes_keeping_a_replica_serving(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    hosts = [FleetHost(f"node-{n}", tmp_path / f"node-{n}", url, mirror.url) for n in "abc"]
    try:
        start_all(hosts)
        apply(hosts[0], {"tiny": {**TINY, "replicas": 2}})
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 2, timeout_s=60, what="2 replicas")
        apply(hosts[0], {"tiny": {**TINY, "replicas": 2, "max_concurrency": 2}})
        serving: list[int] = []

        def rolled() -> bool:
            rows = placements(hosts[0])
            serving.append(sum(1 for p in rows if p["state"] == "ready"))
            return len(rows) == 2 and all(
                p["state"] == "ready" and p["revision"] == 2 for p in rows
            )

        poll(rolled, timeout_s=90, what="both replicas at revision 2")
        assert min(serving) >= 1  # at least replicas - 1 ready throughout
        by_node = {h.node: h for h in hosts}
        for row in placements(hosts[0]):
            assert by_node[row["node"]].chat().status_code == 200
        assert sum(len(h.engines()) for h in hosts) == 2  # the old engines stopped
    finally:
        stop_all(hosts)


CONTROLLER_FAULTS = [
    "fleet.place:before",
    "fleet.place:committed",
    "fleet.stop:before",
    "fleet.stop:committed",
]


@pytest.mark.parametrize("fault", CONTROLLER_FAULTS)
def test_a_controller_killed_at_a_fault_point_of_a_placement_job_is_taken_over_and_converges(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror, fault: str
) -> None:
    """node-a (no ``role`` label) is the controller and the only host armed: it dies at
    ``fault`` while carrying out a placement (two starts) or a scale-down (one stop). A
    serving host takes over under epoch 2 and the fleet ends with exactly the desired
    placements, each once, and one engine per placement."""
    url = postgres_server.create_database()
    hosts = controller_first(tmp_path, url, mirror, fault=fault)
    a, b, c = hosts
    serving = {"required_labels": {"role": "serve"}}
    try:
        # Applied through node-b: node-a may die while it answers.
        apply(b, {"tiny": {**TINY, "replicas": 2, **serving}})
        if fault.startswith("fleet.stop"):
            poll(lambda: ready_nodes(b, "tiny") == ["node-b", "node-c"], timeout_s=60, what="b, c")
            apply(b, {"tiny": {**TINY, "replicas": 1, **serving}})
            want = 1
        else:
            want = 2
        poll(lambda: not a.alive(), timeout_s=60, what=f"node-a dead at {fault}")
        assert a.stop() == -signal.SIGKILL
        poll(
            lambda: (b.fleet("controller").get("controller") or {}).get("epoch") == 2,
            timeout_s=30,
            what="a new controller",
        )
        poll(lambda: len(ready_nodes(b, "tiny")) == want, timeout_s=90, what=f"{want} ready")
        poll(lambda: len(placements(b)) == want, timeout_s=30, what=f"{want} placement(s) left")
        poll(
            lambda: sum(len(h.engines()) for h in (b, c)) == want,
            timeout_s=30,
            what=f"{want} engine(s)",
        )
        rows = placements(c)
        assert len({p["node"] for p in rows}) == want  # never two on one node
        placed = [
            json.loads(body)["epoch"]
            for (body,) in query(url, "SELECT input_json FROM jobs WHERE kind = 'fleet.place'")
        ]
        # Each start was recorded once: by node-a before it died (committed) or by the new
        # controller; the death before the record left nothing behind.
        assert sorted(placed) == {
            "fleet.place:before": [2, 2],
            "fleet.place:committed": [1, 2],
        }.get(fault, [1, 1])
        stops = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stopping'")
        expected_stops = {"fleet.stop:before": [2], "fleet.stop:committed": [1]}.get(fault, [])
        assert [json.loads(data)["epoch"] for (data,) in stops] == expected_stops
        assert a.engines() == []
    finally:
        stop_all(hosts)


def test_a_controller_paused_at_a_placement_is_deposed_and_its_late_write_refused(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    """node-a stops itself (SIGSTOP) just before recording a placement; the fleet elects
    node-b or node-c under epoch 2 and places both replicas. SIGCONT: node-a's write under
    epoch 1 is refused (``controller_deposed``) and nothing is placed twice."""
    url = postgres_server.create_database()
    hosts = controller_first(tmp_path, url, mirror, fault="fleet.place:before@stop")
    a, b, _ = hosts
    try:
        apply(b, {"tiny": {**TINY, "replicas": 2, "required_labels": {"role": "serve"}}})
        poll(
            lambda: (b.fleet("controller").get("controller") or {}).get("epoch") == 2,
            timeout_s=60,
            what="a new controller while node-a is paused",
        )
        poll(lambda: ready_nodes(b, "tiny") == ["node-b", "node-c"], timeout_s=90, what="b, c")
        assert a.process is not None
        a.process.send_signal(signal.SIGCONT)
        poll(lambda: "controller deposed" in a.output, timeout_s=30, what="node-a deposed")
        assert a.alive()
        rows = placements(b)
        assert sorted(p["node"] for p in rows) == ["node-b", "node-c"]
        assert all(p["epoch"] == 2 for p in rows)
        epochs = [
            json.loads(body)["epoch"]
            for (body,) in query(url, "SELECT input_json FROM jobs WHERE kind = 'fleet.place'")
        ]
        assert epochs == [2, 2]
    finally:
        if a.process is not None and a.alive():
            a.process.send_signal(signal.SIGCONT)
        stop_all(hosts)
