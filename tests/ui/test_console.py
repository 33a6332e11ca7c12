"""The operator console in a real browser: Debian's chromium driven by Playwright.

Nothing downloads a browser: Playwright launches ``/usr/bin/chromium`` (``executable_path``);
``scripts/test.sh`` installs the Debian package. Every page is saved as a screenshot under
``$SBPROXY_UI_SCREENSHOTS`` (default ``test-results/ui/`` in the repository) so a failing
run can be inspected.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sbproxy.catalog import (
    Accelerator,
    ArtifactRequest,
    WorkerProfile,
    load_builtin_catalog,
    resolve_artifact,
)
from sbproxy.model_host.flows import PullInput, pull_workflow
from sbproxy.model_host.flows.collect import artifact_subject
from sbproxy.store import JobRecord, JobStatus
from tests.api.support import ADMIN, Served, served
from tests.model_host.runtime.support import until
from tests.support.hf_server import HfMirror
from tests.support.tools import without_tool

pytestmark = [pytest.mark.anyio, pytest.mark.ui]

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(
    os.environ.get("SBPROXY_UI_SCREENSHOTS", Path(__file__).parents[2] / "test-results" / "ui")
)
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
TIMEOUT_MS = 20_000

if not CHROMIUM.exists():
    without_tool(
        "the console's browser tests need Debian's chromium at /usr/bin/chromium "
        "(apt-get install chromium; scripts/test.sh installs it when it runs as root)"
    )

_api = pytest.importorskip("playwright.async_api")
async_playwright = _api.async_playwright
PlaywrightError = _api.Error


@asynccontextmanager
async def browser(tmp_path: Path) -> AsyncIterator[object]:
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            args=ARGS,
            headless=True,
            http_credentials={"username": ADMIN[0], "password": ADMIN[1]},
            viewport={"width": 1400, "height": 900},
        )
        try:
            yield context
        finally:
            await context.close()


async def shot(page: object, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    print(f"screenshot: {path}")
    return path


async def chat(host: Served) -> None:
    async with httpx.AsyncClient(base_url=host.gateway_url, timeout=30) as http:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
        plain = await http.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        async with http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as streamed:
            assert streamed.status_code == 200
            async for _ in streamed.aiter_bytes():
                pass


async def test_console_without_credentials_is_401(tmp_path: Path) -> None:
    async with served(tmp_path) as host, async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), args=ARGS, headless=True
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            url = f"{host.admin_url}/admin/ui/deployments"
            seen: list[object] = []
            # Playwright wraps handlers by attribute: a bound builtin cannot be one.
            page.on("response", lambda response: seen.append(response))  # noqa: PLW0108
            # Without credentials chromium gives up on the Basic challenge: the navigation
            # fails, after the 401 arrived.
            with contextlib.suppress(PlaywrightError):
                await page.goto(url)
            (response,) = [r for r in seen if r.url == url]  # type: ignore[attr-defined]
            assert response.status == 401  # type: ignore[attr-defined]
            headers = await response.all_headers()  # type: ignore[attr-defined]
            assert headers["www-authenticate"].startswith("Basic")
            await page.wait_for_load_state()
            await shot(page, "unauthorized")
        finally:
            await context.close()


@asynccontextmanager
async def console(
    tmp_path: Path, *, mode: str | None = None, model_host: dict[str, Any] | None = None
) -> AsyncIterator[tuple[Served, httpx.AsyncClient, Any]]:
    """A served host, an admin client and a browser page on its console."""
    async with (
        served(tmp_path, mode=mode, model_host=model_host) as host,
        httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN, timeout=30) as admin,
        browser(tmp_path) as context,
    ):
        page = context.pages[0] if context.pages else await context.new_page()  # type: ignore[attr-defined]
        page.set_default_timeout(TIMEOUT_MS)
        yield host, admin, page


async def loaded(host: Served, admin: httpx.AsyncClient) -> str:
    """Load ``tiny`` and wait until it is ready; the load job's id."""
    load = await admin.post("/admin/model-host/load", json={"deployment": "tiny"})
    assert load.status_code == 202, load.text
    await until(lambda: host.host.manager.snapshot("tiny").state.value == "ready")
    return str(load.json()["job_id"])


async def test_a_running_loads_page_follows_it_live_without_a_reload(tmp_path: Path) -> None:
    # The engine stays loading until the test creates this file: the job cannot finish
    # before its page is open.
    go = tmp_path / "engine-may-be-ready"
    async with console(tmp_path, mode=f"ready_file={go}") as (host, admin, page):
        load = await admin.post("/admin/model-host/load", json={"deployment": "tiny"})
        job_id = load.json()["job_id"]
        await page.goto(f"{host.admin_url}/admin/ui/jobs/{job_id}")
        section = page.locator(f"section.job[data-job-id='{job_id}']")
        first = await section.get_attribute("data-status")
        assert first in ("queued", "running"), first
        await page.evaluate("window.__notReloaded = true")
        go.touch()
        await page.wait_for_selector(f"section.job[data-job-id='{job_id}'][data-status=succeeded]")
        assert await page.evaluate("window.__notReloaded === true")
        assert await page.locator("table.steps tbody tr").count() >= 1
        assert await page.locator("[data-field=status]").text_content() == "succeeded"
        await shot(page, "job")


async def test_the_deployments_page_shows_a_ready_deployment_with_its_actions(
    tmp_path: Path,
) -> None:
    async with console(tmp_path) as (host, admin, page):
        await loaded(host, admin)
        await page.goto(f"{host.admin_url}/admin/ui/deployments")
        row = page.locator("[data-deployment=tiny]")
        await page.wait_for_selector("[data-deployment=tiny][data-state=ready]")
        for action in ("load", "stop", "drain", "reset"):
            assert await row.locator(f"[data-action={action}]").count() == 1
        await shot(page, "deployments")


