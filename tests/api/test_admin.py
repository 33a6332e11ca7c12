"""The admin API: Basic auth, status, lifecycle jobs, job routes and SSE, metrics, OpenAPI."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sbproxy.config import PriorityClass
from sbproxy.model_host.runtime.state import DeploymentState
from tests.api.support import ADMIN, served

pytestmark = pytest.mark.anyio


def admin_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, auth=ADMIN, timeout=30)


async def wait_job(http: httpx.AsyncClient, job_id: str) -> dict[str, object]:
    job: dict[str, object] = {}

    async def poll() -> None:
        nonlocal job
        job = (await http.get(f"/admin/model-host/jobs/{job_id}")).json()["job"]

    import anyio

    with anyio.fail_after(20):
        await poll()
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            await anyio.sleep(0.05)
            await poll()
    return job


async def test_credentials_are_required(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.admin_url) as http:
        missing = await http.get("/admin/model-host/status")
        assert missing.status_code == 401
        assert missing.json()["code"] == "unauthorized"
        assert missing.headers["www-authenticate"].startswith("Basic")
        wrong = await http.get("/admin/model-host/status", auth=(ADMIN[0], "wrong"))
        assert wrong.status_code == 401
        garbage = await http.get("/admin/model-host/status", headers={"authorization": "Basic !!"})
        assert garbage.status_code == 401
        load = await http.post("/admin/model-host/load", json={"deployment": "tiny"})
        assert load.status_code == 401


async def test_status_lists_every_deployment(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        status = (await http.get("/admin/model-host/status")).json()
        assert status["serving"] is True
        (entry,) = status["deployments"]
        assert status["models"] == status["deployments"]
        assert entry["deployment"] == "tiny"
        assert entry["state"] == "configured"
        assert entry["active_requests"] == 0


async def test_load_then_stop_through_jobs(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        load = await http.post("/admin/model-host/load", json={"deployment": "tiny"})
        assert load.status_code == 202
        body = load.json()
        assert body["state"] == "queued"
        assert body["poll_url"] == f"/admin/model-host/jobs/{body['job_id']}"
        job = await wait_job(http, body["job_id"])
        assert job["status"] == "succeeded", job
        assert host.host.manager.deployment("tiny").state == DeploymentState.READY
        stop = await http.post("/admin/model-host/stop", json={"model": "tiny"})  # legacy key
        assert stop.status_code == 202
        assert (await wait_job(http, stop.json()["job_id"]))["status"] == "succeeded"
        status = (await http.get("/admin/model-host/status")).json()
        assert status["deployments"][0]["state"] == "stopped"
        listed = (await http.get("/admin/model-host/jobs")).json()["jobs"]
        assert {j["id"] for j in listed} >= {body["job_id"], stop.json()["job_id"]}


async def test_a_load_posted_while_another_load_runs_joins_it_and_ends_ready(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        manager = host.host.manager
        first = manager.request_load("tiny", reason="request")
        load = await http.post("/admin/model-host/load", json={"deployment": "tiny"})
        assert load.status_code == 202
        job = await wait_job(http, load.json()["job_id"])
        assert job["status"] == "succeeded", job
        assert job["id"] == first.job_id  # one launch, not two
        assert manager.deployment("tiny").state == DeploymentState.READY
        assert len(manager.engine_pids()) == 1


async def test_lifecycle_input_errors(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        unknown = await http.post("/admin/model-host/load", json={"deployment": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["code"] == "unknown_deployment"
        for content in (b"{oops", b"[]", b"", b'{"deployment": 3}', b'{"deployment": " "}'):
            bad = await http.post("/admin/model-host/drain", content=content)
            assert bad.status_code == 400, content
            assert bad.json()["code"] == "invalid_body"
        huge = await http.post(
            "/admin/model-host/load", content=b'{"deployment": "' + b"x" * 600_000 + b'"}'
        )
        assert huge.status_code == 413
        assert huge.json()["code"] == "request_body_too_large"
        assert (await http.get("/admin/model-host/load")).status_code == 405


async def test_job_routes_validate_ids(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        bad = await http.get("/admin/model-host/jobs/not-a-ulid")
        assert bad.status_code == 400
        assert bad.json()["code"] == "invalid_job_id"
        missing = await http.get("/admin/model-host/jobs/01J0000000000000000000000A")
        assert missing.status_code == 404
        assert missing.json()["code"] == "job_not_found"
        assert (await http.get("/admin/model-host/jobs/nope/stream")).status_code == 400
        assert (await http.post("/admin/model-host/jobs/nope/cancel")).status_code == 400


def parse_sse(text: str) -> list[dict[str, object]]:
    frames = []
    for block in text.split("\n\n"):
        fields: dict[str, object] = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                fields["comment"] = line[1:].strip()
            elif line.startswith("id: "):
                fields["id"] = int(line[4:])
            elif line.startswith("data: "):
                fields["data"] = json.loads(line[6:])
        if fields:
            frames.append(fields)
    return frames


async def test_job_stream_ends_after_the_terminal_state_and_resumes(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        load = (await http.post("/admin/model-host/load", json={"deployment": "tiny"})).json()
        url = f"/admin/model-host/jobs/{load['job_id']}/stream"
        async with http.stream("GET", url) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            text = (await response.aread()).decode()
        frames = parse_sse(text)
        assert frames[0] == {"comment": "connected"}
        assert frames[1]["data"]["type"] == "job"  # type: ignore[index]
        assert frames[-1]["data"]["job"]["status"] == "succeeded"  # type: ignore[index]
        events = [f for f in frames if "id" in f]
        assert len(events) >= 2
        seqs = [int(f["id"]) for f in events]  # type: ignore[call-overload]
        assert seqs == sorted(seqs)
        middle = seqs[len(seqs) // 2]
        resumed = await http.get(url, headers={"Last-Event-ID": str(middle)})
        again = parse_sse(resumed.text)
        assert [int(f["id"]) for f in again if "id" in f] == [  # type: ignore[call-overload]
            s for s in seqs if s > middle
        ]
        bad = await http.get(url, headers={"Last-Event-ID": "x"})
        assert bad.status_code == 400


async def test_metrics_expose_the_gauges(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.admin_url) as http:
        upstream = await host.host.manager.acquire("tiny", priority=PriorityClass.STANDARD)
        text = (await http.get("/metrics")).text
        upstream.release()
        assert 'sbproxy_model_host_active_requests{deployment="tiny"} 1.0' in text
        assert 'sbproxy_model_host_queued_requests{deployment="tiny"} 0.0' in text
        assert (
            'sbproxy_model_host_deployment_state{deployment="tiny",engine="llama_cpp",'
            'state="ready"} 1.0' in text
        )
        assert 'state="failed"} 0.0' in text
        assert "# TYPE sbproxy_model_host_admission_rejections_total counter" in text
        assert "gpu_utilization" not in text  # no devices here: absent, never zero


async def test_openapi_document_is_served(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.admin_url) as http:
        document = (await http.get("/schema/openapi.json")).json()
        assert "/admin/model-host/status" in document["paths"]
        assert "/admin/model-host/jobs/{job_id}/stream" in document["paths"]


async def test_fleet_routes_on_a_host_that_is_not_a_fleet_member(tmp_path: Path) -> None:
    async with served(tmp_path) as host:
        async with httpx.AsyncClient(base_url=host.admin_url) as http:
            assert (await http.get("/admin/fleet/nodes")).status_code == 401
        async with admin_client(host.admin_url) as http:
            for method, path in (
                ("GET", "/admin/fleet/nodes"),
                ("GET", "/admin/fleet/nodes/n1"),
                ("POST", "/admin/fleet/nodes/n1/cordon"),
                ("GET", "/admin/fleet/placements"),
                ("GET", "/admin/fleet/controller"),
                ("GET", "/admin/fleet/events"),
            ):
                answer = await http.request(method, path)
                assert (answer.status_code, answer.json()["code"]) == (409, "fleet_disabled")
