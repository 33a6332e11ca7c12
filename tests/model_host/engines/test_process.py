"""Supervised engine processes with the stand-in llama-server: readiness, early exit,
timeout, crash after ready, shutdown escalation, minimal environment, orphan reaping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sbproxy.model_host.engines import (
    EngineError,
    kill_owned,
    minimal_env,
    reap_orphans,
    spawn_engine,
)
from sbproxy.workflows import WorkerIdentity, process_start_ticks
from tests.model_host.engines.support import fake_llama_server, free_port

pytestmark = pytest.mark.anyio


async def start(tmp_path: Path, *, mode: str = "", record: Path | None = None):  # type: ignore[no-untyped-def]
    exe = fake_llama_server(tmp_path / "bin")
    port = free_port()
    extra = {"FAKE_LLAMA_MODE": mode}
    if record is not None:
        extra["FAKE_LLAMA_RECORD"] = str(record)
    process = await spawn_engine(
        [str(exe), "--model", "/m.gguf", "--host", "127.0.0.1", "--port", str(port)],
        env=minimal_env(extra),
        log_path=tmp_path / "logs" / "engine.log",
        owned_dir=tmp_path / "owned",
        label="local/1",
        identity=WorkerIdentity.current(),
    )
    return process, f"http://127.0.0.1:{port}/health"


def gone(pid: int) -> bool:
    return process_start_ticks(pid) is None


async def test_ready_then_clean_shutdown_leaves_nothing(tmp_path: Path) -> None:
    # Loading for 3 s: the first probe must land inside it even when a busy machine (the
    # suite on parallel workers) delays this test's start (0.5 s was seen to run out).
    process, health = await start(tmp_path, mode="load_s=3")
    assert await process.probe(health) == "unhealthy"  # 503 while loading
    await process.wait_ready(health, timeout_s=20)
    assert await process.probe(health) == "ready"
    assert process.record_path.exists()
    await process.shutdown(grace_s=5)
    assert gone(process.pid)
    assert not process.record_path.exists()
    assert "server is listening" in (tmp_path / "logs" / "engine.log").read_text()


async def test_probes_never_go_through_a_proxy_set_for_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy variables are for downloads: with them pointing at nothing, an engine on
    loopback is still probed directly."""
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
    process, health = await start(tmp_path)
    try:
        await process.wait_ready(health, timeout_s=20)
        assert await process.probe(health) == "ready"
    finally:
        await process.shutdown(grace_s=5)


async def test_early_exit_reports_the_output_tail(tmp_path: Path) -> None:
    process, health = await start(tmp_path, mode="exit_at_start")
    with pytest.raises(EngineError) as info:
        await process.wait_ready(health, timeout_s=20)
    assert info.value.code == "engine_early_exit"
    assert info.value.retryable
    assert "failed to load model" in str(info.value)
    assert not process.record_path.exists()


async def test_readiness_timeout_kills_the_engine(tmp_path: Path) -> None:
    process, health = await start(tmp_path, mode="hang")
    with pytest.raises(EngineError) as info:
        await process.wait_ready(health, timeout_s=1.5)
    assert info.value.code == "engine_readiness_timeout"
    assert gone(process.pid)


async def test_a_crash_after_ready_is_seen_as_stopped(tmp_path: Path) -> None:
    process, health = await start(tmp_path, mode="crash_after_ready_s=0.3")
    await process.wait_ready(health, timeout_s=20)
    deadline = time.monotonic() + 10
    while process.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
        await process.probe(health)
    assert await process.probe(health) == "stopped"
    assert process.returncode == 134
    assert "GGML_ASSERT" in process.stderr_tail()
    await process.shutdown()


async def test_shutdown_escalates_to_sigkill(tmp_path: Path) -> None:
    process, health = await start(tmp_path, mode="ignore_sigterm")
    await process.wait_ready(health, timeout_s=20)
    started = time.monotonic()
    await process.shutdown(grace_s=0.5)
    assert gone(process.pid)
    assert process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


