"""Peer dispatch between real hosts on loopback (issue 20, "Peer dispatch"): each host a
real runtime with its own stand-in engine and real gateway listener; the routing tables are
static (the input under test). Host ``a`` has no replica of ``tiny``; ``b`` and ``c`` do."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from sbproxy.api.peers import PEER_HOP
from sbproxy.config import ApiKeyRecord
from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import COOLDOWN_S, CREDENTIAL, Fleet, Member, fleet_of
from tests.api.support import ADMIN, TINY
from tests.model_host.engines.support import free_port
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

CHAT: dict[str, object] = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
STREAM: dict[str, object] = {**CHAT, "stream": True}


def served_by(fleet: Fleet) -> dict[str, int]:
    """How many requests each member's engine received."""
    return {name: len(m.engine_requests()) for name, m in fleet.members.items()}


async def post(url: str, body: dict[str, object], **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post("/v1/chat/completions", json=body, headers=headers)


async def stream_killing_engine(url: str, victim: Member) -> tuple[str, list[str]]:
    """Stream a chat from the gateway at ``url``, SIGKILL ``victim``'s engine once the first
    event arrived, and read the stream to its end: the answer's route class and its events."""
    events: list[str] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=STREAM) as stream,
    ):
        async for line in stream.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line)
            if len(events) == 1:
                process = victim.host.host.manager.deployment("tiny").process
                assert process is not None
                os.kill(process.pid, signal.SIGKILL)
    return stream.headers["x-sbproxy-route-class"], events


async def test_a_host_without_the_deployment_answers_through_a_peer(tmp_path: Path) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("a", [fleet.replica("b")])
        answer = await post(fleet["a"].host.gateway_url, CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-route-class"] == "peer"
        assert answer.json()["model"] == "tiny-chat"
        assert answer.json()["choices"][0]["message"]["content"] == "fake reply from the stand-in"
        assert served_by(fleet) == {"a": 0, "b": 1, "c": 0}
        assert fleet["a"].dispatch.tries == {("tiny", "b", "answered"): 1}
        assert fleet["a"].dispatch.in_flight("b", "tiny") == 0


async def test_the_model_list_of_a_host_without_the_deployment_shows_the_fleets(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", ready=False)])
        async with httpx.AsyncClient(base_url=fleet["a"].host.gateway_url) as http:
            listed = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["tiny-chat"]
        assert listed[0]["availability"] == {
            "state": "ready",
            "ready_replicas": 1,
            "desired_replicas": 2,
        }


async def test_a_local_replica_is_served_first_however_busy_the_peers_say_it_is(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("b", [fleet.replica("b", active=9, queued=9), fleet.replica("c")])
        for _ in range(3):
            answer = await post(fleet["b"].host.gateway_url, CHAT)
            assert answer.status_code == 200
            assert answer.headers["x-sbproxy-route-class"] == "local"
        assert served_by(fleet) == {"a": 0, "b": 3, "c": 0}
        assert not fleet["b"].dispatch.tries


async def test_the_peer_with_the_fewest_outstanding_requests_is_picked(tmp_path: Path) -> None:
    # Streams of 25 s (5 tokens, 5 s apart): the two held open below are still in flight
    # when the last request is picked, however slow the machine.
    async with fleet_of(tmp_path, mode="token_delay_s=5") as fleet:
        a = fleet["a"]
        # The counts the replicas reported: b is busier.
        fleet.route("a", [fleet.replica("b", active=2, queued=1), fleet.replica("c", active=1)])
        for _ in range(2):
            assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert served_by(fleet) == {"a": 0, "b": 0, "c": 2}
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", queued=4)])
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert served_by(fleet) == {"a": 0, "b": 1, "c": 2}
        # This gateway's own requests in flight count on top of what the replicas reported:
        # two streams held open to b (reported idle) outweigh c's one reported request.
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=5)])
        async with (
            httpx.AsyncClient(base_url=a.host.gateway_url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=STREAM) as first,
            http.stream("POST", "/v1/chat/completions", json=STREAM) as second,
        ):
            # Each stream read to its first event, its reader kept: an abandoned reader closes
            # its response whenever it is collected, and the stream would end then.
            readers = [first.aiter_lines(), second.aiter_lines()]
            for reader in readers:
                while not (await anext(reader)).startswith("data:"):
                    pass
            assert a.dispatch.in_flight("b", "tiny") == 2
            fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=1)])
            assert (await post(a.host.gateway_url, CHAT)).status_code == 200
            assert served_by(fleet) == {"a": 0, "b": 3, "c": 3}
        await until(lambda: a.dispatch.in_flight("b", "tiny") == 0, timeout_s=5)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", STREAM),
        (
            "/v1/chat/completions",
            {**STREAM, "stream_options": {"include_usage": True}},
        ),
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi", "stream": True}),
    ],
    ids=["chat", "chat-with-usage", "completion"],
)
async def test_a_stream_through_a_peer_is_byte_for_byte_the_direct_stream(
    tmp_path: Path, path: str, body: dict[str, object]
) -> None:
    async with fleet_of(tmp_path, hosting=("b",), names=("a", "b")) as fleet:
        streams: list[bytes] = []
        for member in ("b", "a"):  # direct (local on b), then through a to b
            async with httpx.AsyncClient(
                base_url=fleet[member].host.gateway_url, timeout=30
            ) as http:
                answer = await http.post(path, json=body)
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            streams.append(answer.content)
        direct, through = streams
        assert b"[DONE]" in direct
        assert through == direct
        assert served_by(fleet) == {"a": 0, "b": 2}
        # The hop always carried the usage event; a dropped it when its client had not asked.
        asked = path == "/v1/completions" or "stream_options" in body
        assert (b'"usage"' in through) == asked


