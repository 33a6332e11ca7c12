"""The runtime as the one owner of live state, with real stand-in engine processes:
ordered commands (the last one wins), checked transitions, observed launch outputs,
socket-owned routing, the exit watcher, swap waits, start timeouts, unhealthy restarts on
an injected clock, and the invariant that the live engines are exactly those status shows.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest

from sbproxy.config import PriorityClass
from sbproxy.model_host.engines import EngineProcess
from sbproxy.model_host.runtime import manager as manager_module
from sbproxy.model_host.runtime import upstream as upstream_module
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.manager import IllegalTransition
from sbproxy.model_host.runtime.state import DEPLOYMENT_TRANSITIONS, DeploymentState
from sbproxy.store import JobStatus, JobStore, Transaction
from sbproxy.workflows import process_start_ticks
from tests.model_host.engines.support import fake_llama_server
from tests.model_host.runtime.host import runtime_host
from tests.model_host.runtime.support import (
    ManualClock,
    converged,
    finished,
    live_engines,
    until,
)

pytestmark = pytest.mark.anyio

TINY: dict[str, Any] = {
    "model": "tiny",
    "variant": "q4_k_m",
    "max_concurrency": 2,
    "queue_timeout_ms": 15000,
}
STANDARD = PriorityClass.STANDARD


async def test_stop_then_load_with_a_request_in_flight_ends_ready_with_one_engine(
    tmp_path: Path,
) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": {**TINY, "warm": True}}) as host:
        manager = host.manager
        await until(lambda: manager.deployment("tiny").routable())
        old_pid = manager.snapshot("tiny").extra["engine_pid"]
        in_flight = await manager.acquire("tiny", priority=STANDARD)
        stop = await manager.stop("tiny")
        load = await manager.load("tiny")
        assert load.id != stop.id
        await until(lambda: manager.deployment("tiny").state == DeploymentState.DRAINING)
        in_flight.release()  # the drain may finish now
        assert (await finished(host, stop.id)).status == JobStatus.SUCCEEDED
        assert (await finished(host, load.id)).status == JobStatus.SUCCEEDED
        status = manager.snapshot("tiny")
        assert status.state == DeploymentState.READY
        assert status.extra["engine_pid"] != old_pid
        assert process_start_ticks(old_pid) is None
        await converged(host)
        assert len(live_engines(tmp_path)) == 1


async def test_a_stop_during_a_load_cancels_it_and_no_engine_survives(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}, mode="load_s=30") as host:
        manager = host.manager
        load = await manager.load("tiny")
        await until(lambda: live_engines(tmp_path))  # the child is starting
        assert manager.deployment("tiny").state == DeploymentState.PREPARING
        stop = await manager.stop("tiny")
        assert (await finished(host, load.id)).status == JobStatus.CANCELLED
        assert (await finished(host, stop.id)).status == JobStatus.SUCCEEDED
        assert manager.snapshot("tiny").state == DeploymentState.STOPPED
        await converged(host)
        assert live_engines(tmp_path) == set()


async def test_the_last_of_many_interleaved_commands_wins(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        manager = host.manager
        jobs = []
        for _ in range(3):
            jobs.append(await manager.load("tiny"))
            jobs.append(await manager.stop("tiny"))
        jobs.append(await manager.load("tiny"))
        for job in jobs:
            await finished(host, job.id)
        await until(lambda: manager.deployment("tiny").routable())
        await converged(host)
        assert len(live_engines(tmp_path)) == 1

        jobs = [await manager.stop("tiny"), await manager.load("tiny"), await manager.stop("tiny")]
        for job in jobs:
            await finished(host, job.id)
        assert manager.snapshot("tiny").state == DeploymentState.STOPPED
        await converged(host)
        assert live_engines(tmp_path) == set()


async def test_every_transition_is_checked_and_recorded_on_its_job(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        manager = host.manager
        load = await manager.load("tiny")
        await finished(host, load.id)
        events = await host.engine.store.events(load.id)
        moves = [(e.data["from"], e.data["to"]) for e in events if e.type == "deployment"]
        assert moves == [("configured", "preparing"), ("preparing", "ready")]
        for (_, before, after), count in manager.tallies.transitions.items():
            assert DeploymentState(after) in DEPLOYMENT_TRANSITIONS[DeploymentState(before)]
            assert count >= 1
        slot = manager.deployment("tiny")
        with pytest.raises(IllegalTransition) as raised:
            slot._move({DeploymentState.READY}, DeploymentState.CONFIGURED)
        assert raised.value.code == "illegal_transition"
        assert slot.state == DeploymentState.READY


async def test_a_replayed_launch_is_observed_not_trusted(tmp_path: Path) -> None:
    """The journal says the launch succeeded, but the engine it names is gone: running the
    job again launches a new generation instead of handing back the dead port."""
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        manager = host.manager
        load = await manager.load("tiny")
        await finished(host, load.id)
        first = manager.snapshot("tiny")
        steps = await host.engine.steps(load.id)
        assert steps[-1].name == "launch"
        # Make the job unfinished again, as a host killed after the step committed leaves
        # it, and kill its engine the way a host crash does.
        store = host.engine.store
        assert isinstance(store, JobStore)

        def reopen(tx: Transaction) -> None:
            tx.execute(
                "UPDATE jobs SET status = 'queued', lease_owner = NULL WHERE id = :id",
                {"id": load.id},
            )

        await store.database.write(reopen)
        os.kill(first.extra["engine_pid"], signal.SIGKILL)
        await until(lambda: not manager.deployment("tiny").routable(), timeout_s=5)
        rerun = await host.engine.join(load.id)
        assert rerun.status == JobStatus.SUCCEEDED
        assert rerun.output is not None
        assert rerun.output["generation"] > first.generation
        assert rerun.output["pid"] != first.extra["engine_pid"]
        launch = (await host.engine.steps(load.id))[-1]
        assert launch.attempts == 2
        assert manager.deployment("tiny").routable()
        await converged(host)


async def test_an_engine_that_exits_stops_routing_at_once(tmp_path: Path) -> None:
    # No maintenance tick within the test: only the exit watcher can notice.
    async with runtime_host(tmp_path, deployments={"tiny": TINY}, health_interval_s=3600) as host:
        manager = host.manager
        await finished(host, (await manager.load("tiny")).id)
        pid = manager.snapshot("tiny").extra["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        await until(lambda: not manager.deployment("tiny").routable(), timeout_s=2)
        status = manager.snapshot("tiny")
        assert status.state == DeploymentState.FAILED
        assert status.reason_code == "engine_health_failed"
        assert status.port is None
        await converged(host)


class _Impostor(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return


@contextmanager
def impostor() -> Iterator[int]:
    """A foreign process-like listener that answers 200 to everything; its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def test_a_foreign_listener_on_the_chosen_port_never_gets_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with impostor() as taken:
        ports = iter([taken])
        real = upstream_module.free_port
        monkeypatch.setattr(manager_module, "free_port", lambda: next(ports, None) or real())
        async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
            manager = host.manager
            upstream = await manager.acquire("tiny", priority=STANDARD)
            upstream.release()
            status = manager.snapshot("tiny")
            assert status.port is not None
            assert status.port != taken
            assert upstream.base_url.endswith(f":{status.port}")
            process = manager.deployment("tiny").process
            assert isinstance(process, EngineProcess)
            assert process.listens_on(status.port)
            assert not process.listens_on(taken)
            assert manager.deployment("tiny").crash is None
            await converged(host)


