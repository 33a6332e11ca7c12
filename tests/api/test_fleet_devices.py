"""Two replicas of one deployment on one node, each on a device of its own (issue 20,
"never two replicas of one deployment on one node unless it has devices for both"): a real
``sbproxy serve`` host whose CPU budget is split into two devices (``cpu_devices: 2``) takes
both replicas of a two-replica deployment, runs them side by side under their own ids
(``tiny`` on device 0, ``tiny.r1`` on device 1), spreads its gateway's requests over both
engines, and on a scale-down stops only the second one. Real PostgreSQL, real processes, the
stand-in llama-server (its request log names the engine's port)."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.api.cluster_hosts import FleetHost, placements
from tests.api.pg_hosts import poll, query
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.model_host.engines.support import fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def slow_chat(host: FleetHost) -> int:
    answer = httpx.post(
        f"http://localhost:{host.gateway}/v1/chat/completions",
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    return answer.status_code


def test_two_replicas_run_side_by_side_on_one_node_with_a_device_each(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    host = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, settings={"cpu_devices": 2})
    log = tmp_path / "requests.jsonl"
    host.executable = fake_llama_server(
        host.root / "bin-logged", mode=f"reply_delay_s=0.5,requests_log={log}"
    )
    host.write({})
    try:
        start_all([host])
        apply(host, {"tiny": {**TINY, "replicas": 2}})

        def both_ready() -> bool:
            rows = placements(host)
            return len(rows) == 2 and all(
                r["state"] == "ready" and (r["runtime"] or {}).get("state") == "ready" for r in rows
            )

        poll(both_ready, timeout_s=90, what="both replicas ready on node-a")
        rows = sorted(placements(host), key=lambda r: r["replica"])
        assert [(r["node"], r["devices"], r["local_id"]) for r in rows] == [
            ("node-a", [0], "tiny"),
            ("node-a", [1], "tiny.r1"),
        ]
        assert host.deployments() == {"tiny": "ready", "tiny.r1": "ready"}
        assert len(host.engines()) == 2
        ps = json.loads(cli(host, "models", "ps").stdout)
        devices = {d["deployment"]: d["selected_devices"] for d in ps["deployments"]}
        assert devices == {"tiny": [0], "tiny.r1": [1]}
        ports = {d["port"]: d["deployment"] for d in ps["deployments"]}
        generation = {d["deployment"]: d["generation"] for d in ps["deployments"]}["tiny"]

        # Four requests at once through the node's gateway: two on each engine.
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: slow_chat(host), range(4))) == [200] * 4
        posts = [r for r in map(json.loads, log.read_text().splitlines()) if "event" not in r]
        assert Counter(ports[r["port"]] for r in posts) == {"tiny": 2, "tiny.r1": 2}
        metrics = host.admin_call("GET", "/metrics").text
        assert 'sbproxy_fleet_replicas_ready{deployment="tiny"} 2.0' in metrics

        # One replica again: the second stops, the first keeps its engine (no restart).
        apply(host, {"tiny": {**TINY, "replicas": 1}})
        poll(lambda: host.deployments() == {"tiny": "ready"}, timeout_s=60, what="scaled down")
        poll(lambda: len(placements(host)) == 1, timeout_s=30, what="its placement removed")
        assert len(host.engines()) == 1
        after = json.loads(cli(host, "models", "ps").stdout)["deployments"]
        assert [(d["deployment"], d["generation"]) for d in after] == [("tiny", generation)]
        assert slow_chat(host) == 200
    finally:
        stop_all([host])


def test_a_replica_whose_device_is_gone_after_a_restart_moves_to_another_node(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    a = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, settings={"cpu_devices": 2})
    b = FleetHost("node-b", tmp_path / "node-b", url, mirror.url)
    wanted = {"tiny": {**TINY, "replicas": 2}}
    try:
        start_all([a])
        apply(a, wanted)
        poll(
            lambda: [(p["node"], p["state"]) for p in placements(a)] == [("node-a", "ready")] * 2,
            timeout_s=90,
            what="both replicas ready on node-a",
        )
        # node-a comes back with one device: replica 1 holds device 1, which is gone.
        a.stop()
        a.settings = {"cpu_devices": 1}
        a.write(wanted)
        start_all([a, b])

        def moved() -> bool:
            rows = {p["replica"]: p for p in placements(b)}
            one = rows.get(1) or {}
            return (
                len(rows) == 2
                and (one.get("node"), one.get("state")) == ("node-b", "ready")
                and (one.get("runtime") or {}).get("state") == "ready"
            )

        poll(moved, timeout_s=90, what="replica 1 moved to node-b")
        rows = {p["replica"]: p for p in placements(b)}
        assert (rows[0]["node"], rows[0]["devices"], rows[0]["state"]) == ("node-a", [0], "ready")
        assert a.deployments() == {"tiny": "ready"} and len(a.engines()) == 1
        rows_events = query(url, "SELECT data_json FROM fleet_events WHERE type = 'stuck_replaced'")
        assert [json.loads(data)["reason"] for (data,) in rows_events] == ["load_failed"]
    finally:
        stop_all([a, b])
