"""Job metrics at /metrics, and one server span per gateway and admin request, with the jobs
an admin request creates linked to its span."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.api.support import ADMIN, served
from tests.support.spans import memory_spans

pytestmark = pytest.mark.anyio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return memory_spans()


async def wait_job(http: httpx.AsyncClient, job_id: str) -> dict[str, object]:
    with anyio.fail_after(20):
        while True:
            job: dict[str, object] = (await http.get(f"/admin/model-host/jobs/{job_id}")).json()[
                "job"
            ]
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            await anyio.sleep(0.05)


async def test_metrics_count_jobs_by_workflow_and_status(tmp_path: Path) -> None:
    async with (
        served(tmp_path) as host,
        httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN, timeout=30) as http,
    ):
        load = (await http.post("/admin/model-host/load", json={"deployment": "tiny"})).json()
        assert (await wait_job(http, load["job_id"]))["status"] == "succeeded"
        stop = (await http.post("/admin/model-host/stop", json={"deployment": "tiny"})).json()
        assert (await wait_job(http, stop["job_id"]))["status"] == "succeeded"
        text = (await http.get("/metrics")).text
    assert "# TYPE sbproxy_jobs_total counter" in text
    assert 'sbproxy_jobs_total{status="succeeded",workflow="load"} 1.0' in text
    assert 'sbproxy_jobs_total{status="succeeded",workflow="drain"} 1.0' in text
    assert "# TYPE sbproxy_job_duration_seconds histogram" in text
    assert 'sbproxy_job_duration_seconds_count{workflow="load"} 1.0' in text
    assert 'sbproxy_job_duration_seconds_bucket{le="+Inf",workflow="load"} 1.0' in text
    # The journal writer's contention: every write above counted once, with its commit.
    for name in ("journal_write_wait_seconds", "journal_commit_seconds"):
        assert f"# TYPE sbproxy_{name} histogram" in text
    committed = _sample(text, "sbproxy_journal_write_group_size_sum")  # writes made durable
    assert committed > 0
    assert _sample(text, "sbproxy_journal_write_wait_seconds_count") >= committed


def _sample(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on the page")


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in spans.get_finished_spans() if span.name == name]


async def test_gateway_and_admin_requests_have_server_spans(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with served(tmp_path) as host:
        async with httpx.AsyncClient(base_url=host.admin_url, timeout=30) as http:
            assert (await http.get("/admin/model-host/status")).status_code == 401
            http.auth = httpx.BasicAuth(*ADMIN)
            load = await http.post("/admin/model-host/load", json={"deployment": "tiny"})
            job_id = load.json()["job_id"]
            assert (await wait_job(http, job_id))["status"] == "succeeded"
        async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
            answer = await http.post(
                "/v1/chat/completions",
                json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
            )
            assert answer.status_code == 200
            unknown = await http.post("/v1/chat/completions", json={"model": "nope"})
            assert unknown.status_code == 404

    chat = named(spans, "POST /v1/chat/completions")
    assert len(chat) == 2
    ok, refused = sorted(chat, key=lambda s: s.start_time or 0)
    assert ok.kind == trace.SpanKind.SERVER
    assert f"{ok.context.trace_id:032x}" == TRACE_ID  # continues the caller's trace
    assert ok.parent is not None
    assert f"{ok.parent.span_id:016x}" == PARENT_SPAN_ID
    assert dict(ok.attributes or {}) == {
        "http.request.method": "POST",
        "http.route": "/v1/chat/completions",
        "http.response.status_code": 200,
        "sbproxy.listener": "gateway",
        "sbproxy.deployment": "tiny",
        "sbproxy.model": "tiny-chat",
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 5,
    }
    assert (refused.attributes or {})["http.response.status_code"] == 404

    (unauthorized,) = named(spans, "GET /admin/model-host/status")
    assert (unauthorized.attributes or {})["http.response.status_code"] == 401
    (admin_span,) = named(spans, "POST /admin/model-host/load")
    assert admin_span.kind == trace.SpanKind.SERVER
    assert (admin_span.attributes or {})["http.response.status_code"] == 202
    assert (admin_span.attributes or {})["sbproxy.listener"] == "admin"
    job_spans = [
        span
        for span in named(spans, "job load")
        if (span.attributes or {}).get("sbproxy.job.id") == job_id
    ]
    assert job_spans, [span.name for span in spans.get_finished_spans()]
    for job_span in job_spans:
        linked = [(link.context.trace_id, link.context.span_id) for link in job_span.links]
        assert linked == [(admin_span.context.trace_id, admin_span.context.span_id)]
