"""Autoscaling across real ``sbproxy serve`` hosts of one fleet (issue 33, item 3): real
PostgreSQL, the stand-in llama-server answering each request after a delay (so that
requests stay in flight), short windows from the deployment's own ``replicas`` range.

* A load of concurrent clients drives a scale-up, a steady load at the target makes no
  further decision, and when it stops the fleet scales down one replica at a time to
  ``min`` -- every decision one ``fleet.scale`` job with its reason and figures, counted.
* ``min: 0``: an idle deployment goes to zero replicas (no engine left anywhere); a burst
  of requests to two gateways makes one scale-from-zero decision and every request is
  answered within its queue timeout.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.cluster_hosts import FleetHost, placements, ready_nodes
from tests.api.pg_hosts import poll, query
from tests.api.test_fleet_hosts import TINY, apply, start_all, stop_all
from tests.model_host.engines.support import fake_llama_server
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPLY_DELAY_S = 1.0
"""How long the stand-in engine takes to answer each plain request."""


@contextmanager
def fleet(url: str, mirror_url: str, root: Path, names: str) -> Iterator[list[FleetHost]]:
    """Fleet hosts ``node-<name>`` whose engines answer after REPLY_DELAY_S, joined."""
    hosts = [FleetHost(f"node-{n}", root / f"node-{n}", url, mirror_url) for n in names]
    for host in hosts:
        # Engines get a minimal environment: the mode is baked into the executable.
        host.executable = fake_llama_server(
            host.root / "bin-slow", mode=f"reply_delay_s={REPLY_DELAY_S}"
        )
        host.write({})
    try:
        start_all(hosts)
        yield hosts
    finally:
        stop_all(hosts)


def scale_jobs(url: str) -> list[dict[str, Any]]:
    """The ``fleet.scale`` jobs in the order they were made (their recorded input)."""
    rows = query(
        url, "SELECT input_json FROM jobs WHERE kind = 'fleet.scale' ORDER BY created_at_ms, id"
    )
    return [json.loads(str(row[0])) for row in rows]


def steps(url: str) -> list[tuple[int, int, str]]:
    return [(j["from_replicas"], j["to_replicas"], j["reason"]) for j in scale_jobs(url)]


def live(host: FleetHost) -> int:
    """Placements of ``tiny`` not being stopped, as ``host`` reports them."""
    return sum(
        1 for p in placements(host) if p["deployment"] == "tiny" and p["state"] != "stopping"
    )


def ask(host: FleetHost) -> httpx.Response:
    return httpx.post(
        f"http://localhost:{host.gateway}/v1/chat/completions",
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
        timeout=90,
    )


class Load:
    """``clients`` threads, each sending one request after another round the hosts."""

    def __init__(self, hosts: list[FleetHost], clients: int) -> None:
        self.hosts = hosts
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def _client(self, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            host = self.hosts[turn % len(self.hosts)]
            turn += 1
            try:
                self.statuses.append(ask(host).status_code)
            except httpx.HTTPError:
                self.statuses.append(0)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def test_a_load_scales_up_holds_steady_at_the_target_then_scales_down_one_at_a_time(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    bounds = {
        "min": 1,
        "max": 3,
        "target": 1,
        "window_ms": 3_000,
        "panic_window_ms": 1_000,
        "scale_down_delay_ms": 2_500,
    }
    with fleet(url, mirror.url, tmp_path, "abc") as hosts:
        apply(hosts[0], {"tiny": {**TINY, "replicas": bounds}})
        poll(lambda: live(hosts[0]) == 1 and ask(hosts[0]).status_code == 200,
             timeout_s=90, what="one replica serving")  # fmt: skip
        assert steps(url) == []  # the initial count (min) needs no decision
        # Three clients, each keeping one request of 1 s in flight: 3 per replica, three
        # times the target -- a burst.
        with Load(hosts, clients=3) as load:
            poll(lambda: live(hosts[0]) == 3, timeout_s=60, what="scaled up to 3")
            up = steps(url)
            assert up and all(b > a for a, b, _ in up), up
            assert up[-1][1] == 3
            # Steady at the target (3 in flight on 3 replicas): no decision for as long
            # as two stable windows plus the scale-down delay.
            steady_from = len(up)
            poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 3, timeout_s=60, what="3 ready")
            deadline = time.monotonic() + 2 * bounds["window_ms"] / 1000 + 2.5
            while time.monotonic() < deadline:
                assert len(steps(url)) == steady_from, steps(url)
                time.sleep(0.2)
        assert load.statuses and set(load.statuses) == {200}, sorted(set(load.statuses))
        # Idle: down one replica at a time, each after the delay, never below min.
        poll(lambda: len(steps(url)) == steady_from + 2, timeout_s=60, what="two steps down")
        time.sleep(bounds["scale_down_delay_ms"] / 1000 * 2)  # long enough for a third
        down = steps(url)[steady_from:]
        assert down == [(3, 2, "below_target"), (2, 1, "below_target")]
        poll(lambda: live(hosts[0]) == 1, timeout_s=30, what="one replica left")
        jobs = scale_jobs(url)
        times = [j["figures"]["watched_ms"] for j in jobs[steady_from:]]
        assert times[1] - times[0] >= bounds["scale_down_delay_ms"]
        first = jobs[0]
        assert first["reason"] in ("panic", "above_target")
        assert first["figures"]["panic_in_flight"] > 0 and first["epoch"] >= 1
        controller = next(h for h in hosts if h.node == first_holder(hosts[0]))
        metrics = controller.admin_call("GET", "/metrics").text
        assert 'sbproxy_fleet_autoscale_replicas_desired{deployment="tiny"} 1.0' in metrics
        assert (
            'sbproxy_fleet_scale_decisions_total{deployment="tiny",direction="down",'
            'reason="below_target"} 2.0'
        ) in metrics
        assert 'sbproxy_fleet_autoscale_load{deployment="tiny",window="stable"}' in metrics


def first_holder(host: FleetHost) -> str:
    return str((host.fleet("controller").get("controller") or {}).get("holder"))


def test_min_zero_scales_to_zero_and_a_burst_of_requests_wakes_one_replica(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    bounds = {"min": 0, "max": 1, "window_ms": 2_000, "panic_window_ms": 500}
    bounds["scale_down_delay_ms"] = 1_500
    with fleet(url, mirror.url, tmp_path, "ab") as hosts:
        apply(hosts[0], {"tiny": {**TINY, "replicas": bounds, "queue_timeout_ms": 60_000}})
        poll(lambda: live(hosts[0]) == 1, timeout_s=90, what="the initial replica placed")
        # Nobody asks: after the delay the last replica goes, and its engine with it.
        poll(lambda: steps(url) == [(1, 0, "idle")], timeout_s=60, what="scaled to zero")
        poll(lambda: live(hosts[0]) == 0 and live(hosts[1]) == 0, timeout_s=30, what="none")
        poll(lambda: not any(h.engines() for h in hosts), timeout_s=30, what="no engine left")
        models = httpx.get(f"http://localhost:{hosts[1].gateway}/v1/models", timeout=30).json()
        assert models["data"][0]["availability"]["ready_replicas"] == 0
        # Six requests at once, to both gateways: one decision, every answer 200.
        started = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, [hosts[i % 2] for i in range(6)]))
        took = time.monotonic() - started
        assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers]
        assert took < 60
        assert steps(url) == [(1, 0, "idle"), (0, 1, "demand")]
        assert query(url, "SELECT count(*) FROM fleet_demand") == [(0,)]
        assert live(hosts[0]) == 1


def test_a_request_for_a_deployment_at_zero_times_out_with_queue_timeout(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    url = postgres_server.create_database()
    bounds = {"min": 0, "max": 1, "window_ms": 1_000, "panic_window_ms": 500}
    bounds["scale_down_delay_ms"] = 500
    with fleet(url, mirror.url, tmp_path, "a") as hosts:
        # Only nodes labelled gpu=yes may take it: none does, so nothing is ever placed.
        deployment = {**TINY, "replicas": bounds, "queue_timeout_ms": 1_500}
        apply(hosts[0], {"tiny": {**deployment, "required_labels": {"gpu": "yes"}}})
        poll(lambda: steps(url) == [(1, 0, "idle")], timeout_s=60, what="scaled to zero")
        started = time.monotonic()
        answer = ask(hosts[0])
        took = time.monotonic() - started
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "queue_timeout"
        assert answer.headers.get("retry-after") is not None
        assert 1.4 <= took < 10
