"""``sbproxy serve`` when a foreign process takes its engine's port: the server stays up,
relaunches on another port, never routes to (or probes) the foreign process, and exits only
when it is told to."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port

pytestmark = pytest.mark.slow

FOREIGN = textwrap.dedent(
    """
    import http.server, sys

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with open(sys.argv[2], "a") as hits:
                hits.write(self.path + "\\n")
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Answer)
    open(sys.argv[3], "w").close()  # listening
    server.serve_forever()
    """
)


def hostile_engine(root: Path) -> tuple[Path, Path]:
    """Wrap the stand-in engine: its first launch starts a detached foreign listener on the
    port it was given (which keeps the engine's output pipe open, as a leftover helper
    would) and then runs the stand-in, which cannot bind that port and exits. Later launches
    run the stand-in alone. The foreign listener's hit log and pid file."""
    engine = root / "bin" / "llama-server"
    stand_in = engine.read_text().split("\n", 1)[1]
    listener = root / "bin" / "foreign.py"
    listener.write_text(FOREIGN)
    hits, pidfile, marker = root / "hits.log", root / "foreign.pid", root / "first-launch"
    listening = root / "foreign.listening"
    engine.write_text(
        "#!/bin/sh\n"
        'port=""; previous=""\n'
        'for arg in "$@"; do [ "$previous" = "--port" ] && port="$arg"; previous="$arg"; done\n'
        f'if [ -n "$port" ] && [ ! -e "{marker}" ]; then\n'
        f'  touch "{marker}"\n'
        f'  ( setsid "{sys.executable}" "{listener}" "$port" "{hits}" "{listening}" &\n'
        f'    echo $! > "{pidfile}" )\n'
        f'  while [ ! -e "{listening}" ]; do sleep 0.05; done\n'
        "fi\n" + stand_in
    )
    return hits, pidfile


def test_serve_survives_a_foreign_listener_on_its_engine_port(tmp_path: Path) -> None:
    gateway_port, admin_port = free_port(), free_port()
    config = write_config(tmp_path, gateway_port, admin_port)
    hits, pidfile = hostile_engine(tmp_path)
    log = (tmp_path / "serve.log").open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
        stderr=log,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        gateway = f"http://localhost:{gateway_port}"
        for _ in range(600):  # until the gateway accepts (a minute at most)
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(gateway, timeout=1)
                break
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
        answer = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "tiny-chat"
        assert pidfile.exists()  # the foreign listener did take the first port
        status = httpx.get(
            f"http://127.0.0.1:{admin_port}/admin/model-host/status", auth=("admin", PASSWORD)
        ).json()["deployments"][0]
        assert status["state"] == "ready"
        assert process.poll() is None  # still serving
        assert not hits.exists() or hits.read_text() == ""  # never probed, never routed to
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        text = (tmp_path / "serve.log").read_text()
        assert "received SIGTERM" in text
        assert "Traceback" not in text, text
        assert "was taken; retrying on another" in text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
