"""OTLP export: ``sbproxy serve`` with OTEL_EXPORTER_OTLP_ENDPOINT sends its spans to a real
local HTTP collector (POST /v1/traces, protobuf); without it nothing is sent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port


@dataclass
class Received:
    posts: list[tuple[str, str, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def collector() -> Iterator[tuple[str, Received]]:
    """A minimal OTLP/HTTP collector on loopback that records every POST."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with received.lock:
                received.posts.append((self.path, self.headers.get("Content-Type", ""), body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def exported_spans(received: Received) -> list[tuple[str, dict[str, Any]]]:
    spans: list[tuple[str, dict[str, Any]]] = []
    for path, content_type, body in received.posts:
        assert path == "/v1/traces"
        assert content_type == "application/x-protobuf"
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: a.value for a in span.attributes}
                    spans.append((span.name, attributes))
    return spans


def run_serve(root: Path, endpoint: str | None) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(root, gateway_port, admin_port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONWARNINGS"] = "ignore"
    if endpoint is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        lines: list[str] = []
        while not any("admin listening" in line for line in lines):
            lines.append(process.stderr.readline())
            assert len(lines) < 10 and lines[-1], lines
        answer = httpx.post(
            f"http://localhost:{gateway_port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer not-a-configured-key-but-keyless"},
            timeout=30,
        )
        assert answer.status_code == 200
        status = httpx.get(
            f"http://127.0.0.1:{admin_port}/admin/model-host/status", auth=("admin", PASSWORD)
        )
        assert status.status_code == 200
        process.send_signal(signal.SIGTERM)  # the exit flushes the batched spans
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


@pytest.mark.slow
def test_serve_exports_request_spans_to_an_otlp_collector(tmp_path: Path) -> None:
    with collector() as (endpoint, received):
        run_serve(tmp_path, endpoint)
    spans = exported_spans(received)
    names = [name for name, _ in spans]
    assert "POST /v1/chat/completions" in names, names
    assert "GET /admin/model-host/status" in names, names
    assert "job load" in names, names  # the cold start's load job, in the same export
    (chat,) = [attrs for name, attrs in spans if name == "POST /v1/chat/completions"]
    assert chat["http.response.status_code"].int_value == 200
    assert chat["sbproxy.deployment"].string_value == "tiny"
    assert chat["sbproxy.model"].string_value == "tiny-chat"
    assert chat["gen_ai.usage.output_tokens"].int_value == 5
    for _, _, body in received.posts:  # the presented bearer token never leaves the process
        assert b"not-a-configured-key" not in body


@pytest.mark.slow
def test_serve_sends_nothing_without_an_endpoint(tmp_path: Path) -> None:
    with collector() as (_, received):
        run_serve(tmp_path, None)
    assert received.posts == []
