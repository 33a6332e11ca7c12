"""Spill-over and trace context between real hosts on loopback (issue 20, "Peer dispatch"):
each host a real runtime with its own stand-in engine and real gateway listener; the routing
tables are static (the input under test). A client's request that its host's own replica
refuses before any byte reached the client goes to a peer's replica, counted once, on that
host; a hop never spills; a hop carries the caller's trace context."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import SecretStr

from sbproxy.api.peers import PEER_HOP
from sbproxy.config import ApiKeyRecord
from tests.api.fleet_hosts import CREDENTIAL, Member, fleet_of
from tests.api.support import ADMIN, TINY
from tests.api.test_peer_dispatch import CHAT, STREAM, post, served_by, stream_killing_engine
from tests.model_host.runtime.support import until
from tests.support.spans import memory_spans

pytestmark = pytest.mark.anyio

# One request at a time and no queue: a second request while one runs is refused queue_full.
ONE_AT_A_TIME = {**TINY, "max_concurrency": 1, "max_queue_depth": 0}
KEY = ApiKeyRecord(name="team", key=SecretStr("sk-team-0123456789abcdef"))
AUTH = {"Authorization": "Bearer sk-team-0123456789abcdef"}
HOP = {PEER_HOP: "a", "Authorization": f"Bearer {CREDENTIAL}"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@asynccontextmanager
async def busy(member: Member) -> AsyncIterator[None]:
    """``member``'s replica running one slow stream (its only slot) while the block runs."""
    async with (
        httpx.AsyncClient(base_url=member.host.gateway_url, timeout=30, headers=AUTH) as http,
        http.stream("POST", "/v1/chat/completions", json=STREAM) as held,
    ):
        assert held.headers["x-sbproxy-route-class"] == "local"
        reader = held.aiter_lines()  # kept: an abandoned reader closes the stream
        while not (await anext(reader)).startswith("data:"):
            pass
        yield


def spilled_to(answer: httpx.Response, node: str, reason: str) -> None:
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sbproxy-route-class"] == "peer"
    assert answer.headers["x-sbproxy-peer-node"] == node
    assert answer.headers["x-sbproxy-spilled"] == reason


async def test_a_full_local_queue_spills_over_to_a_peer_counted_once_on_this_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sbproxy.api.access")
    async with fleet_of(
        tmp_path,
        names=("b", "c"),
        tiny=ONE_AT_A_TIME,
        modes={"b": "token_delay_s=5"},
        keys=[KEY],
    ) as fleet:
        b, c = fleet["b"], fleet["c"]
        async with busy(b):
            plain = await post(b.host.gateway_url, CHAT, **AUTH)
            spilled_to(plain, "c", "queue_full")
            assert plain.json()["model"] == "tiny-chat"
            async with httpx.AsyncClient(base_url=b.host.gateway_url, timeout=30) as http:
                streamed = await http.post("/v1/chat/completions", json=STREAM, headers=AUTH)
            spilled_to(streamed, "c", "queue_full")
            assert served_by(fleet) == {"b": 1, "c": 2}
        assert b.dispatch.spills == {("tiny", "queue_full"): 2}
        assert b.dispatch.tries == {("tiny", "c", "answered"): 2}
        # Counted once, on the host the client called (the held stream never ended there).
        assert b.host.gateway.usage.tokens_since_start() == {
            ("team", "prompt"): 10,
            ("team", "completion"): 10,
        }
        assert not any(c.host.gateway.usage.tokens_since_start().values())
        # The spilled stream is byte for byte c's own stream, its usage event dropped for a
        # client that had not asked for it.
        async with httpx.AsyncClient(base_url=c.host.gateway_url, timeout=30) as http:
            direct = await http.post("/v1/chat/completions", json=STREAM, headers=AUTH)
        assert direct.headers["x-sbproxy-route-class"] == "local"
        assert streamed.content == direct.content
        assert b'"usage"' not in streamed.content
        async with httpx.AsyncClient(base_url=b.host.admin_url, auth=ADMIN) as admin:
            metrics = (await admin.get("/metrics")).text
        assert 'sbproxy_gateway_peer_spills_total{deployment="tiny",reason="queue_full"} 2.0' in (
            metrics
        )
    # b's access log names the node that answered and b's own refusal.
    spilled = [r.getMessage() for r in caplog.records if "spilled=" in r.getMessage()]
    assert len(spilled) == 2, spilled
    for line in spilled:
        assert line.startswith("POST /v1/chat/completions 200 deployment=tiny "), line
        assert line.endswith(" peer=c spilled=queue_full"), line


async def test_a_hop_never_spills_and_without_a_ready_peer_the_refusal_stands(
    tmp_path: Path,
) -> None:
    async with fleet_of(
        tmp_path, names=("b", "c"), tiny=ONE_AT_A_TIME, modes={"b": "token_delay_s=5"}
    ) as fleet:
        b = fleet["b"]
        async with busy(b):
            # A peer's hop: b's refusal goes back to that peer, never on to c.
            answer = await post(b.host.gateway_url, CHAT, **HOP)
            assert answer.status_code == 429
            assert answer.json()["error"]["code"] == "queue_full"
            # b's own client, with c listed not ready: b's own refusal, as a single host's.
            fleet.route("b", [fleet.replica("b"), fleet.replica("c", ready=False)])
            answer = await post(b.host.gateway_url, CHAT)
            assert answer.status_code == 429
            assert answer.json()["error"]["code"] == "queue_full"
            assert "x-sbproxy-peer-node" not in answer.headers
        assert served_by(fleet) == {"b": 1, "c": 0}
        assert not b.dispatch.spills
        assert not b.dispatch.tries