async def test_a_dead_peer_is_retried_elsewhere_and_left_out_until_its_cool_down_ends(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path) as fleet:
        a = fleet["a"]
        dead = PeerReplica(
            deployment="tiny",
            node_id="d",
            base_url=f"http://127.0.0.1:{free_port()}",  # nobody listens
            generation=1,
            ready=True,
            active=0,
            queued=0,
        )
        fleet.route("a", [dead, fleet.replica("b", active=5)])
        answer = await post(a.host.gateway_url, CHAT)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-route-class"] == "peer"
        assert a.dispatch.tries[("tiny", "d", "unreachable")] == 1
        assert a.dispatch.tries[("tiny", "b", "answered")] == 1
        assert a.dispatch.out_now() == ["d"]
        async with httpx.AsyncClient(base_url=a.host.admin_url, auth=ADMIN) as admin:
            metrics = (await admin.get("/metrics")).text
        assert "sbproxy_gateway_peers_out_of_rotation 1.0" in metrics
        labels = '{deployment="tiny",node="d",outcome="unreachable"}'
        assert f"sbproxy_gateway_peer_requests_total{labels} 1.0" in metrics
        # Out of rotation: not tried again while the cool-down lasts (membership has not
        # noticed: the table still says ready).
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert a.dispatch.tries[("tiny", "d", "unreachable")] == 1
        a.clock.now += COOLDOWN_S - 0.1
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert a.dispatch.tries[("tiny", "d", "unreachable")] == 1
        a.clock.now += 0.2  # past the cool-down: in rotation again, and tried first
        assert (await post(a.host.gateway_url, CHAT)).status_code == 200
        assert a.dispatch.tries[("tiny", "d", "unreachable")] == 2
        assert served_by(fleet) == {"a": 0, "b": 4, "c": 0}


