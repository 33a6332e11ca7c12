"""Prefix-aware routing between real hosts on loopback (issue 34, item 1): each host a real
runtime with its own stand-in engine and gateway listener, the routing tables static and
listing ``tiny`` with ``routing: prefix``. Hosts ``a`` and ``d`` have no replica; ``b`` and
``c`` have one each. Which engine served a request is read from its request log."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbproxy.fleet.prefix import prefix_key, rendezvous_order
from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import Fleet, fleet_of
from tests.api.support import ADMIN

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def body(prompt: int, turn: str) -> dict[str, Any]:
    return {
        "model": "tiny-chat",
        "messages": [
            {"role": "system", "content": f"System prompt number {prompt}. " * 20},
            {"role": "user", "content": turn},
        ],
    }


def first_choice(prompt: int) -> str:
    """The node prefix routing sends ``prompt``'s requests to while every replica is idle."""
    key = prefix_key(CHAT, body(prompt, "x"))
    assert key is not None
    return rendezvous_order(key, ["b/tiny", "c/tiny"])[0].split("/")[0]


def prefix_table(fleet: Fleet, **loads: int) -> list[PeerReplica]:
    """``tiny`` on ``b`` and ``c``, prefix-routed (``loads``: a node's reported ``active``)."""
    return [
        replace(fleet.replica(name, active=loads.get(name, 0)), routing="prefix")
        for name in ("b", "c")
    ]


def served_prompts(fleet: Fleet) -> dict[str, set[int]]:
    """The system prompts each member's engine served."""
    found: dict[str, set[int]] = {}
    for name, member in fleet.members.items():
        for request in member.engine_requests():
            system = request["body"]["messages"][0]["content"]
            found.setdefault(name, set()).add(int(system.split()[3].rstrip(".")))
    return found


async def post(url: str, document: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post(CHAT, json=document)


async def test_one_prefix_goes_to_one_replica_from_every_gateway_and_prefixes_spread(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path, names=("a", "b", "c", "d")) as fleet:
        for name in "abcd":
            fleet.route(name, prefix_table(fleet))
        prompts = range(12)
        for turn in ("first question", "second question"):
            for gateway in "abdc":  # two without a replica, both with one
                for prompt in prompts:
                    answer = await post(fleet[gateway].host.gateway_url, body(prompt, turn))
                    assert answer.status_code == 200, answer.text
                    here = first_choice(prompt) == gateway
                    assert answer.headers["x-sbproxy-route-class"] == ("local" if here else "peer")
        served = served_prompts(fleet)
        assert set(served) == {"b", "c"}
        # Every prompt's 8 requests (4 gateways, 2 turns) on the one engine of its first
        # choice; both engines have some.
        for name in ("b", "c"):
            assert served[name] == {p for p in prompts if first_choice(p) == name}
            assert len(fleet[name].engine_requests()) == 8 * len(served[name])
        assert served["b"] and served["c"]
        for gateway in "abcd":
            assert fleet[gateway].dispatch.prefix_routes == {
                ("tiny", "first_choice"): 2 * len(prompts)
            }


async def test_a_first_choice_over_its_load_bound_passes_its_prefix_to_the_next(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path) as fleet:
        prompt = 3
        hot = first_choice(prompt)
        other = "c" if hot == "b" else "b"
        # The hot replica reported 4 requests in flight: over its bound of ceil(1.25 * 5 / 2).
        fleet.route("a", prefix_table(fleet, **{hot: 4}))
        answer = await post(fleet["a"].host.gateway_url, body(prompt, "q"))
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-peer-node"] == other
        assert fleet["a"].dispatch.prefix_routes == {("tiny", "load_bound"): 1}
        # One in flight is below its bound of ceil(1.25 * 2 / 2) = 2: back to it.
        fleet.route("a", prefix_table(fleet, **{hot: 1}))
        answer = await post(fleet["a"].host.gateway_url, body(prompt, "q"))
        assert answer.headers["x-sbproxy-peer-node"] == hot
        assert fleet["a"].dispatch.prefix_routes == {
            ("tiny", "load_bound"): 1,
            ("tiny", "first_choice"): 1,
        }
        async with httpx.AsyncClient(base_url=fleet["a"].host.admin_url, auth=ADMIN) as admin:
            metrics = (await admin.get("/metrics")).text
        for outcome in ("load_bound", "first_choice"):
            labels = f'{{deployment="tiny",outcome="{outcome}"}}'
            assert f"sbproxy_gateway_prefix_routes_total{labels} 1.0" in metrics


async def test_a_request_with_nothing_to_key_on_takes_the_least_outstanding_replica(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("a", prefix_table(fleet, b=3))
        async with httpx.AsyncClient(base_url=fleet["a"].host.gateway_url, timeout=30) as http:
            answer = await http.post("/v1/embeddings", json={"model": "tiny-chat", "input": "x"})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-peer-node"] == "c"
        assert fleet["a"].dispatch.prefix_routes == {("tiny", "no_prefix"): 1}


async def test_least_outstanding_deployments_are_not_prefix_routed(tmp_path: Path) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("b", [fleet.replica("b"), fleet.replica("c")])
        for prompt in range(6):
            answer = await post(fleet["b"].host.gateway_url, body(prompt, "q"))
            assert answer.headers["x-sbproxy-route-class"] == "local"
        assert not fleet["b"].dispatch.prefix_routes