async def test_engine_gets_a_minimal_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_ShouldNeverReachTheEngine000000000")
    monkeypatch.setenv("SB_ADMIN_PASSWORD", "do-not-inherit")
    record = tmp_path / "record.json"
    process, health = await start(tmp_path, record=record)
    await process.wait_ready(health, timeout_s=20)
    await process.shutdown()
    env = json.loads(record.read_text())["env"]
    assert "HF_TOKEN" not in env
    assert "SB_ADMIN_PASSWORD" not in env
    assert env["FAKE_LLAMA_MODE"] == ""
    assert set(env) <= {"FAKE_LLAMA_MODE", "FAKE_LLAMA_RECORD", "PWD", "SHLVL", "_", *os.environ}


def write_record(owned: Path, *, pid: int, ticks: str, owner: str) -> Path:
    owned.mkdir(parents=True, exist_ok=True)
    path = owned / f"{pid}-{ticks}.json"
    path.write_text(
        json.dumps(
            {"pid": pid, "start_ticks": ticks, "owner": owner, "label": "x", "executable": "sleep"}
        )
    )
    return path


def dead_owner() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = WorkerIdentity.current()
    return f"{me.boot_id}/{child.pid}/{me.start_ticks}/dead"


def test_orphans_of_a_dead_owner_are_reaped(tmp_path: Path) -> None:
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ticks = process_start_ticks(orphan.pid)
    assert ticks is not None
    record = write_record(tmp_path / "owned", pid=orphan.pid, ticks=ticks, owner=dead_owner())
    report = reap_orphans(tmp_path / "owned", grace_s=2)
    orphan.wait(timeout=10)
    assert report.killed == (orphan.pid,)
    assert not record.exists()


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = write_record(
            tmp_path / "owned", pid=bystander.pid, ticks="1", owner=dead_owner()
        )  # the record's start ticks belong to an earlier process with that pid
        report = reap_orphans(tmp_path / "owned", grace_s=1)
        assert report.killed == ()
        assert not record.exists()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_engines_of_a_live_owner_are_left_alone(tmp_path: Path) -> None:
    engine = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ticks = process_start_ticks(engine.pid)
        assert ticks is not None
        record = write_record(
            tmp_path / "owned", pid=engine.pid, ticks=ticks, owner=WorkerIdentity.current().owner
        )
        assert reap_orphans(tmp_path / "owned").killed == ()
        assert record.exists()
        assert engine.poll() is None
    finally:
        engine.kill()
        engine.wait()


def test_kill_owned_kills_only_this_owners_live_engines(tmp_path: Path) -> None:
    owned = tmp_path / "owned"
    me = WorkerIdentity.current().owner
    mine, theirs, reused = (
        subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)
    )
    try:
        for process, owner, ticks in (
            (mine, me, process_start_ticks(mine.pid)),
            (theirs, WorkerIdentity.current().owner, process_start_ticks(theirs.pid)),
            (reused, me, "1"),  # an earlier process that had this pid
        ):
            assert ticks is not None
            write_record(owned, pid=process.pid, ticks=ticks, owner=owner)
        assert kill_owned(owned, owner=me) == (mine.pid,)
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert theirs.poll() is None
        assert reused.poll() is None
        assert len(list(owned.glob("*.json"))) == 3  # records stay for the supervisor
        assert kill_owned(tmp_path / "missing", owner=me) == ()
    finally:
        for process in (mine, theirs, reused):
            process.kill()
            process.wait()


def test_engine_dies_with_its_host(tmp_path: Path) -> None:
    exe = fake_llama_server(tmp_path / "bin")
    port = free_port()
    code = (
        "import anyio, sys\n"
        "from pathlib import Path\n"
        "from sbproxy.model_host.engines import spawn_engine, minimal_env\n"
        "from sbproxy.workflows import WorkerIdentity\n"
        "async def main():\n"
        f"    p = await spawn_engine([{str(exe)!r}, '--port', '{port}'], env=minimal_env(),"
        f" log_path=Path({str(tmp_path / 'l.log')!r}), owned_dir=Path({str(tmp_path / 'o')!r}),"
        " label='x', identity=WorkerIdentity.current())\n"
        "    print(p.pid, flush=True)\n"
        "    await anyio.sleep(60)\n"
        "anyio.run(main)\n"
    )
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    engine_pid = int(host.stdout.readline())
    assert not gone(engine_pid)
    host.send_signal(signal.SIGKILL)
    host.wait()
    host.stdout.close()
    deadline = time.monotonic() + 10
    while not gone(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(engine_pid)  # the parent-death signal took it down