async def test_a_hung_peer_runs_out_the_limit_and_leaves_the_rotation(tmp_path: Path) -> None:
    # a knows the deployment (its limits) but the table places it elsewhere only: on a peer
    # that accepts connections and never answers (its listen backlog takes them).
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        port = hung.getsockname()[1]
        tiny = {**TINY, "request_timeout_ms": 1000}
        async with fleet_of(tmp_path, hosting=("a",), names=("a",), tiny=tiny) as fleet:
            a = fleet["a"]
            a.directory.replicas = {
                "tiny": (PeerReplica("tiny", "h", f"http://127.0.0.1:{port}", 1, True, 0, 0),)
            }
            started = time.monotonic()
            answer = await post(a.host.gateway_url, CHAT)
            waited = time.monotonic() - started
            assert answer.status_code == 504
            assert answer.json()["error"]["code"] == "engine_timeout"
            # The deployment's limit plus the margin that lets a live peer answer first.
            assert 1.5 < waited < 10, waited
            assert a.dispatch.tries == {("tiny", "h", "timed_out"): 1}
            assert a.dispatch.out_now() == ["h"]
            assert a.dispatch.in_flight("h", "tiny") == 0
            answer = await post(a.host.gateway_url, CHAT)
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "no_ready_replica"
            assert fleet["a"].engine_requests() == []  # never started here


async def test_a_peer_refusing_before_its_answer_is_retried_on_another(tmp_path: Path) -> None:
    async with fleet_of(tmp_path, modes={"b": "exit_at_start"}) as fleet:
        a = fleet["a"]
        # b's engine cannot start: b refuses with a 503 before anything reached a's client;
        # c answers.
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=3)])
        answer = await post(a.host.gateway_url, CHAT)
        assert answer.status_code == 200, answer.text
        assert a.dispatch.tries[("tiny", "b", "refused")] == 1
        assert a.dispatch.tries[("tiny", "c", "answered")] == 1
        assert a.dispatch.out_now() == []  # b itself answered: it stays in rotation


async def test_no_retry_once_a_byte_reached_the_client(tmp_path: Path) -> None:
    async with fleet_of(tmp_path, mode="token_delay_s=0.5") as fleet:
        a, b = fleet["a"], fleet["b"]
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=3)])
        route_class, events = await stream_killing_engine(a.host.gateway_url, b)
        assert route_class == "peer"
        assert '"model": "tiny-chat"' in events[0]
        assert '"code": "upstream_unavailable"' in events[-1]
        assert "[DONE]" not in "".join(events)
        assert served_by(fleet) == {"a": 0, "b": 1, "c": 0}  # never sent to c
        await until(lambda: a.dispatch.in_flight("b", "tiny") == 0, timeout_s=5)


async def test_a_peer_hop_without_the_fleet_credential_is_refused(tmp_path: Path) -> None:
    async with fleet_of(tmp_path, hosting=("b",), names=("a", "b")) as fleet:
        b = fleet["b"].host.gateway_url
        for headers in (
            {PEER_HOP: "a"},
            {PEER_HOP: "a", "Authorization": "Bearer not-the-fleet-credential"},
            {PEER_HOP: "a", "Authorization": "Basic " + CREDENTIAL},
        ):
            answer = await post(b, CHAT, **headers)
            assert answer.status_code == 401
            error = answer.json()["error"]
            assert error["code"] == "peer_unauthorized"
            assert CREDENTIAL not in answer.text
        answer = await post(b, CHAT, **{PEER_HOP: "a", "Authorization": f"Bearer {CREDENTIAL}"})
        assert answer.status_code == 200
        assert served_by(fleet) == {"a": 0, "b": 1}


async def test_a_host_without_a_credential_takes_no_hop_and_sends_none(tmp_path: Path) -> None:
    async with fleet_of(tmp_path, hosting=("b",), names=("a", "b"), credential=None) as fleet:
        hop = {PEER_HOP: "a", "Authorization": f"Bearer {CREDENTIAL}"}
        answer = await post(fleet["b"].host.gateway_url, CHAT, **hop)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "peer_unauthorized"
        answer = await post(fleet["a"].host.gateway_url, CHAT)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_ready_replica"
        assert served_by(fleet) == {"a": 0, "b": 0}


