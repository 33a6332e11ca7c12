"""The admin cache routes: catalog, files, artifact removal and gc (reference section 2)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import yaml

from sbproxy.catalog import ArtifactRequest, resolve_artifact
from sbproxy.model_host.flows import PullInput, pull_workflow
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.store import JobStatus
from tests.api.support import ADMIN, Served, served
from tests.api.test_admin import wait_job
from tests.model_host.runtime.host import write_catalog
from tests.model_host.runtime.support import write_gguf

pytestmark = pytest.mark.anyio

FILES = "/admin/model-host/files"


def admin_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, auth=ADMIN, timeout=30)


def add_spare_variant(root: Path) -> None:
    """Give ``tiny`` a second variant (``q8_0``) that no deployment uses."""
    write_catalog(root)
    source = root / "source"
    data = write_gguf(source / "spare.gguf", vocab=70).read_bytes()
    path = root / "catalog.yaml"
    document = yaml.safe_load(path.read_text())
    (first,) = document["models"]["tiny"]["variants"]
    spare = {
        **first,
        "id": "q8_0",
        "quant": "Q8_0",
        "files": [
            {
                "path": "spare.gguf",
                "sha256": hashlib.sha256(data).hexdigest(),
                "size_bytes": len(data),
            }
        ],
    }
    document["models"]["tiny"]["variants"].append(spare)
    path.write_text(yaml.safe_dump(document))


async def pull_spare(host: Served) -> str:
    manager = host.host.manager
    request = ArtifactRequest.model_validate(
        {"model": "tiny", "variant": "q8_0", "engine": "llama_cpp"}
    )
    artifact = resolve_artifact(manager.catalog, request, manager.worker).artifact
    submitted = await manager.engine.submit(
        pull_workflow, PullInput(artifact=artifact), idempotency_key=artifact.digest
    )
    job = await manager.engine.join(submitted.job.id)
    assert job.status == JobStatus.SUCCEEDED, job.error
    return artifact.digest


async def load(http: httpx.AsyncClient) -> None:
    response = await http.post("/admin/model-host/load", json={"deployment": "tiny"})
    assert response.status_code == 202
    assert (await wait_job(http, response.json()["job_id"]))["status"] == "succeeded"


async def stop(http: httpx.AsyncClient) -> None:
    response = await http.post("/admin/model-host/stop", json={"deployment": "tiny"})
    assert response.status_code == 202
    assert (await wait_job(http, response.json()["job_id"]))["status"] == "succeeded"


async def test_cache_routes_need_credentials(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.admin_url) as http:
        assert (await http.get("/admin/model-host/catalog")).status_code == 401
        assert (await http.get(FILES)).status_code == 401
        assert (await http.post("/admin/model-host/gc")).status_code == 401
        gone = await http.delete(f"/admin/model-host/artifacts/{'a' * 64}")
        assert gone.status_code == 401


async def test_catalog_lists_models_and_variants(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        response = await http.get("/admin/model-host/catalog")
        assert response.status_code == 200
        body = response.json()
        assert body["schema_version"] == 1
        assert body["catalog_revision"] == "runtime-test-1"
        tiny = body["models"]["tiny"]
        assert {k: tiny[k] for k in ("params", "license", "family", "context_length")} == {
            "params": "1M",
            "license": "apache-2.0",
            "family": "test",
            "context_length": 4096,
        }
        assert tiny["allow_pickle"] is False
        (variant,) = tiny["variants"]
        expected_size = (tmp_path / "source" / "tiny.gguf").stat().st_size
        assert variant == {
            "id": "q4_k_m",
            "format": "gguf",
            "quant": "Q4_K_M",
            "engines": ["llama_cpp"],
            "accelerators": ["cpu", "cuda"],
            "min_memory_bytes": 1,
            "download_size_bytes": expected_size,
            "stability": "preview",
            "certification": "test",
        }
        assert (await http.post("/admin/model-host/catalog")).status_code == 405


async def test_files_marks_the_ready_artifact_resident(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        empty = (await http.get(FILES)).json()
        assert empty == {
            "schema_version": 1,
            "cache_root": str(tmp_path / "cache"),
            "total_bytes": 0,
            "artifacts": [],
        }
        await load(http)
        slot = host.host.manager.deployment("tiny")
        assert slot.state == DeploymentState.READY
        assert slot.artifact is not None
        listed = (await http.get(FILES)).json()
        (entry,) = listed["artifacts"]
        assert entry["artifact_digest"] == slot.artifact.digest
        assert entry["logical_model"] == "tiny"
        assert entry["variant_id"] == "q4_k_m"
        assert entry["total_size_bytes"] == (tmp_path / "source" / "tiny.gguf").stat().st_size
        assert entry["last_accessed_ms"] > 0
        assert entry["resident"] is True
        assert listed["total_bytes"] >= entry["total_size_bytes"]
        await stop(http)
        (after,) = (await http.get(FILES)).json()["artifacts"]
        assert after["resident"] is False


async def test_delete_validates_and_refuses_protected_artifacts(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        for bad in ("abc", "A" * 64, "g" * 64, "a" * 65):
            response = await http.delete(f"/admin/model-host/artifacts/{bad}")
            assert response.status_code == 400, bad
            assert response.json()["code"] == "invalid_artifact_digest"
        unknown = await http.delete(f"/admin/model-host/artifacts/{'0' * 64}")
        assert unknown.status_code == 404
        assert unknown.json() == {
            "code": "artifact_not_found",
            "error": "artifact is not in the verified cache",
            "artifact_digest": "0" * 64,
        }
        await load(http)
        digest = (await http.get(FILES)).json()["artifacts"][0]["artifact_digest"]
        jobs_before = len((await http.get("/admin/model-host/jobs")).json()["jobs"])
        resident = await http.delete(f"/admin/model-host/artifacts/{digest}")
        assert resident.status_code == 409
        assert resident.json()["code"] == "removal_blocked"
        assert resident.json()["reason"] == "resident"
        await stop(http)
        # Stopped but still configured: the reference protects configured deployments too.
        configured = await http.delete(f"/admin/model-host/artifacts/{digest}")
        assert configured.status_code == 409
        assert configured.json()["reason"] == "configured"
        jobs = (await http.get("/admin/model-host/jobs")).json()["jobs"]
        assert not [j for j in jobs if j["kind"] == "remove"]  # refused without a job
        assert len(jobs) == jobs_before + 1  # only the stop job
        assert [a["artifact_digest"] for a in (await http.get(FILES)).json()["artifacts"]] == [
            digest
        ]


async def test_delete_removes_an_unconfigured_artifact(tmp_path: Path) -> None:
    add_spare_variant(tmp_path)
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        spare = await pull_spare(host)
        listed = (await http.get(FILES)).json()
        assert [a["artifact_digest"] for a in listed["artifacts"]] == [spare]
        assert listed["artifacts"][0]["resident"] is False
        response = await http.delete(f"/admin/model-host/artifacts/{spare}")
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["artifact_digest"] == spare
        assert body["removed"] is True
        assert body["reclaimed_bytes"] == (tmp_path / "source" / "spare.gguf").stat().st_size
        job = (await http.get(f"/admin/model-host/jobs/{body['job_id']}")).json()["job"]
        assert job["kind"] == "remove"
        assert job["status"] == "succeeded"
        assert job["subject"] == f"artifact:sha256:{spare}"
        after = (await http.get(FILES)).json()
        assert after["artifacts"] == []
        assert after["total_bytes"] == 0
        again = await http.delete(f"/admin/model-host/artifacts/{spare}")
        assert again.status_code == 404


async def test_delete_reports_a_lease_found_by_the_job(tmp_path: Path) -> None:
    add_spare_variant(tmp_path)
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        spare = await pull_spare(host)
        with host.host.manager.cache.lease(spare):
            response = await http.delete(f"/admin/model-host/artifacts/{spare}")
        assert response.status_code == 409, response.text
        assert response.json()["code"] == "removal_blocked"
        assert response.json()["reason"] == "leased"
        assert response.json()["job_id"]


async def test_gc_without_a_budget_is_refused(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        response = await http.post("/admin/model-host/gc")
        assert response.status_code == 409
        assert response.json()["code"] == "no_cache_budget"
        assert response.json()["error"] == "no cache budget configured"
        jobs = (await http.get("/admin/model-host/jobs")).json()["jobs"]
        assert not [j for j in jobs if j["kind"] == "gc"]
