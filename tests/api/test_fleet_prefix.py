"""Prefix-aware routing on a real fleet host (issue 34, item 1): a real ``sbproxy serve`` host
whose CPU budget is split into two devices (``cpu_devices: 2``) runs both replicas of a
``routing: prefix`` deployment (``tiny`` and ``tiny.r1``); its gateway sends every request
with one system prompt to one engine, spreads different system prompts over both, and
switching the deployment back to ``least_outstanding`` restarts no engine. Real PostgreSQL,
real processes, the stand-in llama-server (its request log names the engine's port)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.cluster_hosts import FleetHost, placements
from tests.api.pg_hosts import poll
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.model_host.engines.support import fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def chat(host: FleetHost, prompt: int, question: str) -> httpx.Response:
    return httpx.post(
        f"http://localhost:{host.gateway}/v1/chat/completions",
        json={
            "model": "tiny-chat",
            "messages": [
                {"role": "system", "content": f"You are agent {prompt}. " * 30},
                {"role": "user", "content": question},
            ],
        },
        timeout=30,
    )


def engines_by_prompt(log: Path, ports: dict[int, str]) -> dict[int, set[str]]:
    """The replicas (local ids) each system prompt's requests reached."""
    found: dict[int, set[str]] = defaultdict(set)
    for record in map(json.loads, log.read_text().splitlines()):
        if "event" in record:
            continue
        system = record["body"]["messages"][0]["content"]
        found[int(system.split()[3].rstrip("."))].add(ports[record["port"]])
    return dict(found)


def test_one_system_prompt_stays_on_one_of_two_replicas_of_a_node(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    host = FleetHost("node-a", tmp_path / "node-a", url, mirror.url, settings={"cpu_devices": 2})
    log = tmp_path / "requests.jsonl"
    host.executable = fake_llama_server(host.root / "bin-logged", mode=f"requests_log={log}")
    host.write({})
    prefix: dict[str, Any] = {**TINY, "replicas": 2, "routing": "prefix"}
    try:
        start_all([host])
        apply(host, {"tiny": prefix})
        poll(
            lambda: (
                host.deployments() == {"tiny": "ready", "tiny.r1": "ready"}
                and all(p["state"] == "ready" for p in placements(host))
                and len(placements(host)) == 2
            ),
            timeout_s=90,
            what="both replicas ready on node-a",
        )
        ps = json.loads(cli(host, "models", "ps").stdout)["deployments"]
        ports = {d["port"]: d["deployment"] for d in ps}
        generations = {d["deployment"]: d["generation"] for d in ps}
        # The gateway's routing table lists both ready (a heartbeat after the placements).
        poll(
            lambda: (
                'sbproxy_fleet_replicas_ready{deployment="tiny"} 2.0'
                in host.admin_call("GET", "/metrics").text
            ),
            timeout_s=30,
            what="the table lists both replicas ready",
        )
        for question in ("first", "second", "third"):
            for prompt in range(10):
                assert chat(host, prompt, question).status_code == 200
        reached = engines_by_prompt(log, ports)
        assert sorted(reached) == list(range(10))
        assert all(len(replicas) == 1 for replicas in reached.values()), reached
        assert {next(iter(r)) for r in reached.values()} == {"tiny", "tiny.r1"}
        metrics = host.admin_call("GET", "/metrics").text
        hits = 'sbproxy_gateway_prefix_routes_total{deployment="tiny",outcome="first_choice"}'
        assert f"{hits} 30.0" in metrics

        # Back to least outstanding: no engine restarts, and the routing table follows.
        log.write_text("")
        apply(host, {"tiny": {**prefix, "routing": "least_outstanding"}})

        def spread() -> bool:
            assert chat(host, 0, "again").status_code == 200
            return engines_by_prompt(log, ports).get(0) == {"tiny", "tiny.r1"}

        poll(spread, timeout_s=30, what="one prompt on both replicas by least outstanding")
        after = json.loads(cli(host, "models", "ps").stdout)["deployments"]
        assert {d["deployment"]: d["generation"] for d in after} == generations
    finally:
        stop_all([host])