async def test_usage_and_budgets_are_counted_once_on_the_host_the_client_called(
    tmp_path: Path,
) -> None:
    key = ApiKeyRecord(name="team", key=SecretStr("sk-team-0123456789abcdef"))
    async with fleet_of(tmp_path, keys=[key]) as fleet:
        a, b = fleet["a"], fleet["b"]
        fleet.route("a", [fleet.replica("b")])
        auth = {"Authorization": "Bearer sk-team-0123456789abcdef"}
        assert (await post(a.host.gateway_url, CHAT, **auth)).status_code == 200
        async with httpx.AsyncClient(base_url=a.host.gateway_url, timeout=30) as http:
            streamed = await http.post("/v1/chat/completions", json=STREAM, headers=auth)
        assert streamed.status_code == 200
        assert b'"usage"' not in streamed.content  # dropped for the client, counted on a
        # Plain: 5 prompt + 5 completion tokens; streamed: the same from the usage event.
        assert a.host.gateway.usage.tokens_since_start() == {
            ("team", "prompt"): 10,
            ("team", "completion"): 10,
        }
        assert not any(b.host.gateway.usage.tokens_since_start().values())
        assert served_by(fleet) == {"a": 0, "b": 2, "c": 0}
        # Without its key, a's client is refused on a; the peer never sees it.
        assert (await post(a.host.gateway_url, CHAT)).status_code == 401
        assert served_by(fleet)["b"] == 2


async def test_a_hop_is_never_passed_on(tmp_path: Path) -> None:
    async with fleet_of(tmp_path) as fleet:
        hop = {PEER_HOP: "c", "Authorization": f"Bearer {CREDENTIAL}"}
        # a has no replica: its table lists b and c, but a hop is served here or not at all.
        answer = await post(fleet["a"].host.gateway_url, CHAT, **hop)
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_ready_replica"
        assert answer.headers["retry-after"]
        # b runs its replica (warmed by a request of its own client): a hop is served there
        # even when b's table, a heartbeat behind, still lists it not ready and c's ready.
        assert (await post(fleet["b"].host.gateway_url, CHAT)).status_code == 200
        fleet.route("b", [fleet.replica("b", ready=False), fleet.replica("c")])
        answer = await post(fleet["b"].host.gateway_url, CHAT, **hop)
        assert answer.status_code == 200
        assert answer.headers["x-sbproxy-route-class"] == "local"
        assert served_by(fleet) == {"a": 0, "b": 2, "c": 0}
        assert not fleet["a"].dispatch.tries
        assert not fleet["b"].dispatch.tries


async def test_a_replica_listed_not_ready_is_never_started_by_a_request(tmp_path: Path) -> None:
    # b's table lists its own replica not ready (as a node that fenced itself lists it) and
    # no other: neither b's client nor a peer's hop starts b's engine.
    async with fleet_of(tmp_path) as fleet:
        b = fleet["b"]
        fleet.route("b", [fleet.replica("b", ready=False), fleet.replica("c", ready=False)])
        hop = {PEER_HOP: "a", "Authorization": f"Bearer {CREDENTIAL}"}
        for headers in ({}, hop):
            answer = await post(b.host.gateway_url, CHAT, **headers)
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "no_ready_replica"
        assert b.host.host.manager.snapshot("tiny").generation == 0  # never launched
        assert served_by(fleet) == {"a": 0, "b": 0, "c": 0}
        # Listed ready again (idle and loadable): the next request starts it.
        fleet.route("b", [fleet.replica("b"), fleet.replica("c", ready=False)])
        answer = await post(b.host.gateway_url, CHAT)
        assert answer.status_code == 200
        assert answer.headers["x-sbproxy-route-class"] == "local"


async def test_no_ready_replica_anywhere_is_a_retryable_503(tmp_path: Path) -> None:
    async with fleet_of(tmp_path) as fleet:
        fleet.route("a", [fleet.replica("b", ready=False), fleet.replica("c", ready=False)])
        answer = await post(fleet["a"].host.gateway_url, CHAT)
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert (error["code"], error["retryable"]) == ("no_ready_replica", True)
        assert answer.headers["retry-after"] == "1"
        assert served_by(fleet) == {"a": 0, "b": 0, "c": 0}
