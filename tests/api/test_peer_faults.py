"""Peer dispatch under a peer's faults, between real hosts on loopback (issue 30, items 10, 14
and 25): a replica that left a request unanswered past the first-token limit is picked last;
a peer that refuses the fleet credential is passed over, with a warning on both sides; a hop
whose request reached the peer is never sent again, to it or to another peer."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.api.fleet_hosts import COOLDOWN_S, fleet_of, stand_in_peer
from tests.api.test_peer_dispatch import CHAT, STREAM, post, served_by
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

# The deployment's first-token limit on a host that does not run it itself (its defaults:
# `first_token_timeout_ms` 120 000).
FIRST_TOKEN_S = 120.0


@pytest.mark.parametrize("first", [CHAT, STREAM], ids=["plain", "stream"])
async def test_a_replica_holding_a_request_past_the_first_token_limit_is_picked_last(
    tmp_path: Path, first: dict[str, object]
) -> None:
    async with fleet_of(tmp_path, modes={"b": "hang_completions"}) as fleet:
        a, b = fleet["a"], fleet["b"]
        # b reports itself idle and c busy: least outstanding sends the first request to b,
        # whose engine never answers it.
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=2)])
        async with httpx.AsyncClient(base_url=a.host.gateway_url, timeout=60) as http:
            hung = asyncio.create_task(http.post("/v1/chat/completions", json=first))
            await until(lambda: len(b.engine_requests()) == 1, timeout_s=20)
            assert a.dispatch.in_flight("b", "tiny") == 1
            # Inside the limit, b still counts as the less busy one (1 against 2) ...
            assert a.dispatch.pick("tiny", set()) == fleet.replica("b")
            # ... past it, b is probably hung: the busier c goes first.
            a.clock.now += FIRST_TOKEN_S + 0.1
            assert a.dispatch.pick("tiny", set()) == fleet.replica("c", active=2)
            started = time.monotonic()
            answer = await http.post("/v1/chat/completions", json=CHAT, timeout=10)
            waited = time.monotonic() - started
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-sbproxy-peer-node"] == "c"
            assert waited < 10  # well under b's queue timeout (15 s) and its limits
            assert served_by(fleet) == {"a": 0, "b": 1, "c": 1}
            hung.cancel()
        await until(lambda: a.dispatch.in_flight("b", "tiny") == 0, timeout_s=10)


async def test_a_replica_streaming_past_the_first_token_limit_is_not_taken_for_hung(
    tmp_path: Path,
) -> None:
    # A stream that has sent its first event is answered, however long it then runs.
    async with fleet_of(tmp_path, mode="token_delay_s=5") as fleet:
        a = fleet["a"]
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=2)])
        async with (
            httpx.AsyncClient(base_url=a.host.gateway_url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=STREAM) as stream,
        ):
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data:"):
                pass
            assert stream.headers["x-sbproxy-peer-node"] == "b"
            a.clock.now += FIRST_TOKEN_S + 0.1
            assert a.dispatch.pick("tiny", set()) == fleet.replica("b")


async def test_a_peer_refusing_the_fleet_credential_is_passed_over_and_both_sides_warn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sbproxy.api.peers")
    # b joined with a wrong credential: it refuses a's hops (and a would refuse b's).
    async with fleet_of(tmp_path, credentials={"b": "not-the-fleet-credential"}) as fleet:
        a = fleet["a"]
        # b reports itself idle: without the fix, a request picked for it got b's 401.
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=1)])
        for _ in range(6):
            answer = await post(a.host.gateway_url, CHAT)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-sbproxy-peer-node"] == "c"
        assert served_by(fleet) == {"a": 0, "b": 0, "c": 6}
        # Tried once, then out of this gateway's rotation for the cool-down.
        assert a.dispatch.tries[("tiny", "b", "unauthorized")] == 1
        assert a.dispatch.out_now() == ["b"]
        a.clock.now += COOLDOWN_S + 0.1
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert a.dispatch.tries[("tiny", "b", "unauthorized")] == 2
        # With no other replica, the client gets the failed dispatch, never the peer's 401.
        a.clock.now += COOLDOWN_S + 0.1
        fleet.route("a", [fleet.replica("b")])
        answer = await post(a.host.gateway_url, CHAT)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "upstream_unavailable"
        assert a.dispatch.tries[("tiny", "b", "unauthorized")] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    refused_by_b = [w for w in warnings if w.startswith("refused a peer hop from node 'a'")]
    refused_named = [w for w in warnings if w.startswith("peer b ") and "credential" in w]
    assert len(refused_by_b) == 3, warnings
    assert len(refused_named) == 3, warnings
    assert not any("not-the-fleet-credential" in w for w in warnings)


async def test_a_hop_the_peer_dropped_after_reading_it_is_not_sent_again(
    tmp_path: Path,
) -> None:
    async with (
        stand_in_peer(tmp_path / "x", mode="drop_completions") as dropping,
        fleet_of(tmp_path, hosting=("c",), names=("a", "c")) as fleet,
    ):
        a = fleet["a"]
        # x reads each request and closes the connection before any status line.
        fleet.route("a", [dropping.replica("x"), fleet.replica("c", active=3)])
        answer = await post(a.host.gateway_url, CHAT)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "upstream_unavailable"
        assert answer.json()["error"]["message"].startswith("peer x ")
        assert len(dropping.requests()) == 1  # one generation, not two
        assert served_by(fleet) == {"a": 0, "c": 0}  # no second peer asked
        assert a.dispatch.tries == {("tiny", "x", "lost"): 1}
        assert a.dispatch.out_now() == ["x"]
        # Out of rotation now: the next request goes to c.
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert served_by(fleet) == {"a": 0, "c": 1}


async def test_a_hop_whose_answer_broke_off_is_not_sent_to_another_peer(
    tmp_path: Path,
) -> None:
    async with (
        stand_in_peer(tmp_path / "x", mode="cut_completions") as cutting,
        fleet_of(tmp_path, hosting=("c",), names=("a", "c")) as fleet,
    ):
        a = fleet["a"]
        # x sends its answer's headers and half its body, then closes.
        fleet.route("a", [cutting.replica("x"), fleet.replica("c", active=3)])
        answer = await post(a.host.gateway_url, CHAT)
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"]["code"] == "upstream_unavailable"
        assert len(cutting.requests()) == 1
        assert served_by(fleet) == {"a": 0, "c": 0}
        assert a.dispatch.tries == {("tiny", "x", "lost"): 1}


@pytest.mark.parametrize("reached", [True, False])
async def test_a_peer_s_502_is_retried_elsewhere_only_when_its_engine_was_not_reached(
    tmp_path: Path, reached: bool
) -> None:
    """Issue 30, item 25: a peer's 502 whose engine may have run the request is the client's
    answer (a second peer would run it again); one that says its engine was not reached
    (``X-Sbproxy-Engine-Reached: no``) is retried on the next replica."""
    mode = f"peer_502={'reached' if reached else 'unreached'}"
    async with (
        stand_in_peer(tmp_path / "x", mode=mode) as failing,
        fleet_of(tmp_path, hosting=("c",), names=("a", "c")) as fleet,
    ):
        a = fleet["a"]
        fleet.route("a", [failing.replica("x"), fleet.replica("c", active=3)])
        answer = await post(a.host.gateway_url, CHAT)
        assert len(failing.requests()) == 1
        if reached:
            assert answer.status_code == 502, answer.text
            assert answer.json()["error"]["code"] == "upstream_unavailable"
            assert served_by(fleet) == {"a": 0, "c": 0}  # not run a second time
        else:
            assert answer.status_code == 200, answer.text
            assert served_by(fleet) == {"a": 0, "c": 1}
