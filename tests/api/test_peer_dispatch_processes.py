"""Peer dispatch to real ``sbproxy serve`` processes (each its own cache, stand-in engine and
fleet credential from the environment), killed with SIGKILL: a peer that dies after the
first byte ends the client's stream with an error event and is not retried; a dead peer is
retried elsewhere before the first byte and leaves the rotation. A request the calling
host's own replica refuses spills over to a peer process, whose exported server span
continues the calling host's trace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from sbproxy.fleet.routing import PeerReplica
from tests.api.fleet_hosts import CREDENTIAL, fleet_of
from tests.api.test_otlp import Received, collector
from tests.api.test_peer_dispatch import post
from tests.api.test_peer_spill import (
    CLIENT_SPAN_ID,
    ONE_AT_A_TIME,
    TRACE_ID,
    busy,
    spilled_to,
)
from tests.api.test_serve import write_config
from tests.model_host.engines.support import free_port
from tests.support.spans import memory_spans

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

STREAM = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@dataclass
class Peer:
    name: str
    process: subprocess.Popen[str]
    url: str
    log: Path

    def engine_requests(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def kill(self) -> None:
        """SIGKILL the host and the engines it started (nothing stops them otherwise)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(self.process.pid).children(recursive=True)
            self.process.kill()
            self.process.wait()
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()


@contextlib.contextmanager
def peer(root: Path, name: str, *, env: dict[str, str] | None = None) -> Iterator[Peer]:
    """``sbproxy serve`` of deployment ``tiny`` (slow tokens), taking peer hops (``env``:
    more environment, e.g. an OTLP endpoint)."""
    gateway_port = free_port()
    log = root / name / "requests.jsonl"
    config = write_config(
        root / name,
        gateway_port,
        free_port(),
        mode=f"token_delay_s=0.3,requests_log={log}",
        host={"node": {"id": name}, "fleet": {"credential": "${FLEET_CREDENTIAL}"}},
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "PYTHONWARNINGS": "ignore",
            "FLEET_CREDENTIAL": CREDENTIAL,
            **(env or {}),
        },
    )
    found = Peer(name=name, process=process, url=f"http://127.0.0.1:{gateway_port}", log=log)
    try:
        assert process.stderr is not None
        lines = [process.stderr.readline()]
        while "gateway listening" not in lines[-1]:  # after the tracing line, when tracing
            assert len(lines) < 5 and lines[-1], lines
            lines.append(process.stderr.readline())
        yield found
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                found.kill()
        if process.stderr is not None:
            process.stderr.close()


def replica(peer: Peer, *, active: int = 0) -> PeerReplica:
    return PeerReplica(
        deployment="tiny",
        node_id=peer.name,
        base_url=peer.url,
        generation=1,
        ready=True,
        active=active,
        queued=0,
    )


async def test_a_peer_killed_mid_stream_cuts_the_stream_and_is_then_retried_around(
    tmp_path: Path,
) -> None:
    with peer(tmp_path, "b") as b, peer(tmp_path, "c") as c:
        async with fleet_of(tmp_path, hosting=(), names=("a",)) as fleet:
            a = fleet["a"]
            fleet.route("a", [replica(b), replica(c, active=3)])
            events: list[str] = []
            async with (
                httpx.AsyncClient(base_url=a.host.gateway_url, timeout=30) as http,
                http.stream("POST", "/v1/chat/completions", json=STREAM) as stream,
            ):
                assert stream.status_code == 200
                assert stream.headers["x-sbproxy-route-class"] == "peer"
                async for line in stream.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    events.append(line)
                    if len(events) == 1:
                        b.kill()  # the whole host goes, mid-stream
            assert '"model": "tiny-chat"' in events[0]
            assert '"code": "upstream_unavailable"' in events[-1]
            assert "[DONE]" not in "".join(events)
            assert a.dispatch.tries[("tiny", "b", "cut")] == 1
            assert c.engine_requests() == 0  # bytes had reached the client: no retry
            assert a.dispatch.in_flight("b", "tiny") == 0
            # The next request: b is still in the table (membership has not noticed), its
            # port refuses; c answers, and b is out of a's rotation.
            async with httpx.AsyncClient(base_url=a.host.gateway_url, timeout=30) as http:
                answer = await http.post("/v1/chat/completions", json={**STREAM, "stream": False})
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "tiny-chat"
            assert a.dispatch.tries[("tiny", "b", "unreachable")] == 1
            assert a.dispatch.tries[("tiny", "c", "answered")] == 1
            assert a.dispatch.out_now() == ["b"]
            assert c.engine_requests() == 1


def exported_chat_spans(received: Received) -> list[Span]:
    """The ``POST /v1/chat/completions`` spans a process exported over OTLP."""
    found: list[Span] = []
    for _, _, body in received.posts:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                found.extend(s for s in scope.spans if s.name == "POST /v1/chat/completions")
    return found


async def test_a_spill_over_to_a_peer_process_continues_the_callers_trace(
    tmp_path: Path,
) -> None:
    spans = memory_spans()  # the calling host (this process) traces in memory
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
    with (
        collector() as (endpoint, received),
        peer(tmp_path, "c", env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}) as c,
    ):
        async with fleet_of(
            tmp_path,
            hosting=("a",),
            names=("a",),
            tiny=ONE_AT_A_TIME,
            modes={"a": "token_delay_s=5"},
        ) as fleet:
            a = fleet["a"]
            fleet.route("a", [fleet.replica("a"), replica(c)])
            async with busy(a):
                answer = await post(
                    a.host.gateway_url,
                    {**STREAM, "stream": False},
                    traceparent=traceparent,
                    tracestate="vendor=opaque-value",
                )
            spilled_to(answer, "c", "queue_full")
            assert c.engine_requests() == 1
        c.process.send_signal(signal.SIGTERM)  # its exit flushes the batched spans
        assert c.process.wait(timeout=30) == 0
    (caller,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == "POST /v1/chat/completions"
        and (s.attributes or {}).get("sbproxy.peer.node") == "c"
    ]
    assert (caller.attributes or {})["sbproxy.peer.spilled"] == "queue_full"
    (hop,) = [s for s in spans.get_finished_spans() if s.name == "peer hop"]
    assert hop.parent is not None and hop.parent.span_id == caller.context.span_id
    (exported,) = exported_chat_spans(received)
    assert exported.trace_id.hex() == TRACE_ID
    assert exported.parent_span_id.hex() == f"{hop.context.span_id:016x}"
    assert exported.trace_state == "vendor=opaque-value"
