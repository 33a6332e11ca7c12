"""Desired-state routes: ``GET|PUT /admin/model-host/deployments`` (compare-and-set into the
``admin_managed`` revision store, reload transaction) and the read-only ``file_managed``
view."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.desired_store import RevisionStore
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.workflows.faults import arm, disarm_all
from tests.api.support import ADMIN, TINY, served

pytestmark = pytest.mark.anyio

WARM: dict[str, Any] = {"model": "tiny", "variant": "q4_k_m", "warm": True}


def admin_managed(root: Path) -> dict[str, Any]:
    return {"authority": "admin_managed", "store_path": str(root / "state" / "desired.json")}


async def put(url: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(auth=ADMIN, timeout=60) as client:
        return await client.put(
            f"{url}/admin/model-host/deployments",
            content=body if isinstance(body, bytes) else json.dumps(body).encode(),
        )


async def get(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(auth=ADMIN) as client:
        body: dict[str, Any] = (await client.get(f"{url}/admin/model-host/deployments")).json()
        return body


async def test_file_managed_deployments_are_read_only(tmp_path: Path) -> None:
    async with served(tmp_path) as s:
        view = await get(s.admin_url)
        assert view["authority"] == "file_managed"
        assert view["read_only"] is True
        assert view["revision"] == s.host.manager.revision
        assert set(view["deployments"]) == {"tiny"}
        assert len(view["content_digest"]) == 64
        refused = await put(s.admin_url, {"expected_revision": None, "deployments": {}})
        assert refused.status_code == 403
        assert refused.json()["code"] == "authority_read_only"


async def test_put_compare_and_set_then_reload(tmp_path: Path) -> None:
    async with served(tmp_path, deployments={}, model_host=admin_managed(tmp_path)) as s:
        manager = s.host.manager
        empty = await get(s.admin_url)
        assert (empty["authority"], empty["read_only"]) == ("admin_managed", False)
        assert (empty["revision"], empty["content_digest"], empty["deployments"]) == (
            None,
            None,
            {},
        )

        created = await put(s.admin_url, {"expected_revision": None, "deployments": {"a": WARM}})
        assert created.status_code == 200, created.text
        body = created.json()
        assert body["revision"] == 1
        assert body["plan"] == {"added": ["a"], "changed": [], "removed": [], "preserved": []}
        assert manager.deployment("a").state == DeploymentState.READY  # warm: started before commit
        port = manager.deployment("a").port

        stale = await put(s.admin_url, {"expected_revision": None, "deployments": {}})
        assert stale.status_code == 409
        assert stale.json()["code"] == "revision_conflict"
        assert (stale.json()["expected_revision"], stale.json()["actual_revision"]) == (None, 1)

        second = await put(
            s.admin_url,
            {"expected_revision": 1, "deployments": {"a": WARM, "b": {"model": "tiny"}}},
        )
        assert second.status_code == 200, second.text
        assert second.json()["revision"] == 2
        assert second.json()["plan"]["preserved"] == ["a"]
        assert manager.deployment("a").port == port
        view = await get(s.admin_url)
        assert view["revision"] == 2
        assert view["content_digest"] == second.json()["content_digest"]
        assert set(view["deployments"]) == {"a", "b"}


async def test_put_refusals_leave_the_store_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "state" / "desired.json"
    async with served(tmp_path, deployments={}, model_host=admin_managed(tmp_path)) as s:
        ok = await put(s.admin_url, {"expected_revision": None, "deployments": {"a": TINY}})
        assert ok.status_code == 200, ok.text
        before = store.read_bytes()
        cases: list[tuple[object, int, str]] = [
            (b"{not json", 400, "invalid_body"),
            (
                b'{"expected_revision": 1, "expected_revision": 1, "deployments": {}}',
                400,
                "invalid_body",
            ),
            ({"expected_revision": 1, "deployments": {}, "extra": 1}, 400, "invalid_body"),
            ({"expected_revision": "1", "deployments": {}}, 400, "invalid_body"),
            ({"expected_revision": 2**53, "deployments": {}}, 400, "invalid_body"),
            (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_body"),
            (
                {"expected_revision": 1, "deployments": {"a": {**TINY, "max_concurrency": 0}}},
                400,
                "invalid_desired",
            ),
            (
                {"expected_revision": 1, "deployments": {"a": {**TINY, "surprise": True}}},
                400,
                "invalid_desired",
            ),
            ({"expected_revision": 1, "deployments": {"bad id!": TINY}}, 400, "invalid_desired"),
            (
                {"expected_revision": 1, "deployments": {"a": {"model": "no-such-model"}}},
                400,
                "unknown_catalog_model",
            ),
            (
                {"expected_revision": 1, "deployments": {"a": {**TINY, "variant": "q9"}}},
                400,
                "unknown_catalog_variant",
            ),
        ]
        for body, status, code in cases:
            answer = await put(s.admin_url, body)
            assert (answer.status_code, answer.json()["code"]) == (status, code), (
                body,
                answer.text,
            )
            assert store.read_bytes() == before
        invalid = await put(
            s.admin_url,
            {"expected_revision": 1, "deployments": {"a": {**TINY, "max_concurrency": 0}}},
        )
        assert invalid.json()["path"] == "deployments.a.max_concurrency"
        # Autoscaling is a fleet's: a single host refuses a range, naming the field.
        ranged = await put(
            s.admin_url,
            {"expected_revision": 1, "deployments": {"a": {**TINY, "replicas": {"max": 2}}}},
        )
        assert (ranged.status_code, ranged.json()["code"]) == (400, "invalid_desired")
        assert ranged.json()["path"] == "deployments.a.replicas"
        assert store.read_bytes() == before
        assert set(s.host.manager.deployments) == {"a"}


async def test_a_restarted_host_serves_the_stored_revision(tmp_path: Path) -> None:
    settings = admin_managed(tmp_path)
    async with served(tmp_path, deployments={}, model_host=settings) as s:
        ok = await put(s.admin_url, {"expected_revision": None, "deployments": {"kept": TINY}})
        assert ok.status_code == 200, ok.text
    # sb.yml still declares nothing; the store is authoritative.
    async with served(tmp_path, deployments={}, model_host=settings) as s:
        assert set(s.host.manager.deployments) == {"kept"}
        view = await get(s.admin_url)
        assert view["revision"] == 1
        assert view["content_digest"] == ok.json()["content_digest"]


async def test_a_candidate_that_cannot_start_is_a_422_and_stores_nothing(tmp_path: Path) -> None:
    store = tmp_path / "state" / "desired.json"
    async with served(tmp_path, deployments={}, model_host=admin_managed(tmp_path)) as s:
        broken = {"a": {**WARM, "extra_args": ["--seed", "666"]}}  # the stand-in exits at start
        answer = await put(s.admin_url, {"expected_revision": None, "deployments": broken})
        assert answer.status_code == 422, answer.text
        assert answer.json()["code"] == "crash_loop"
        assert answer.json()["job_id"]
        assert not store.exists()
        assert not s.host.manager.deployments
        assert not s.host.manager.staging.staged


async def test_a_store_race_discards_the_staged_rollout(tmp_path: Path) -> None:
    settings = admin_managed(tmp_path)
    rival = RevisionStore(Path(settings["store_path"]))

    def concurrent_writer() -> None:  # another admin wins between the check and the store
        rival.compare_and_set(expected_revision=None, catalog_revision="x", deployments={})

    async with served(tmp_path, deployments={}, model_host=settings) as s:
        arm("step:store:before", action=concurrent_writer)
        try:
            answer = await put(s.admin_url, {"expected_revision": None, "deployments": {"a": WARM}})
        finally:
            disarm_all()
        assert answer.status_code == 409, answer.text
        assert answer.json()["code"] == "revision_conflict"
        assert answer.json()["actual_revision"] == 1
        assert not s.host.manager.deployments  # the staged warm engine was stopped, nothing routed
        assert not s.host.manager.staging.staged
        assert s.host.manager.residency.reservations == ()


async def test_a_commit_failure_after_the_store_says_so(tmp_path: Path) -> None:
    def fail_commit() -> None:
        raise SbproxyError("the journal is full", code="store_failed")

    async with served(tmp_path, deployments={}, model_host=admin_managed(tmp_path)) as s:
        arm("reload.committed", action=fail_commit)
        try:
            answer = await put(s.admin_url, {"expected_revision": None, "deployments": {"a": TINY}})
        finally:
            disarm_all()
        assert answer.status_code == 502, answer.text
        body = answer.json()
        assert body["code"] == "runtime_commit_failed"
        assert body["durable_state_advanced"] is True
        assert body["revision"] == 1
        assert body["content_digest"] == (await get(s.admin_url))["content_digest"]
