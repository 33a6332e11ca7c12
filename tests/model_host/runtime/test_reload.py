"""The reload transaction: plan policy as functions, the admin revision store, and reloads of
a live manager with the stand-in engine (preserve / replace / remove / add, failure leaves
everything as it was, rolling must fit beside the old generation, recreate stops the old
one first and restores it when the new one fails)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from sbproxy.config import DeploymentConfig, PriorityClass, load_config_text
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.desired_store import (
    RevisionConflict,
    RevisionStore,
    revision_digest,
)
from sbproxy.model_host.runtime.reload import (
    foundation_changes,
    listener_changes,
    plan_reload,
    reload,
)
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.workflows import process_start_ticks
from tests.model_host.runtime.host import candidate, config_text, runtime_host

WARM: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "warm": True}


def deployment(**fields: Any) -> DeploymentConfig:
    return DeploymentConfig.model_validate({"model": "tiny", **fields})


async def until(predicate: Any, timeout_s: float = 20) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.05)


async def health(port: int | None) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"http://127.0.0.1:{port}/health")).status_code


def reload_jobs(root: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(root / "cache" / "jobs" / "journal.db") as raw:
        return list(raw.execute("SELECT id, status FROM jobs WHERE kind = 'reload'"))


# -- pure policy --------------------------------------------------------------------------


def test_plan_classifies_every_deployment() -> None:
    current = {"same": deployment(), "edit": deployment(), "gone": deployment()}
    wanted = {"same": deployment(), "edit": deployment(max_concurrency=3), "new": deployment()}
    plan = plan_reload(current, wanted)
    assert plan.added == ("new",)
    assert plan.changed == ("edit",)
    assert plan.removed == ("gone",)
    assert plan.preserved == ("same",)
    # A memory-policy change (safety margin) changes every estimate: nothing is preserved.
    assert plan_reload(current, wanted, policy_changed=True).changed == ("edit", "same")


def test_listener_and_foundation_changes_are_named_by_path(tmp_path: Path) -> None:
    exe = tmp_path / "bin" / "llama-server"

    def compiled(host: dict[str, Any] | None = None, proxy: dict[str, Any] | None = None) -> Any:
        return load_config_text(
            config_text(tmp_path, executable=exe, deployments={}, host=host, proxy=proxy)
        )

    base = compiled()
    assert listener_changes(base, compiled()) == []
    assert listener_changes(base, compiled(proxy={"http_bind_port": 9999})) == [
        "proxy.http_bind_port"
    ]
    assert listener_changes(base, compiled(host={"cache": {"directory": "/elsewhere"}})) == [
        "proxy.model_host.cache.directory"
    ]
    assert listener_changes(base, compiled(host={"cpu_devices": 2})) == [
        "proxy.model_host.cpu_devices"
    ]
    assert foundation_changes(base, compiled(host={"catalog_file": "/other/catalog.yaml"})) == [
        "proxy.model_host.catalog_file"
    ]
    assert foundation_changes(
        base, compiled(host={"engines": {"llama_cpp": {"path": "/usr/bin/llama-server"}}})
    ) == ["proxy.model_host.engines"]


# -- the admin revision store -------------------------------------------------------------


def test_revision_store_compare_and_set(tmp_path: Path) -> None:
    path = tmp_path / "state" / "deployments.json"
    store = RevisionStore(path)
    assert store.load() is None
    first = store.compare_and_set(
        expected_revision=None, catalog_revision="c1", deployments={"a": {"model": "tiny"}}
    )
    assert first.revision == 1
    second = store.compare_and_set(
        expected_revision=1, catalog_revision="c1", deployments={"b": {"model": "tiny"}}
    )
    assert second.revision == 2
    assert second.content_digest != first.content_digest
    assert RevisionStore(path).load() == second  # restart-safe
    before = path.read_bytes()
    with pytest.raises(RevisionConflict) as conflict:
        store.compare_and_set(expected_revision=1, catalog_revision="c1", deployments={})
    assert conflict.value.code == "revision_conflict"
    assert conflict.value.details == {"expected_revision": 1, "actual_revision": 2}
    assert path.read_bytes() == before


def test_revision_digest_is_stable_across_key_order() -> None:
    one = {"a": {"model": "tiny", "warm": True}, "b": {"model": "x", "variant": "q"}}
    two = {"b": {"variant": "q", "model": "x"}, "a": {"warm": True, "model": "tiny"}}
    digest = revision_digest(revision=3, catalog_revision="c", deployments=one)
    assert digest == revision_digest(revision=3, catalog_revision="c", deployments=two)
    assert digest == revision_digest(
        revision=3, catalog_revision="c", deployments=json.loads(json.dumps(one))
    )
    assert digest != revision_digest(revision=4, catalog_revision="c", deployments=one)


def test_a_tampered_store_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "deployments.json"
    store = RevisionStore(path)
    store.compare_and_set(expected_revision=None, catalog_revision="c", deployments={})
    document = json.loads(path.read_text())
    document["deployments"] = {"sneaky": {"model": "tiny"}}
    path.write_text(json.dumps(document))
    with pytest.raises(SbproxyError) as failed:
        store.load()
    assert failed.value.code == "store_failed"
    path.write_text("{not json")
    with pytest.raises(SbproxyError, match="not a revision document"):
        store.load()


# -- reloads of a live manager -------------------------------------------------------------


@pytest.mark.anyio
async def test_reload_preserves_replaces_removes_and_adds(tmp_path: Path) -> None:
    deployments = {"keep": WARM, "edit": WARM, "drop": WARM}
    async with runtime_host(tmp_path, deployments=deployments) as host:
        manager = host.manager
        await until(
            lambda: all(s.state == DeploymentState.READY for s in manager.deployments.values())
        )
        before = {d: (s.generation, s.port, s.process) for d, s in manager.deployments.items()}
        revision = manager.revision
        wanted = {"keep": WARM, "edit": {**WARM, "max_concurrency": 3}, "new": WARM}

        job_id, report = await reload(
            manager, candidate(tmp_path, deployments=wanted), source="test"
        )

        assert report.plan.to_dict() == {
            "added": ["new"],
            "changed": ["edit"],
            "removed": ["drop"],
            "preserved": ["keep"],
        }
        assert report.revision == (revision or 0) + 1 == manager.revision
        assert reload_jobs(tmp_path) == [(job_id, "succeeded")]
        keep = manager.deployment("keep")
        assert (keep.generation, keep.port, keep.process) == before["keep"]
        edit = manager.deployment("edit")
        assert edit.state == DeploymentState.READY
        assert edit.config.max_concurrency == 3
        assert edit.generation > before["edit"][0]
        assert edit.port != before["edit"][1]
        assert manager.deployment("new").state == DeploymentState.READY
        assert "drop" not in manager.deployments
        for old in (before["edit"][2], before["drop"][2]):
            assert old is not None and not old.alive()
        assert await health(edit.port) == 200


@pytest.mark.anyio
async def test_a_failed_reload_changes_nothing(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"a": WARM}) as host:
        manager = host.manager
        slot = manager.deployment("a")
        await until(lambda: slot.state == DeploymentState.READY)
        revision, port, process = manager.revision, slot.port, slot.process
        wanted = {"a": {**WARM, "max_concurrency": 2}, "b": {"model": "no-such-model"}}

        with pytest.raises(SbproxyError) as failed:
            await reload(manager, candidate(tmp_path, deployments=wanted), source="test")

        assert failed.value.code == "unknown_catalog_model"
        assert manager.revision == revision
        assert set(manager.deployments) == {"a"}
        assert manager.deployment("a") is slot
        assert (slot.port, slot.process, slot.state) == (port, process, DeploymentState.READY)
        assert slot.config.max_concurrency == 1
        assert await health(port) == 200


@pytest.mark.anyio
async def test_rolling_replacement_must_fit_beside_the_old_generation(tmp_path: Path) -> None:
    async with runtime_host(tmp_path, deployments={"a": WARM}) as host:
        manager = host.manager
        slot = manager.deployment("a")
        await until(lambda: slot.state == DeploymentState.READY)
        assert slot.estimate is not None
        # Room for one generation, not two: the new one cannot start beside the old.
        manager.residency._capacities[0] = slot.estimate.total_bytes * 3 // 2
        wanted = {"a": {**WARM, "max_queue_depth": 7}}

        with pytest.raises(SbproxyError) as failed:
            await reload(manager, candidate(tmp_path, deployments=wanted), source="test")

        assert failed.value.code == "insufficient_capacity"
        assert manager.deployment("a") is slot
        assert slot.state == DeploymentState.READY
        assert await health(slot.port) == 200
        assert not manager.staging.staged

        # With room for both, the rollout overlaps: the old engine serves until the swap.
        manager.residency._capacities[0] = slot.estimate.total_bytes * 3
        old_process = slot.process
        _, report = await reload(manager, candidate(tmp_path, deployments=wanted), source="test")
        assert report.plan.changed == ("a",)
        assert manager.deployment("a").config.max_queue_depth == 7
        assert old_process is not None and not old_process.alive()


@pytest.mark.anyio
async def test_recreate_stops_the_old_generation_first_and_restores_it_on_failure(
    tmp_path: Path,
) -> None:
    recreate = {**WARM, "rollout": "recreate"}
    async with runtime_host(tmp_path, deployments={"a": recreate}) as host:
        manager = host.manager
        slot = manager.deployment("a")
        await until(lambda: slot.state == DeploymentState.READY)
        generation, old_pid = slot.generation, slot.process.pid if slot.process else 0
        revision = manager.revision

        # The new definition cannot start (the stand-in exits at start with --seed 666).
        broken = {"a": {**recreate, "extra_args": ["--seed", "666"]}}
        with pytest.raises(SbproxyError) as failed:
            await reload(manager, candidate(tmp_path, deployments=broken), source="test")
        assert failed.value.code == "crash_loop"
        assert manager.deployment("a") is slot
        assert slot.state == DeploymentState.READY
        assert slot.generation == generation  # restarted under its own generation
        assert slot.process is not None and slot.process.pid != old_pid
        assert process_start_ticks(old_pid) is None
        assert manager.revision == revision
        assert await health(slot.port) == 200

        # A working new definition: the old engine is gone before the new one starts.
        restored_pid = slot.process.pid
        old_gone_at_launch: list[bool] = []
        launch = manager.launch_generation

        async def observed_launch(target: Any, **options: Any) -> int:
            old_gone_at_launch.append(process_start_ticks(restored_pid) is None)
            return await launch(target, **options)

        manager.launch_generation = observed_launch  # type: ignore[method-assign,assignment]
        fixed = {"a": {**recreate, "extra_args": ["--seed", "1"]}}
        _, report = await reload(manager, candidate(tmp_path, deployments=fixed), source="test")
        new = manager.deployment("a")
        assert report.plan.changed == ("a",)
        assert old_gone_at_launch == [True]
        assert new.generation > generation
        assert new.config.extra_args == ["--seed", "1"]
        assert new.state == DeploymentState.READY


@pytest.mark.anyio
async def test_lowering_max_resident_models_evicts_the_least_recently_used(
    tmp_path: Path,
) -> None:
    async with runtime_host(tmp_path, deployments={"a": WARM, "b": WARM, "c": WARM}) as host:
        manager = host.manager
        await until(
            lambda: all(s.state == DeploymentState.READY for s in manager.deployments.values())
        )
        # b, then a, then c used most recently: with room for two, b goes.
        for deployment in ("b", "a", "c"):
            upstream = await manager.acquire(deployment, priority=PriorityClass.STANDARD)
            upstream.release()
        wanted = candidate(
            tmp_path,
            deployments={"a": WARM, "b": WARM, "c": WARM},
            host={"cache": {"directory": str(tmp_path / "cache"), "max_resident_models": 2}},
        )
        _, report = await reload(manager, wanted, source="test")
        assert report.plan.preserved == ("a", "b", "c")
        assert manager.deployment("b").state == DeploymentState.STOPPED
        assert (
            manager.deployment("a").state == manager.deployment("c").state == DeploymentState.READY
        )
        assert len(manager.residency.reservations) == 2


@pytest.mark.anyio
async def test_policies_apply_at_once_and_an_unchanged_state_keeps_its_revision(
    tmp_path: Path,
) -> None:
    async with runtime_host(tmp_path, deployments={"a": WARM}) as host:
        manager = host.manager
        await until(lambda: manager.deployment("a").state == DeploymentState.READY)
        revision = manager.revision
        policy = {"shutdown_deadline_ms": 7000, "max_parallel_prepares": 3}
        _, report = await reload(
            manager, candidate(tmp_path, deployments={"a": WARM}, host=policy), source="test"
        )
        assert report.plan.preserved == ("a",)
        assert report.revision == revision  # the desired deployments did not change
        assert manager.shutdown_deadline_s == 7.0
        assert manager.prepares.total_tokens == 3
