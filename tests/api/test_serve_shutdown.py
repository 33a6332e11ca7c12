"""``sbproxy serve`` stopped by a signal while a request is stuck at its engine.

Each test runs the real server process with the stand-in engine, so the signal handling,
uvicorn's graceful phase, the drain deadline and the engine stop are all the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port

DEADLINE_MS = 1500
# The contract: the process is gone within the drain deadline plus this many seconds.
EXIT_SLACK_S = 2.0


def wait_for(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Served:
    """A running ``sbproxy serve`` and everything it wrote on stderr."""

    process: subprocess.Popen[str]
    root: Path
    gateway: str
    admin: str
    stderr: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.stderr)

    def status(self) -> dict[str, object]:
        answer = httpx.get(
            f"{self.admin}/admin/model-host/status", auth=("admin", PASSWORD), timeout=5
        )
        deployment: dict[str, object] = answer.json()["deployments"][0]
        return deployment

    def engine_pid(self) -> int:
        """The pid of the one engine, from its ownership record."""
        records = list((self.root / "cache" / "engines" / "owned").glob("*.json"))
        assert len(records) == 1, records
        pid: int = json.loads(records[0].read_text())["pid"]
        return pid

    def stop(self, signum: int) -> float:
        """Send ``signum``; wait for the exit; the seconds it took."""
        sent = time.monotonic()
        self.process.send_signal(signum)
        self.process.wait(timeout=30)
        return time.monotonic() - sent


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []
    readers: list[threading.Thread] = []

    def start(*, mode: str, deadline_ms: int = DEADLINE_MS) -> Served:
        gateway_port, admin_port = free_port(), free_port()
        config = write_config(
            tmp_path,
            gateway_port,
            admin_port,
            mode=mode,
            host={"shutdown_deadline_ms": deadline_ms},
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config), "--no-watch"],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        served = Served(
            process=process,
            root=tmp_path,
            gateway=f"http://localhost:{gateway_port}",
            admin=f"http://127.0.0.1:{admin_port}",
        )
        started.append(served)
        assert process.stderr is not None
        stream = process.stderr
        listening = threading.Event()

        def read() -> None:
            for line in stream:
                served.stderr.append(line)
                if "admin listening on" in line:
                    listening.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        readers.append(reader)
        if not listening.wait(60):
            pytest.fail(f"serve did not start listening:\n{served.log()}")
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()
    for reader, served in zip(readers, started, strict=True):
        reader.join(10)  # it reads to the end of the dead process's stderr
        assert served.process.stderr is not None
        served.process.stderr.close()


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``work`` in a thread; its result (or exception) lands in the list."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def hung_request(served: Served) -> tuple[threading.Thread, list[object], int]:
    """Send a chat request the engine never answers; return once the gateway holds it at
    the engine (one active request), with the engine's pid."""
    thread, outcome = in_thread(
        lambda: httpx.post(
            f"{served.gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    )
    wait_for(
        lambda: served.status()["active_requests"] == 1,
        timeout_s=30,
        what="the request to reach the engine",
    )
    assert served.status()["state"] == "ready"
    pid = served.engine_pid()
    assert psutil.pid_exists(pid)
    return thread, outcome, pid


def assert_shutting_down(outcome: list[object]) -> None:
    assert len(outcome) == 1, outcome
    response = outcome[0]
    assert isinstance(response, httpx.Response), response
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "shutting_down"
    assert error["sbproxy_reason"] == "shutting_down"
    assert error["type"] == "managed_model_error"
    assert error["retryable"] is True
    assert response.headers["retry-after"] == "1"


def assert_stopped_cleanly(served: Served, pid: int) -> None:
    assert served.process.returncode == 0, served.log()
    assert "Traceback" not in served.log(), served.log()
    assert not psutil.pid_exists(pid), f"engine {pid} outlived the host"
    assert not list((served.root / "cache" / "engines" / "owned").glob("*.json"))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_a_hung_request_with_shutting_down_within_the_deadline(
    serve: Callable[..., Served], signum: signal.Signals
) -> None:
    # The engine ignores SIGTERM too: the host must SIGKILL it and still be in time.
    served = serve(mode="hang_completions,ignore_sigterm")
    thread, outcome, pid = hung_request(served)

    took_s = served.stop(signum)

    thread.join(10)
    deadline_s = DEADLINE_MS / 1000
    assert took_s < deadline_s + EXIT_SLACK_S, (took_s, served.log())
    assert took_s >= deadline_s - 0.05, "the request was cut before its deadline"
    assert_shutting_down(outcome)
    assert_stopped_cleanly(served, pid)
    log = served.log()
    assert f"received {signum.name}: draining" in log
    assert "have 1.5 s" in log
    assert "ending 1 request(s) still in flight" in log
    # The access log says the host ended it, with what the client got.
    [access] = [line for line in log.splitlines() if "POST /v1/chat/completions" in line]
    assert " 503 deployment=tiny " in access and access.endswith(" shutting_down"), access


def test_a_stalled_stream_ends_with_an_error_event(serve: Callable[..., Served]) -> None:
    served = serve(mode="token_delay_s=600")  # the first token, then nothing for 10 minutes
    first = threading.Event()
    lines: list[str] = []

    def stream() -> list[str]:
        with httpx.stream(
            "POST",
            f"{served.gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                first.set()
        return lines

    thread, outcome = in_thread(stream)
    assert first.wait(30), served.log()
    pid = served.engine_pid()

    took_s = served.stop(signal.SIGTERM)

    thread.join(10)
    assert took_s < DEADLINE_MS / 1000 + EXIT_SLACK_S, (took_s, served.log())
    assert outcome == [lines], outcome  # the stream ended well-formed, no transport error
    events = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["content"] == "fake"
    assert events[-1]["error"]["code"] == "shutting_down"
    assert_stopped_cleanly(served, pid)
    # Logged as ended by the host (the 200 that went out), not as a client that went away.
    [access] = [line for line in served.log().splitlines() if "POST /v1/chat/completions" in line]
    assert " 200 deployment=tiny " in access and access.endswith(" shutting_down"), access


def test_a_second_sigint_stops_at_once_and_kills_the_engine(
    serve: Callable[..., Served],
) -> None:
    served = serve(mode="hang_completions,ignore_sigterm", deadline_ms=60_000)
    thread, outcome, pid = hung_request(served)
    served.process.send_signal(signal.SIGINT)
    wait_for(lambda: "received SIGINT: draining" in served.log(), timeout_s=10, what="the drain")

    took_s = served.stop(signal.SIGINT)

    thread.join(10)
    assert took_s < EXIT_SLACK_S, (took_s, served.log())
    assert "received SIGINT again: ending every request now" in served.log()
    assert_shutting_down(outcome)
    assert_stopped_cleanly(served, pid)
    # The engine the stop killed did not fail (no failure, no restart backoff): the
    # shutdown settled its deployment stopped.
    log = served.log()
    assert "engine_health_failed" not in log, log
    assert "deployment tiny: its engine ended with the host's stop" in log, log
    assert log.rstrip().count("deployment tiny: draining -> stopped") == 1, log


def test_a_second_signal_while_the_engine_ignores_sigterm_kills_it_at_once(
    serve: Callable[..., Served],
) -> None:
    # No request in flight: the listeners close at once and the manager stops the engine,
    # whose SIGTERM grace would be 10 s here (min(what is left of 20 s + 1 s, 10)).
    served = serve(mode="ignore_sigterm", deadline_ms=20_000)
    answer = httpx.post(
        f"{served.gateway}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert answer.status_code == 200
    pid = served.engine_pid()
    logs = served.root / "cache" / "logs"
    served.process.send_signal(signal.SIGTERM)
    wait_for(
        lambda: any("SIGTERM ignored" in log.read_text() for log in logs.glob("*.log")),
        timeout_s=10,
        what="the engine to be sent SIGTERM",
    )

    took_s = served.stop(signal.SIGTERM)

    assert took_s < EXIT_SLACK_S, (took_s, served.log())
    assert "received SIGTERM again" in served.log()
    assert f"killed engine process groups [{pid}]" in served.log()
    assert_stopped_cleanly(served, pid)
