"""The admin verbs never send the admin password through a forward proxy to a loopback
admin API, whatever ``HTTP_PROXY`` says (the artifact downloads honour it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from sbproxy.cli.models_admin_cmd import admin_call


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        body = json.dumps({"deployments": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def admin_port() -> Iterator[int]:
    _Recorder.seen = []
    yield from _serve(_Recorder)


@pytest.fixture
def proxy_port() -> Iterator[int]:
    class _Proxy(_Recorder):
        seen: ClassVar[list[str]] = []

    yield from _serve(_Proxy)


def test_a_loopback_admin_url_is_called_directly_despite_http_proxy(
    admin_port: int, proxy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy_port}")
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy_port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    body = admin_call(
        "models.ps",
        "GET",
        f"http://127.0.0.1:{admin_port}/admin/status",
        auth=("admin", "s3cret-admin"),
        output_format="json",
    )

    assert body == {"deployments": []}
    assert _Recorder.seen == ["/admin/status"]