async def test_a_peer_with_a_full_queue_is_passed_over_for_the_next(tmp_path: Path) -> None:
    async with fleet_of(
        tmp_path, tiny=ONE_AT_A_TIME, modes={"b": "token_delay_s=5"}, keys=[KEY]
    ) as fleet:
        a, b = fleet["a"], fleet["b"]
        fleet.route("a", [fleet.replica("b"), fleet.replica("c", active=3)])
        async with busy(b):
            answer = await post(a.host.gateway_url, CHAT, **AUTH)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sbproxy-peer-node"] == "c"
        assert "x-sbproxy-spilled" not in answer.headers  # a has no replica of its own
        assert a.dispatch.tries == {("tiny", "b", "refused"): 1, ("tiny", "c", "answered"): 1}
        assert a.dispatch.out_now() == []  # b answered: it stays in rotation
        assert served_by(fleet) == {"a": 0, "b": 1, "c": 1}


async def test_a_local_engine_that_cannot_start_spills_over(tmp_path: Path) -> None:
    async with fleet_of(tmp_path, names=("b", "c"), modes={"b": "exit_at_start"}) as fleet:
        b = fleet["b"]
        # b's engine exits at each launch: after its bounded retries, b refuses crash_loop.
        answer = await post(b.host.gateway_url, CHAT)
        spilled_to(answer, "c", "crash_loop")
        assert b.dispatch.spills == {("tiny", "crash_loop"): 1}
        assert served_by(fleet) == {"b": 0, "c": 1}


async def test_a_local_engine_failing_after_it_read_the_request_is_not_spilled(
    tmp_path: Path,
) -> None:
    """Issue 30, item 25: b's engine reads each request, then closes the connection without
    an answer. The request may have run there, so it is not sent to c: the client gets 502
    ``upstream_unavailable``, and c never sees it."""
    async with fleet_of(tmp_path, names=("b", "c"), modes={"b": "drop_completions"}) as fleet:
        b = fleet["b"]
        for body in (CHAT, STREAM):
            answer = await post(b.host.gateway_url, body)
            assert answer.status_code == 502, answer.text
            assert answer.json()["error"]["code"] == "upstream_unavailable"
            assert "x-sbproxy-engine-reached" not in answer.headers
        assert served_by(fleet)["c"] == 0
        assert not b.dispatch.spills


async def test_a_local_stream_failing_after_its_first_byte_is_not_spilled(
    tmp_path: Path,
) -> None:
    async with fleet_of(tmp_path, names=("b", "c"), modes={"b": "token_delay_s=0.5"}) as fleet:
        b = fleet["b"]
        route_class, events = await stream_killing_engine(b.host.gateway_url, b)
        assert route_class == "local"
        assert '"code": "upstream_unavailable"' in events[-1]
        assert "[DONE]" not in "".join(events)
        assert served_by(fleet) == {"b": 1, "c": 0}
        assert not b.dispatch.spills
        assert not b.dispatch.tries


def _chat_spans(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]


async def test_a_hop_carries_the_trace_context_and_the_peers_span_continues_it(
    tmp_path: Path,
) -> None:
    spans = memory_spans()
    async with fleet_of(tmp_path, hosting=("b",), names=("a", "b")) as fleet:
        answer = await post(
            fleet["a"].host.gateway_url,
            CHAT,
            traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01",
            tracestate="vendor=opaque-value",
        )
        assert answer.headers["x-sbproxy-peer-node"] == "b"
        await until(lambda: len(_chat_spans(spans)) == 2, timeout_s=5)
    (caller,) = [s for s in _chat_spans(spans) if (s.attributes or {}).get("sbproxy.peer.node")]
    (peer,) = [s for s in _chat_spans(spans) if s is not caller]
    assert (caller.attributes or {})["sbproxy.peer.node"] == "b"
    assert f"{caller.context.trace_id:032x}" == TRACE_ID
    assert caller.parent is not None and f"{caller.parent.span_id:016x}" == CLIENT_SPAN_ID
    # The hop: a client span of the calling host, a child of its server span.
    (hop,) = [s for s in spans.get_finished_spans() if s.name == "peer hop"]
    assert hop.kind is SpanKind.CLIENT
    assert hop.parent is not None and hop.parent.span_id == caller.context.span_id
    shown = dict(hop.attributes or {})
    assert (shown["sbproxy.peer.node"], shown["sbproxy.deployment"]) == ("b", "tiny")
    assert shown["http.response.status_code"] == 200
    # The peer's server span: same trace, a child of the hop.
    assert f"{peer.context.trace_id:032x}" == TRACE_ID
    assert peer.parent is not None
    assert peer.parent.span_id == hop.context.span_id
    assert peer.parent.is_remote
    assert peer.context.trace_state.get("vendor") == "opaque-value"
    assert (peer.attributes or {})["sbproxy.deployment"] == "tiny"