async def test_a_launch_that_never_gets_ready_fails_with_start_timeout_and_is_retried(
    tmp_path: Path,
) -> None:
    # Short, yet long enough for the fixed stand-in to start on a loaded machine.
    slow = {**TINY, "start_timeout_ms": 3000}
    async with runtime_host(tmp_path, deployments={"tiny": slow}, mode="hang") as host:
        manager = host.manager
        with pytest.raises(AdmissionRejected) as first:
            await manager.acquire("tiny", priority=STANDARD)
        assert first.value.code == "engine_unhealthy"
        status = manager.snapshot("tiny")
        assert status.state == DeploymentState.FAILED
        assert status.reason_code == "start_timeout"
        assert manager.deployment("tiny").crash is None  # not a crash loop: retried on demand
        generation = status.generation
        await converged(host)
        # The engine works again; the next request retries without a host restart.
        fake_llama_server(tmp_path / "bin")
        upstream = await manager.acquire("tiny", priority=STANDARD)
        upstream.release()
        assert manager.snapshot("tiny").generation > generation
        await converged(host)


async def test_consecutive_timeouts_restart_the_generation_after_a_jittered_backoff(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    flaky = {**TINY, "unhealthy_after": 2, "warm": True}
    async with runtime_host(
        tmp_path, deployments={"tiny": flaky}, clock=clock, jitter=lambda: 0.5
    ) as host:
        manager = host.manager
        await until(lambda: manager.deployment("tiny").routable())
        first = manager.snapshot("tiny")
        ok = await manager.acquire("tiny", priority=STANDARD)
        ok.report(timed_out=True)
        ok.release()
        ok = await manager.acquire("tiny", priority=STANDARD)
        ok.report(timed_out=False)  # a request in time resets the count
        ok.release()
        for _ in range(2):
            upstream = await manager.acquire("tiny", priority=STANDARD)
            upstream.report(timed_out=True)
            upstream.release()
        # Drained, stopped, and the relaunch sleeps on the injected clock.
        await until(lambda: clock.sleepers == 1)
        status = manager.snapshot("tiny")
        assert status.state == DeploymentState.PREPARING
        assert process_start_ticks(first.extra["engine_pid"]) is None
        assert live_engines(tmp_path) == set()
        # backoff(1) = 0.05 s in this host; equal jitter at 0.5 -> 0.0375 s.
        clock.advance(0.03)
        await anyio.sleep(0.05)
        assert manager.snapshot("tiny").state == DeploymentState.PREPARING
        clock.advance(0.01)
        await until(lambda: manager.deployment("tiny").routable())
        assert manager.snapshot("tiny").generation > first.generation
        await converged(host)


async def test_keep_alive_expires_on_the_injected_clock(tmp_path: Path) -> None:
    clock = ManualClock()
    idle = {**TINY, "keep_alive_secs": 60}
    async with runtime_host(tmp_path, deployments={"tiny": idle}, clock=clock) as host:
        manager = host.manager
        upstream = await manager.acquire("tiny", priority=STANDARD)
        clock.advance(3600)  # active work pauses expiry
        await manager.tick()
        assert manager.deployment("tiny").routable()
        assert manager.snapshot("tiny").extra["keep_alive_expires_in_s"] is None  # busy
        upstream.release()
        clock.advance(20)
        assert manager.snapshot("tiny").extra["keep_alive_expires_in_s"] == 40
        clock.advance(39)
        await manager.tick()
        assert manager.deployment("tiny").routable()
        clock.advance(1)
        await manager.tick()
        await until(lambda: manager.snapshot("tiny").state == DeploymentState.STOPPED)
        await converged(host)


SWAP = {
    "model": "tiny",
    "variant": "q4_k_m",
    "max_concurrency": 1,
    "queue_timeout_ms": 15000,
}


async def test_a_swap_waits_for_the_busy_resident_model_and_holds_its_gate(
    tmp_path: Path,
) -> None:
    deployments = {"a": SWAP, "b": SWAP}
    limit = {"cache": {"directory": str(tmp_path / "cache"), "max_resident_models": 1}}
    async with runtime_host(tmp_path, deployments=deployments, host=limit) as host:
        manager = host.manager
        busy = await manager.acquire("a", priority=STANDARD)
        got: dict[str, Any] = {}

        async def ask(name: str) -> None:
            got[name] = await manager.acquire(name.rstrip("2"), priority=STANDARD)

        async with anyio.create_task_group() as group:
            group.start_soon(ask, "b")
            await until(lambda: manager.deployment("a").gate.held)
            assert manager.deployment("b").swap_waiting
            # No new request is admitted to the busy one while the swap waits.
            group.start_soon(ask, "a2")
            await until(lambda: manager.deployment("a").gate.queued == 1)
            assert "a2" not in got
            busy.release()
            await until(lambda: "b" in got)
            # "a" was evicted; its queued request now waits to swap it back in.
            assert manager.deployment("a").process is None
            assert manager.deployment("b").routable()
            await until(lambda: manager.deployment("b").gate.held)
            got["b"].release()  # now "a2" swaps back in
            await until(lambda: "a2" in got)
            got["a2"].release()
        assert manager.tallies.swap_waits.count >= 1
        await converged(host)
        assert len(live_engines(tmp_path)) == 1


async def test_a_swap_that_waits_too_long_is_insufficient_capacity_with_retry_after(
    tmp_path: Path,
) -> None:
    # Long enough that the launch of "b" reaches its swap wait first on a loaded machine.
    deployments = {"a": SWAP, "b": {**SWAP, "queue_timeout_ms": 2000}}
    limit = {"cache": {"directory": str(tmp_path / "cache"), "max_resident_models": 1}}
    async with runtime_host(tmp_path, deployments=deployments, host=limit) as host:
        manager = host.manager
        busy = await manager.acquire("a", priority=STANDARD)
        with pytest.raises(AdmissionRejected) as refused:
            await manager.acquire("b", priority=STANDARD)
        assert refused.value.code == "insufficient_capacity"
        assert refused.value.retry_after_ms is not None
        assert refused.value.retryable  # busy, not too big: it fits once "a" idles
        await until(lambda: not manager.deployment("a").gate.held)
        assert manager.deployment("a").routable()  # the busy one kept serving
        busy.release()
        await converged(host)


@pytest.mark.parametrize("jump_ms", [3_600_000, -3_600_000])
async def test_a_wall_clock_jump_leaves_the_runtime_converged(tmp_path: Path, jump_ms: int) -> None:
    """An NTP step of +-1 h while a load holds its lease: no recovery pass takes the job (no
    second attempt beside the first), the load finishes on attempt 1, and the host is
    converged. Keep-alive and backoff run on the monotonic clock, which no step moves."""
    async with runtime_host(
        tmp_path, deployments={"tiny": TINY}, mode="load_s=1.5", worker=True
    ) as host:
        manager = host.manager
        store = host.engine.store
        stepped = store.clock
        store.clock = lambda: stepped() + jump_ms  # the wall clock jumps mid-launch
        load = await manager.load("tiny")
        await until(lambda: manager.deployment("tiny").state == DeploymentState.PREPARING)
        assert await host.engine.recover() == []
        done = await finished(host, load.id)
        assert (done.status, done.attempt) == (JobStatus.SUCCEEDED, 1)
        assert manager.deployment("tiny").routable()
        upstream = await manager.acquire("tiny", priority=STANDARD)
        upstream.release()
        await converged(host)
        assert len(live_engines(tmp_path)) == 1
