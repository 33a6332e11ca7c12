"""The console's server side without a browser: pages and their test contract, the CSRF
guard on actions, the activity ring, the SSE ``?after=`` cursor, bounded redacted log tails."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sbproxy.api.activity import Activity, RequestRecord
from sbproxy.api.console.views import Series, chart_svg, subject_label
from sbproxy.model_host.engine_logs import read_tail
from tests.api.support import ADMIN, served
from tests.api.test_admin import admin_client, wait_job

pytestmark = pytest.mark.anyio

CONSOLE = {"X-Sbproxy-Console": "1"}


async def test_pages_render_with_the_test_contract(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        index = await http.get("/admin/ui/", follow_redirects=False)
        assert index.status_code in (301, 302, 307, 308)
        page = await http.get("/admin/ui/deployments")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert 'data-deployment="tiny" data-state="configured"' in page.text
        for action in ("load", "stop", "drain", "reset"):
            assert f'data-action="{action}"' in page.text
        assert "https://" not in page.text  # no CDN: every asset is ours
        script = await http.get("/admin/ui/static/console.js")
        assert script.status_code == 200
        assert "EventSource" in script.text
        for path in ("/admin/ui/jobs", "/admin/ui/activity", "/admin/ui/logs", "/admin/ui/cache"):
            assert (await http.get(path)).status_code == 200, path
        async with httpx.AsyncClient(base_url=host.admin_url) as anonymous:
            assert (await anonymous.get("/admin/ui/jobs")).status_code == 401


async def test_actions_need_the_console_header_and_the_same_origin(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        body = {"deployment": "tiny"}
        bare = await http.post("/admin/ui/actions/load", json=body)
        assert bare.status_code == 403
        assert bare.json()["code"] == "cross_site_request"
        foreign = await http.post(
            "/admin/ui/actions/load", json=body, headers={**CONSOLE, "Origin": "http://evil.test"}
        )
        assert foreign.status_code == 403
        # A cached-credential form post from another site to the plain admin API as well.
        forged = await http.post(
            "/admin/model-host/stop",
            content=json.dumps(body),
            headers={"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
        )
        assert forged.status_code == 403
        unknown = await http.post("/admin/ui/actions/explode", json=body, headers=CONSOLE)
        assert unknown.status_code == 400
        load = await http.post(
            "/admin/ui/actions/load",
            json=body,
            headers={**CONSOLE, "Origin": host.admin_url, "Sec-Fetch-Site": "same-origin"},
        )
        assert load.status_code == 202, load.text
        job = await wait_job(http, load.json()["job_id"])
        assert job["status"] == "succeeded"
        listed = await http.get("/admin/ui/jobs")
        assert f'data-job-id="{job["id"]}"' in listed.text


async def test_stream_after_query_resumes_like_last_event_id(tmp_path: Path) -> None:
    async with served(tmp_path) as host, admin_client(host.admin_url) as http:
        job_id = (await http.post("/admin/model-host/load", json={"deployment": "tiny"})).json()[
            "job_id"
        ]
        await wait_job(http, job_id)
        whole = (await http.get(f"/admin/model-host/jobs/{job_id}/stream")).text
        seqs = [int(line[4:]) for line in whole.splitlines() if line.startswith("id: ")]
        assert len(seqs) >= 2
        resumed = (await http.get(f"/admin/model-host/jobs/{job_id}/stream?after={seqs[0]}")).text
        again = [int(line[4:]) for line in resumed.splitlines() if line.startswith("id: ")]
        assert again == seqs[1:]
        assert not resumed.split("\n\n")[1].startswith('data: {"type":"job"')  # no snapshot first
        bad = await http.get(f"/admin/model-host/jobs/{job_id}/stream?after=x")
        assert bad.status_code == 400


async def test_gateway_requests_land_in_the_activity_ring(tmp_path: Path) -> None:
    async with served(tmp_path) as host, httpx.AsyncClient(base_url=host.gateway_url) as gw:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "secret prompt"}]}
        assert (await gw.post("/v1/chat/completions", json=body, timeout=30)).status_code == 200
        streamed = await gw.post("/v1/chat/completions", json={**body, "stream": True}, timeout=30)
        assert streamed.status_code == 200
        stream, plain = host.gateway.activity.recent()
        assert plain.deployment == "tiny"
        assert plain.status == 200
        assert plain.completion_tokens and plain.prompt_tokens
        assert plain.first_token_ms is None
        assert stream.first_token_ms is not None
        assert 0 < stream.first_token_ms <= stream.duration_ms
        assert stream.tokens_per_s is not None
        async with httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN) as http:
            page = (await http.get("/admin/ui/activity")).text
        assert page.count('class="request" data-deployment="tiny"') == 2
        assert "secret prompt" not in page


def test_the_ring_is_bounded_newest_first() -> None:
    ring = Activity(requests_kept=3)
    for i in range(5):
        ring.record(
            RequestRecord(
                ended_at_ms=i,
                deployment="d",
                key_name=None,
                path="/v1/completions",
                status=200,
                outcome=None,
                prompt_tokens=1,
                completion_tokens=10,
                first_token_ms=None,
                duration_ms=100.0,
            )
        )
    assert [r.ended_at_ms for r in ring.recent()] == [4, 3, 2]
    assert ring.recent(1)[0].tokens_per_s == 100.0


def test_log_tail_is_bounded_and_redacted(tmp_path: Path) -> None:
    log = tmp_path / "tiny-g1.log"
    lines = [f"line {i} " + "x" * 200 for i in range(1000)]
    lines.append("Authorization: Bearer sk-abcdefghijklmnopqrstuvwxyz0123456789")
    log.write_text("\n".join(lines) + "\n")
    tail = read_tail(log)
    assert tail.truncated
    shown = tail.text.splitlines()
    assert len(shown) <= 200
    assert len(tail.text.encode()) <= 64 * 1024
    assert shown[-2].startswith("line 999 ")
    assert "sk-abcdefghijklmnopqrstuvwxyz0123456789" not in tail.text
    assert read_tail(tmp_path / "missing.log").text == ""


def test_chart_escapes_its_labels() -> None:
    svg = chart_svg(
        [Series("<b>", [(1000, 2.0), (2000, 4.0)], "speed")],
        start_ms=0,
        end_ms=3000,
        title="<script>",
        unit="t/s",
    )
    assert "<script>" not in svg
    assert "polyline" in svg


def test_an_artifact_subject_is_named_by_model_and_variant() -> None:
    digest = "ab" * 32
    subject = f"artifact:sha256:{digest}"
    pull_input = {"artifact": {"digest": digest, "logical_model": "m", "variant_id": "q4"}}
    assert subject_label(subject, pull_input, {}) == "m:q4"
    # A remove or gc job names only the digest: the cache or another pull names it.
    assert subject_label(subject, {"digest": digest}, {digest: "m:q8"}) == "m:q8"
    assert subject_label(subject, {}, {}) == f"sha256:{digest[:12]}…"
    assert subject_label("deployment:tiny", {}, {}) == "deployment:tiny"
    assert subject_label(None, {}, {}) == "-"
