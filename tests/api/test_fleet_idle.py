"""A replica that keep-alive stopped, across real ``sbproxy serve`` hosts of one fleet (issue
20, "Peer dispatch"): real PostgreSQL, the stand-in llama-server. The idle replica stays
idle (the fleet does not load it again by itself), every host shows it ``idle`` -- not
``ready``, not ``unreachable`` -- and a request to another host's gateway is answered
through it: the owning host loads it for the hop, as for a request of its own client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.cluster_hosts import FleetHost, placements, ready_nodes
from tests.api.pg_hosts import poll
from tests.api.test_fleet_hosts import TINY, apply, cli, start_all, stop_all
from tests.support.hf_server import HfMirror
from tests.support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@contextmanager
def fleet(url: str, mirror_url: str, root: Path, names: str) -> Iterator[list[FleetHost]]:
    """Fleet hosts ``node-<name>`` on the database at ``url``, joined; stopped at the end."""
    hosts = [FleetHost(f"node-{n}", root / f"node-{n}", url, mirror_url) for n in names]
    try:
        start_all(hosts)
        yield hosts
    finally:
        stop_all(hosts)


def runtime(host: FleetHost) -> dict[str, Any]:
    """``host``'s own runtime row of ``tiny`` ({} while it has none or does not answer)."""
    try:
        rows = host.admin_call("GET", "/admin/model-host/status").json()["deployments"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return next((dict(r) for r in rows if r["deployment"] == "tiny"), {})


def shown(host: FleetHost) -> str | None:
    """The state ``host``'s fleet view shows for the replica of ``tiny``."""
    placed = placements(host)
    return (placed[0].get("runtime") or {}).get("state") if len(placed) == 1 else None


def availability(host: FleetHost) -> dict[str, Any]:
    listed = httpx.get(f"http://localhost:{host.gateway}/v1/models", timeout=30).json()
    return dict(listed["data"][0]["availability"])


def test_a_replica_idle_after_keep_alive_is_woken_by_a_request_to_another_host(
    tmp_path: Path, postgres_server: PostgresServer, mirror: HfMirror
) -> None:
    with fleet(postgres_server.create_database(), mirror.url, tmp_path, "ab") as hosts:
        apply(hosts[0], {"tiny": {**TINY, "keep_alive_secs": 1}})
        poll(lambda: len(ready_nodes(hosts[0], "tiny")) == 1, timeout_s=60, what="placed")
        (owner,) = [h for h in hosts if h.node in ready_nodes(hosts[0], "tiny")]
        (other,) = [h for h in hosts if h is not owner]
        poll(lambda: runtime(owner).get("state") == "ready", timeout_s=30, what="loaded")
        loaded_generation = runtime(owner)["generation"]
        # Idle a second after its last request (none yet): keep-alive stops the engine.
        poll(lambda: shown(other) == "idle", timeout_s=30, what="shown idle on the other host")
        assert owner.engines() == []
        stopped = runtime(owner)
        assert (stopped["state"], stopped.get("reason_code")) == ("stopped", "keep_alive")
        assert shown(owner) == "idle"
        ps = json.loads(cli(other, "models", "ps", "--fleet").stdout)
        (row,) = ps["placements"]
        assert (row["state"], row["node_state"]) == ("ready", "ready")
        assert (row["runtime"]["state"], row["runtime"]["reported_state"]) == ("idle", "stopped")
        # Every gateway of the fleet lists it cold: a request loads it.
        poll(lambda: availability(other)["state"] == "cold", timeout_s=10, what="listed cold there")
        assert availability(other) == {"state": "cold", "ready_replicas": 0, "desired_replicas": 1}
        # Counted idle, not ready, in every host's fleet metrics.
        counted = (
            'sbproxy_fleet_replicas_ready{deployment="tiny"} 0.0',
            'sbproxy_fleet_replicas_idle{deployment="tiny"} 1.0',
        )

        def counted_idle() -> bool:
            text = other.admin_call("GET", "/metrics").text
            return all(line in text for line in counted)

        poll(counted_idle, timeout_s=10, what="counted idle in the metrics")
        # The fleet left it idle: nothing but a request loaded it again.
        assert runtime(owner)["generation"] == loaded_generation
        answer = other.chat()
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-route-class"] == "peer"
        assert answer.headers["x-sbproxy-peer-node"] == owner.node
        assert answer.json()["model"] == "tiny-chat"
        woken = runtime(owner)
        assert (woken["state"], woken["generation"]) == ("ready", loaded_generation + 1)
        assert len(owner.engines()) == 1
        assert other.engines() == []
        poll(lambda: shown(other) == "ready", timeout_s=10, what="shown ready again")
