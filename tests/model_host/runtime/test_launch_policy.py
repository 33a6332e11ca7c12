"""The manager's launch path over a fake launcher: retries, port retries, the crash loop
and the exit watcher, with a real journal and cache but no engine process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sbproxy.config import PriorityClass
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.policy import PORT_RETRIES
from sbproxy.model_host.runtime.state import DeploymentState, LaunchBackoff
from tests.model_host.runtime.fake_launcher import FakeLauncher, early_exit, port_lost
from tests.model_host.runtime.host import runtime_host
from tests.model_host.runtime.support import until

pytestmark = pytest.mark.anyio

TINY: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "queue_timeout_ms": 15000}
STANDARD = PriorityClass.STANDARD
BACKOFF = LaunchBackoff(base_s=0.01, max_s=0.02, max_attempts=3)


async def test_early_exits_are_retried_until_one_launch_is_ready(tmp_path: Path) -> None:
    launcher = FakeLauncher([early_exit(), early_exit()])
    async with runtime_host(
        tmp_path, deployments={"tiny": TINY}, launcher=launcher, backoff=BACKOFF
    ) as host:
        upstream = await host.manager.acquire("tiny", priority=STANDARD)
        upstream.release()
        status = host.manager.snapshot("tiny")
        assert status.state == DeploymentState.READY
        assert len(launcher.specs) == 3
        assert status.extra["engine_pid"] == launcher.engines[0].pid
        assert upstream.base_url.endswith(f":{launcher.specs[-1].request.port}")
    assert launcher.stopped == [launcher.engines[0].pid]  # the shutdown stopped it


async def test_launches_that_keep_failing_end_in_a_crash_loop(tmp_path: Path) -> None:
    launcher = FakeLauncher([early_exit()] * 3)
    async with runtime_host(
        tmp_path, deployments={"tiny": TINY}, launcher=launcher, backoff=BACKOFF
    ) as host:
        with pytest.raises(AdmissionRejected) as refused:
            await host.manager.acquire("tiny", priority=STANDARD)
        assert refused.value.code == "crash_loop"
        status = host.manager.snapshot("tiny")
        assert (status.state, status.reason_code) == (DeploymentState.FAILED, "crash_loop")
        assert len(launcher.specs) == BACKOFF.max_attempts
        assert host.manager.deployment("tiny").crash is not None


async def test_lost_ports_are_retried_on_fresh_ports_without_counting(tmp_path: Path) -> None:
    launcher = FakeLauncher([port_lost()] * PORT_RETRIES + [early_exit()])
    async with runtime_host(
        tmp_path, deployments={"tiny": TINY}, launcher=launcher, backoff=BACKOFF
    ) as host:
        upstream = await host.manager.acquire("tiny", priority=STANDARD)
        upstream.release()
        assert len(launcher.specs) == PORT_RETRIES + 2
        assert host.manager.deployment("tiny").crash is None
        assert host.manager.snapshot("tiny").state == DeploymentState.READY


async def test_an_engine_that_exits_stops_being_routed_at_once(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    async with runtime_host(
        tmp_path, deployments={"tiny": TINY}, launcher=launcher, backoff=BACKOFF
    ) as host:
        (await host.manager.acquire("tiny", priority=STANDARD)).release()
        # The load that launched it has settled (its job ended, its waiters woken): a later
        # wake-up from it would meet the loss below and refuse the healing request.
        await until(lambda: not host.manager.queue("tiny").pending)
        launcher.engines[0].exit(1)
        await until(lambda: host.manager.snapshot("tiny").state == DeploymentState.FAILED)
        # Its engine is stopped and its reservation freed before a request heals it.
        await until(lambda: launcher.engines[0].pid in launcher.stopped)
        status = host.manager.snapshot("tiny")
        assert status.reason_code == "engine_health_failed"
        assert status.port is None and not status.routable
        healed = await host.manager.acquire("tiny", priority=STANDARD)
        healed.release()
        assert healed.generation == status.generation + 1