async def test_the_activity_page_shows_each_request_and_the_charts(tmp_path: Path) -> None:
    async with console(tmp_path) as (host, admin, page):
        await loaded(host, admin)
        await chat(host)
        await page.goto(f"{host.admin_url}/admin/ui/activity")
        requests = page.locator("#activity tr.request[data-deployment=tiny]")
        assert await requests.count() == 2
        assert await page.locator("svg.chart").count() == 2
        await shot(page, "activity")


async def test_the_logs_page_shows_the_current_generations_output(tmp_path: Path) -> None:
    async with console(tmp_path) as (host, admin, page):
        await loaded(host, admin)
        await page.goto(f"{host.admin_url}/admin/ui/logs")
        tail = page.locator("section.log[data-deployment=tiny] pre.tail")
        assert "listening" in (await tail.text_content() or "")
        await shot(page, "logs")


async def test_the_cache_page_shows_the_resident_artifact_and_the_gc_dry_run(
    tmp_path: Path,
) -> None:
    async with console(tmp_path, model_host={"cache": {"budget_gib": 1}}) as (host, admin, page):
        await loaded(host, admin)
        await page.goto(f"{host.admin_url}/admin/ui/cache")
        assert await page.locator("#artifacts tr[data-resident=true]").count() == 1
        assert "gc would delete" in (await page.locator("#gc-preview").text_content() or "")
        await shot(page, "cache")


async def test_stop_from_the_page_reaches_stopped_and_the_jobs_list_has_both_jobs(
    tmp_path: Path,
) -> None:
    async with console(tmp_path) as (host, admin, page):
        load_job = await loaded(host, admin)
        await page.goto(f"{host.admin_url}/admin/ui/deployments")
        row = page.locator("[data-deployment=tiny]")
        await page.wait_for_selector("[data-deployment=tiny][data-state=ready]")
        await row.locator("[data-action=stop]").click()
        await page.wait_for_selector("[data-deployment=tiny] .job-live[data-job-id]")
        await page.wait_for_selector("[data-deployment=tiny][data-state=stopped]")
        await page.wait_for_selector("[data-deployment=tiny] .job-live[data-status=succeeded]")
        stop_job = await row.locator(".job-live").get_attribute("data-job-id")
        assert stop_job
        assert host.host.manager.snapshot("tiny").state.value == "stopped"
        await shot(page, "deployments-stopped")

        await page.goto(f"{host.admin_url}/admin/ui/jobs")
        for expected in (load_job, stop_job):
            assert await page.locator(f"#jobs tr[data-job-id='{expected}']").count() == 1
        await page.goto(f"{host.admin_url}/admin/ui/jobs?kind=drain")
        assert await page.locator("#jobs tr[data-job-id]").count() == 1
        await shot(page, "jobs")


# Bound on a jobs-list row: two lines of error text plus padding (a row without the clamp,
# its error column squeezed to two characters, was ~1,100 px tall with a real pull error).
ROW_MAX_PX = 72
ERROR_MIN_PX = 200


async def failed_pull(host: Served) -> JobRecord:
    """A real pull job of the built-in smollm2 artifact, run by the host's engine against a
    real HTTP mirror that does not have the file: it fails with ``http_status`` and a long
    message (the URL, then the advice)."""
    worker = WorkerProfile(accelerator=Accelerator.CPU, memory_bytes=64 * 2**30)
    request = ArtifactRequest(model="smollm2-135m-instruct", variant="q4_1")
    artifact = resolve_artifact(load_builtin_catalog(), request, worker).artifact
    engine = host.host.engine
    submitted = await engine.submit(
        pull_workflow,
        PullInput(artifact=artifact),
        idempotency_key=artifact.digest,
        subject=artifact_subject(artifact.digest),
    )
    job = await engine.join(submitted.job.id)
    assert job.status == JobStatus.FAILED and job.error is not None, job
    return job


async def test_jobs_page_bounds_a_long_error_and_names_the_artifact_by_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HfMirror() as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        async with served(tmp_path) as host, browser(tmp_path) as context:
            job = await failed_pull(host)
            assert job.error is not None
            error = f"{job.error.code}: {job.error.message}"
            assert len(error) > 200, error
            page = context.pages[0] if context.pages else await context.new_page()  # type: ignore[attr-defined]
            page.set_default_timeout(TIMEOUT_MS)

            await page.goto(f"{host.admin_url}/admin/ui/jobs")
            row = page.locator(f"#jobs tr[data-job-id='{job.id}']")
            shown = await shot(page, "jobs-long-error")
            assert shown.is_file()
            row_box = await row.bounding_box()
            cell_box = await row.locator("td.error").bounding_box()
            assert row_box is not None and cell_box is not None
            assert row_box["height"] <= ROW_MAX_PX, row_box
            assert cell_box["width"] >= ERROR_MIN_PX, cell_box
            # The whole error is one hover away, and on the job's page.
            clip = row.locator("td.error .clip")
            assert await clip.get_attribute("title") == error
            subject = row.locator("td.subject")
            assert await subject.text_content() == "smollm2-135m-instruct:q4_1"
            assert await subject.get_attribute("title") == job.subject

            await row.locator("a").first.click()
            await page.wait_for_selector(f"section.job[data-job-id='{job.id}']")
            detail = await page.locator("[data-field=error]").text_content()
            assert detail == error
            named = await page.locator("[data-field=subject]").text_content() or ""
            assert named.startswith("smollm2-135m-instruct:q4_1")
            assert str(job.subject) in named
            await shot(page, "job-long-error")
