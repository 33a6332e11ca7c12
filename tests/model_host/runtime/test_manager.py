"""The runtime manager with the stand-in engine: cold start, warm start, coalescing,
self-healing, crash loop and reset, drain, keep-alive, pull policy, status."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from sbproxy.config import PriorityClass
from sbproxy.errors import SbproxyError
from sbproxy.model_host.engines import EngineProcess
from sbproxy.model_host.runtime import command_runner
from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.jobs import submit_drain, submit_load, submit_reset
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobStatus, RuntimeStore
from sbproxy.store.postgres import JournalUnavailable
from sbproxy.workflows import process_start_ticks
from tests.model_host.engines.support import fake_llama_server
from tests.model_host.runtime.host import runtime_host

pytestmark = pytest.mark.anyio

TINY = {"model": "tiny", "variant": "q4_k_m", "max_concurrency": 2, "queue_timeout_ms": 15000}


async def until(predicate: object, timeout_s: float = 15) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.05)


async def health(base_url: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{base_url}/health")).status_code


async def test_cold_start_on_the_first_request(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        slot = host.manager.deployment("tiny")
        assert slot.state == DeploymentState.CONFIGURED
        upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert await health(upstream.base_url) == 200
        (status,) = host.manager.status()
        assert status.state == DeploymentState.READY
        assert status.generation == 1
        assert status.active_requests == 1
        assert status.memory is not None
        assert status.memory["total_bytes"] == sum(
            v for k, v in status.memory.items() if k != "total_bytes"
        )
        assert status.job_id is not None
        upstream.release()
        job = await host.engine.join(status.job_id)  # waits for the load job to settle
        assert job.kind == "load"
        assert job.status == JobStatus.SUCCEEDED
        assert [s.name for s in await host.engine.steps(job.id)] == [
            "resolve",
            "pull",
            "engine",
            "launch",
        ]


async def test_warm_deployments_are_ready_without_a_request(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": {**TINY, "warm": True}}) as host:
        slot = host.manager.deployment("tiny")
        await until(lambda: slot.state == DeploymentState.READY)
        assert slot.port is not None


async def test_concurrent_cold_requests_share_one_launch(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        upstreams = []

        async def one() -> None:
            upstreams.append(await host.manager.acquire("tiny", priority=PriorityClass.STANDARD))

        async with anyio.create_task_group() as group:
            group.start_soon(one)
            group.start_soon(one)
        assert {u.generation for u in upstreams} == {1}
        assert len({u.base_url for u in upstreams}) == 1
        for upstream in upstreams:
            upstream.release()


async def test_a_dead_engine_is_detected_and_healed_on_the_next_request(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        first = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        first.release()
        # The load that launched it has settled (its job ended, its waiters woken): a later
        # wake-up from it would meet the loss below and refuse the healing request.
        await until(lambda: not host.manager.queue("tiny").pending)
        slot = host.manager.deployment("tiny")
        assert isinstance(slot.process, EngineProcess)
        slot.process._process.kill()  # the engine dies under us
        await until(lambda: slot.state == DeploymentState.FAILED)
        # The loss is published first, then the engine is stopped and its reservation freed
        # (the last step before the waiters are woken).
        await until(lambda: not host.manager.residency.reservations)
        assert slot.reason_code == "engine_health_failed"
        assert slot.port is None
        healed = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert healed.generation == 2
        assert await health(healed.base_url) == 200
        healed.release()


async def test_crash_loop_is_retained_until_reset(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}, mode="exit_at_start") as host:
        with pytest.raises(AdmissionRejected) as info:
            await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert info.value.code == "crash_loop"
        slot = host.manager.deployment("tiny")
        assert slot.crash is not None
        assert slot.crash.attempts == 3
        assert slot.crash.reason == "engine_early_exit"
        assert "failed to load model" in slot.crash.last_error
        launches = slot.generation
        with pytest.raises(AdmissionRejected) as again:
            await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert again.value.code == "crash_loop"
        assert slot.generation == launches  # no new launch while crash-looped

        fake_llama_server(host.root / "bin")  # the operator fixes the engine
        reset = await submit_reset(host.manager.port, "tiny")
        done = await host.engine.join(reset.id)
        assert done.status == JobStatus.SUCCEEDED
        assert slot.state == DeploymentState.CONFIGURED
        upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert await health(upstream.base_url) == 200
        upstream.release()


async def test_a_reset_without_a_retained_failure_is_a_no_op_that_succeeds(
    tmp_path: Path,
) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY, "idle": TINY}) as host:
        upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        upstream.release()
        slot = host.manager.deployment("tiny")
        port, generation = slot.port, slot.generation
        job = await host.engine.join((await submit_reset(host.manager.port, "tiny")).id)
        assert job.status == JobStatus.SUCCEEDED
        assert job.error is None
        assert job.output == {"deployment": "tiny", "cleared": False, "state": "ready"}
        assert (slot.state, slot.port, slot.generation) == (DeploymentState.READY, port, generation)
        # A deployment that never started (configured) and a stopped one: the same no-op.
        idle = await host.engine.join((await submit_reset(host.manager.port, "idle")).id)
        assert (idle.status, idle.output["state"]) == (JobStatus.SUCCEEDED, "configured")
        stop = await host.manager.stop("tiny")
        await host.engine.join(stop.id)
        stopped = await host.engine.join((await host.manager.reset("tiny")).id)
        assert stopped.status == JobStatus.SUCCEEDED
        assert stopped.output["cleared"] is False
        assert host.manager.deployment("tiny").state == DeploymentState.STOPPED


async def test_drain_waits_for_active_requests_then_stops(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        slot = host.manager.deployment("tiny")
        assert slot.process is not None
        pid = slot.process.pid
        job = await submit_drain(host.manager.port, "tiny")
        finished: list[object] = []

        async def drain() -> None:
            finished.append(await host.engine.join(job.id))

        async with anyio.create_task_group() as group:
            group.start_soon(drain)
            await until(lambda: slot.state == DeploymentState.DRAINING)
            with pytest.raises(AdmissionRejected) as info:
                await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
            assert info.value.code == "draining"
            await anyio.sleep(0.2)
            assert not finished  # still waiting for the active request
            upstream.release()
        assert slot.state == DeploymentState.STOPPED
        assert process_start_ticks(pid) is None
        drained = await host.engine.get(job.id)
        assert drained.output == {
            "active_at_start": 1,
            "cancelled_queued": 0,
            "remaining_active": 0,
            "timed_out": False,
        }
        # The artifact stays cached; a later request starts a new generation.
        again = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert again.generation == 2
        again.release()


async def test_keep_alive_expiry_stops_an_idle_engine(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": {**TINY, "keep_alive_secs": 1}}) as host:
        upstream = await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        slot = host.manager.deployment("tiny")
        await anyio.sleep(1.3)
        assert host.manager.status()[0].state == DeploymentState.READY  # active pauses expiry
        upstream.release()
        await until(lambda: slot.state == DeploymentState.STOPPED, timeout_s=10)
        assert host.manager.cache.lookup(slot.artifact).kind == "ready"  # type: ignore[arg-type]


async def test_manual_pull_policy_refuses_a_cache_miss(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": {**TINY, "pull": "manual"}}) as host:
        with pytest.raises(AdmissionRejected) as info:
            await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        slot = host.manager.deployment("tiny")
        assert slot.reason_code == "manual_artifact_missing"
        assert "sbproxy models pull" in (slot.last_error or "")
        assert info.value.code == "engine_unhealthy"


async def test_unknown_deployment(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        with pytest.raises(SbproxyError) as info:
            await host.manager.acquire("nope", priority=PriorityClass.STANDARD)
        assert info.value.code == "unknown_deployment"


async def test_status_serialises_the_reference_fields(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        (status,) = host.manager.status()
        payload = status.to_dict()
        for field in (
            "deployment",
            "replica",
            "generation",
            "state",
            "active_requests",
            "queued_requests",
            "engine",
            "artifact_digest",
            "selected_devices",
            "memory",
            "port",
            "reason_code",
            "job_id",
            "last_error",
        ):
            assert field in payload
        assert payload["state"] == "configured"


async def test_prepares_across_deployments_run_concurrently_up_to_the_limit(
    tmp_path: Path,
) -> None:
    deployments = dict.fromkeys(("a", "b", "c"), TINY)
    async with runtime_host(
        tmp_path, deployments=deployments, mode="load_s=1.0", host={"max_parallel_prepares": 2}
    ) as host:
        manager = host.manager
        most = 0

        async def sample() -> None:
            nonlocal most
            while True:
                preparing = sum(
                    1 for s in manager.deployments.values() if s.state == DeploymentState.PREPARING
                )
                most = max(most, preparing)
                await anyio.sleep(0.02)

        async def request(name: str) -> None:
            upstream = await manager.acquire(name, priority=PriorityClass.STANDARD)
            upstream.release()

        async with anyio.create_task_group() as group:
            group.start_soon(sample)
            async with anyio.create_task_group() as requests:
                for name in deployments:
                    requests.start_soon(request, name)
            group.cancel_scope.cancel()
        assert most == 2
        assert all(s.state == DeploymentState.READY for s in manager.deployments.values())


async def test_engines_killed_by_the_host_s_stop_do_not_fail_whoever_notices(
    tmp_path: Path,
) -> None:
    # A second stop signal kills every engine: the exit watcher and a maintenance probe
    # both see the exit; neither fails the deployment (no failure, no restart backoff),
    # and the shutdown after it settles it stopped.
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        (await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)).release()
        (status,) = host.manager.status()
        assert status.job_id is not None
        await host.engine.join(status.job_id)  # the load job settled
        slot = host.manager.deployment("tiny")
        process = slot.process
        assert process is not None
        assert host.manager.kill_every_engine(stopping=True) == [process.pid]
        await until(lambda: not process.alive())
        await host.manager.tick()  # a maintenance pass: its probe finds the engine stopped
        assert slot.state == DeploymentState.READY
        assert slot.failures == 0
        await host.manager.shutdown(deadline_s=5)
        (after,) = host.manager.status()
        assert after.state == DeploymentState.STOPPED


async def test_a_launch_the_journal_fails_under_leaves_no_preparing_and_its_job_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The journal goes away just as the launch numbers its generation (after the move to
    # preparing): the run stops there, as on any journal fault, and the deployment must not
    # stay preparing -- the job's resumed run moves it to preparing again, which from
    # preparing would be an illegal transition and fail the deployment.
    original = RuntimeStore.next_generation
    calls: list[str] = []

    async def away_once(self: RuntimeStore, deployment: str) -> int:
        calls.append(deployment)
        if len(calls) == 1:
            raise JournalUnavailable("the journal is away (the test's fault)")
        return await original(self, deployment)

    monkeypatch.setattr(RuntimeStore, "next_generation", away_once)
    caplog.set_level(logging.INFO, logger="sbproxy.model_host.runtime.deployment")
    async with runtime_host(tmp_path, deployments={"tiny": TINY}, worker=True) as host:
        slot = host.manager.deployment("tiny")
        with pytest.raises(SbproxyError):  # the request waiting for that load
            await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        # Not left preparing: the launch itself ended it, with the fault's reason code
        # (before the command that waited for the load settled it failed).
        assert "deployment tiny: preparing -> stopped (journal_unavailable)" in caplog.text
        assert slot.state.value == "stopped"  # not failed: the journal, not the load, failed
        assert slot.reason_code == "journal_unavailable"
        await until(lambda: slot.state == DeploymentState.READY)  # the job resumed
        assert calls == ["tiny", "tiny"]
        (await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)).release()


async def test_a_load_the_journal_refuses_changes_nothing_and_its_waiters_get_the_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The journal refuses the load's job itself (an outage): the caller is told (503
    # journal_unavailable, retryable), the requests waiting for that load get the same
    # answer at once, and the deployment stays as it was -- not failed.
    original = submit_load
    refusals: list[str] = []

    async def refused_once(*args: Any, **kwargs: Any) -> Any:
        if not refusals:
            refusals.append("refused")
            raise JournalUnavailable("the journal is away (the test's fault)")
        return await original(*args, **kwargs)

    monkeypatch.setattr(command_runner, "submit_load", refused_once)
    async with runtime_host(tmp_path, deployments={"tiny": TINY}) as host:
        slot = host.manager.deployment("tiny")
        with pytest.raises(SbproxyError) as waited:
            await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        assert (waited.value.code, waited.value.retryable) == ("journal_unavailable", True)
        assert (slot.state, slot.reason_code) == (DeploymentState.CONFIGURED, None)
        # Once the journal answers, the next request loads it.
        (await host.manager.acquire("tiny", priority=PriorityClass.STANDARD)).release()
        assert slot.state == DeploymentState.READY


async def test_a_held_launch_waits_for_its_release_and_a_stop_ends_it(tmp_path: Path) -> None:
    # A fenced fleet node: what it held does not start again -- a restart after its engine
    # died included -- until its agent releases it; a stop of a held one ends its launch.
    deployments = {"tiny": TINY, "other": TINY}
    async with runtime_host(tmp_path, deployments=deployments) as host:
        for name in deployments:
            (await host.manager.acquire(name, priority=PriorityClass.STANDARD)).release()
            await until(lambda name=name: not host.manager.queue(name).pending)
        host.manager.hold_launches()
        assert host.manager.kill_every_engine()
        for name in deployments:
            slot = host.manager.deployment(name)
            await until(lambda slot=slot: slot.state == DeploymentState.FAILED)
        answers: dict[str, object] = {}

        async def request(name: str) -> None:
            try:
                upstream = await host.manager.acquire(name, priority=PriorityClass.STANDARD)
            except SbproxyError as exc:
                answers[name] = exc.code
            else:
                answers[name] = upstream.generation
                upstream.release()

        hold = host.manager._context.launch_hold
        async with anyio.create_task_group() as group:
            for name in deployments:
                group.start_soon(request, name)
            await until(lambda: hold.waiting == {"tiny", "other"})
            assert host.manager.deployment("tiny").process is None  # nothing launched
            host.manager.release_launches(["tiny"])  # the fleet still places tiny here
            await until(lambda: "tiny" in answers)
            assert answers["tiny"] == 2
            # ... and no longer "other": its waiting launch ends (cancelled), so its command
            # lane is free for the stop that follows; the hold stays for later launches.
            assert not hold.waiting
            assert hold.held == {"other"}
            other = host.manager.deployment("other")
            assert (other.state, other.reason_code) == (DeploymentState.STOPPED, "superseded")
            await host.manager.stop("other")  # the reload that stops what it no longer has
        assert host.manager.deployment("other").state == DeploymentState.STOPPED
        assert "other" in answers and answers["other"] != 2, answers
        assert host.manager.deployment("other").process is None
