"""An engine's port taken by a foreign process, and an engine that leaves its output pipe
held by a process it left behind: the readiness wait never sends a request to a socket that
is not our child's, and settling an exited engine never raises a stray cancellation."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest

from sbproxy.model_host.engines import EngineError, minimal_env, spawn_engine
from sbproxy.model_host.engines.process import EngineProcess, port_is_listening
from sbproxy.workflows import WorkerIdentity, process_start_ticks
from tests.model_host.engines.support import fake_llama_server, free_port

pytestmark = pytest.mark.anyio


class _Foreign(BaseHTTPRequestHandler):
    hits: list[str]

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return


@contextlib.contextmanager
def foreign_listener() -> Iterator[tuple[int, list[str]]]:
    """A listener of another process-like owner that answers 200 to anything; its port and
    the paths it was asked for."""
    hits: list[str] = []
    handler = type("Foreign", (_Foreign,), {"hits": hits})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


def script(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "engine.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


async def spawn(tmp_path: Path, executable: Path, port: int) -> EngineProcess:
    return await spawn_engine(
        [str(executable), "--model", "/m.gguf", "--host", "127.0.0.1", "--port", str(port)],
        env=minimal_env(),
        log_path=tmp_path / "logs" / "engine.log",
        owned_dir=tmp_path / "owned",
        label="local/1",
        identity=WorkerIdentity.current(),
    )


async def test_an_engine_that_never_binds_next_to_a_foreign_listener_sends_it_nothing(
    tmp_path: Path,
) -> None:
    with foreign_listener() as (port, hits):
        process = await spawn(tmp_path, script(tmp_path / "bin", "exec sleep 60\n"), port)
        with pytest.raises(EngineError) as info:
            await process.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=10, port=port)
        assert info.value.code == "engine_port_lost"
        assert hits == []
        assert process_start_ticks(process.pid) is None  # stopped


async def test_an_engine_that_exits_on_a_taken_port_reports_it_lost_and_sends_nothing(
    tmp_path: Path,
) -> None:
    executable = fake_llama_server(tmp_path / "bin")  # exits: the bind fails
    with foreign_listener() as (port, hits):
        process = await spawn(tmp_path, executable, port)
        with pytest.raises(EngineError) as info:
            await process.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=20, port=port)
        assert info.value.code == "engine_port_lost"
        assert hits == []


async def test_the_engine_own_listener_is_asked_and_found_ready(tmp_path: Path) -> None:
    port = free_port()
    process = await spawn(tmp_path, fake_llama_server(tmp_path / "bin"), port)
    await process.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=20, port=port)
    assert process.port_holder(port) == "ours"
    assert port_is_listening(port)
    await process.shutdown(grace_s=5)
    assert process.port_holder(port) == "none"


async def test_an_exited_engine_whose_pipe_a_leftover_holds_settles_every_time(
    tmp_path: Path,
) -> None:
    """The leftover (a detached ``sleep``) keeps the engine's stdout open after it exits;
    the readiness wait must end with ``engine_early_exit``, and settling again (shutdown,
    twice) must not raise the reader's cancellation into the caller."""
    pidfile = tmp_path / "leftover.pid"
    body = f'( setsid sleep 60 & echo $! > "{pidfile}" )\necho starting\nexit 1\n'
    port = free_port()
    process = await spawn(tmp_path, script(tmp_path / "bin", body), port)
    try:
        with pytest.raises(EngineError) as info:
            await process.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=20, port=port)
        assert info.value.code == "engine_early_exit"
        with anyio.fail_after(10):
            await process.shutdown(grace_s=1)
            await process.shutdown(grace_s=1)
        assert not process.record_path.exists()
        assert "starting" in process.stderr_tail()
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_port_is_listening_sees_a_listener_of_this_process() -> None:
    with foreign_listener() as (port, hits):
        assert port_is_listening(port)
        assert hits == []
    assert not port_is_listening(port)
