"""A served host whose PostgreSQL journal goes away keeps serving: the gateway and the
status route answer, a mutation that needs the journal is ``503 journal_unavailable``
naming ``host:port`` -- within a bound even when the server goes silent (a blackholed
link) rather than away -- and once the server is back the same host runs the mutation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.api.support import ADMIN, TINY, served
from tests.api.test_serve import PASSWORD, write_config
from tests.model_host.engines.support import free_port
from tests.support.cli import stop_process
from tests.support.postgres import PostgresServer
from tests.support.tcp_relay import TcpRelay

# What docs/operations.md promises a client in a silent outage (a mutation answers 503 by
# then), with slack for this shared machine.
HTTP_BOUND_S = 15.0 + 3.0


async def chat(gateway_url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{gateway_url}/v1/chat/completions",
            json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
        )


@pytest.mark.anyio
async def test_serving_goes_on_while_the_journal_is_away(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    url = own_postgres_server.create_database()
    host = {"journal": {"url": url}, "cache": {"budget_gib": 1}}
    warm = {"tiny": {**TINY, "warm": True}}
    async with (
        served(tmp_path, deployments=warm, model_host=host) as s,
        httpx.AsyncClient(auth=ADMIN, timeout=30) as admin,
    ):
        assert (await admin.post(f"{s.admin_url}/admin/model-host/gc")).status_code == 200
        assert (await chat(s.gateway_url)).status_code == 200  # loaded (its load job done)

        own_postgres_server.stop_server("fast")
        refused = await admin.post(f"{s.admin_url}/admin/model-host/gc")
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "journal_unavailable"
        assert f"127.0.0.1:{own_postgres_server.port}" in refused.text, refused.text
        status = await admin.get(f"{s.admin_url}/admin/model-host/status")
        assert status.status_code == 200
        answer = await chat(s.gateway_url)
        assert answer.status_code == 200, answer.text  # the loaded engine still serves

        own_postgres_server.start_server()
        again = await admin.post(f"{s.admin_url}/admin/model-host/gc")
        assert again.status_code == 200, again.text


@dataclass
class RelayedServe:
    """A real ``sbproxy serve`` whose journal is reached through :attr:`relay`."""

    relay: TcpRelay
    process: subprocess.Popen[str]
    admin_url: str
    log: Path


@contextmanager
def _serve_relayed(
    root: Path, server: PostgresServer, *, mode: str | None = None
) -> Iterator[RelayedServe]:
    """A real ``sbproxy serve`` (its stand-in engine in ``mode``) on a fresh database of
    ``server``, reached through a :class:`TcpRelay` the test can cut; stopped (SIGTERM, then
    SIGKILL) and the relay closed at the end."""
    url = server.create_database()
    with TcpRelay(server.port) as relay:
        through = url.replace(f":{server.port}/", f":{relay.port}/", 1)
        gateway_port, admin_port = free_port(), free_port()
        config = write_config(
            root, gateway_port, admin_port, mode=mode, host={"journal": {"url": through}}
        )
        log = root / "serve.log"
        with log.open("w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "sbproxy.cli", "serve", "-f", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore", "SBPROXY_NODE_ID": "node-a"},
            )
        try:
            yield RelayedServe(relay, process, f"http://127.0.0.1:{admin_port}", log)
        finally:
            relay.close()
            stop_process(process)


def _until(predicate: Callable[[], bool], *, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def answers(admin: httpx.Client, admin_url: str) -> bool:
    try:
        return admin.get(f"{admin_url}/admin/model-host/status").status_code == 200
    except httpx.TransportError:
        return False


def test_a_silent_journal_answers_a_load_503_in_time_and_status_goes_on(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    with _serve_relayed(tmp_path, postgres_server) as served:
        relay, process, admin_url, log = served.relay, served.process, served.admin_url, served.log
        with httpx.Client(auth=("admin", PASSWORD), timeout=60) as admin:

            def ready() -> bool:
                assert process.poll() is None, log.read_text()
                try:
                    status = admin.get(f"{admin_url}/admin/model-host/status")
                except httpx.TransportError:
                    return False
                rows = status.json()["deployments"] if status.status_code == 200 else []
                return any(row["state"] == "ready" for row in rows)

            load = {"deployment": "tiny"}
            _until(lambda: answers(admin, admin_url), what="the admin route answers")
            first = admin.post(f"{admin_url}/admin/model-host/load", json=load)
            assert first.status_code == 202, first.text
            _until(ready, what="tiny is ready")

            relay.blackhole()
            started = time.monotonic()
            refused = admin.post(f"{admin_url}/admin/model-host/load", json=load)
            took = time.monotonic() - started
            assert refused.status_code == 503, refused.text
            assert refused.json()["code"] == "journal_unavailable", refused.text
            assert f"127.0.0.1:{relay.port}" in refused.text, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert took < HTTP_BOUND_S, took
            # An outage its caller was told of is logged as a warning, not an error.
            refusal = "load command of tiny failed"
            _until(lambda: refusal in log.read_text(), what="the refusal logged")
            [line] = [x for x in log.read_text().splitlines() if refusal in x]
            assert " WARNING " in line and "[journal_unavailable]" in line, line
            status = admin.get(f"{admin_url}/admin/model-host/status", timeout=HTTP_BOUND_S)
            assert status.status_code == 200, status.text  # status answers on

            served.relay.heal()
            again = admin.post(f"{admin_url}/admin/model-host/load", json=load)
            assert again.status_code == 202, again.text


def test_a_stop_while_the_journal_is_cut_logs_its_unrecorded_transitions_as_one_warning(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # The stop's deployment transitions (ready -> draining -> stopped) go on the load job
    # that started the engine; with the journal away they cannot be recorded: a warning
    # with the reason code per batch, no ERROR and no traceback, and the process exits 0.
    with _serve_relayed(tmp_path, postgres_server) as served:
        process, admin_url, log = served.process, served.admin_url, served.log
        with httpx.Client(auth=("admin", PASSWORD), timeout=60) as admin:
            _until(lambda: answers(admin, admin_url), what="the admin route answers")
            load = admin.post(f"{admin_url}/admin/model-host/load", json={"deployment": "tiny"})
            assert load.status_code == 202, load.text
            job_id = load.json()["job_id"]
            job_url = f"{admin_url}/admin/model-host/jobs/{job_id}"
            _until(
                lambda: admin.get(job_url).json()["job"]["status"] == "succeeded",
                what="the load job done",
            )
        served.relay.cut()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert "draining -> stopped" in text, text
    assert "Traceback" not in text and " ERROR " not in text, text
    unrecorded = [line for line in text.splitlines() if "deployment transition(s)" in line]
    assert unrecorded, text
    assert all(" WARNING " in x and "[journal_unavailable]" in x for x in unrecorded), unrecorded


def test_a_load_followed_through_a_journal_outage_is_followed_to_its_end(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    # `models load --wait` follows its job; the journal goes away meanwhile, so following
    # it answers 503 journal_unavailable for a while. The CLI says so once and follows on;
    # the job resumes once the journal is back, and the CLI ends with it (exit 0).
    hold = tmp_path / "hold"
    hold.touch()  # the engine stays loading (the job in its launch step) while it exists
    with _serve_relayed(tmp_path, postgres_server, mode=f"hold_file={hold}") as served:
        admin_url, log = served.admin_url, served.log
        stderr = tmp_path / "load.stderr"
        with httpx.Client(auth=("admin", PASSWORD), timeout=60) as admin:
            _until(lambda: answers(admin, admin_url), what="the admin route answers")
            with stderr.open("w") as err:
                load = subprocess.Popen(
                    [sys.executable, "-m", "sbproxy.cli", "models", "load", "tiny",
                     "--wait", "--format", "json"],
                    stdout=subprocess.PIPE, stderr=err, text=True,
                    env={**os.environ, "SB_ADMIN_URL": admin_url,
                         "SB_ADMIN_PASSWORD": PASSWORD},
                )  # fmt: skip

            def launching() -> bool:
                status = admin.get(f"{admin_url}/admin/model-host/status").json()
                return any(row["state"] == "preparing" for row in status["deployments"])

            _until(launching, what="the load under way")
            served.relay.cut()
            _until(
                lambda: "still following job" in stderr.read_text() or load.poll() is not None,
                what="the note",
            )
            assert load.poll() is None, stderr.read_text()  # it did not give up
            served.relay.heal()
            hold.unlink()
            out, _ = load.communicate(timeout=120)
        assert load.returncode == 0, (stderr.read_text(), log.read_text())
        body = json.loads(out)
        assert (body["state"], body["job"]["status"]) == ("ready", "succeeded"), body
        [note] = stderr.read_text().splitlines()
        assert "journal_unavailable" in note and body["job_id"] in note, note
