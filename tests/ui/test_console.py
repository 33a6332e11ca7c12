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

import httpx
import pytest

from tests.api.support import ADMIN, Served, served
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


async def test_console_pages_follow_jobs_live_and_stop_reaches_stopped(tmp_path: Path) -> None:
    # A 1.5 s engine load keeps the load job running while its page is open.
    async with (
        served(tmp_path, mode="load_s=1.5", model_host={"cache": {"budget_gib": 1}}) as host,
        httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN, timeout=30) as admin,
        browser(tmp_path) as context,
    ):
        page = context.pages[0] if context.pages else await context.new_page()  # type: ignore[attr-defined]
        page.set_default_timeout(TIMEOUT_MS)

        # Jobs detail: a running load's progress arrives over SSE, without a reload.
        load = await admin.post("/admin/model-host/load", json={"deployment": "tiny"})
        job_id = load.json()["job_id"]
        await page.goto(f"{host.admin_url}/admin/ui/jobs/{job_id}")
        section = page.locator(f"section.job[data-job-id='{job_id}']")
        first = await section.get_attribute("data-status")
        assert first in ("queued", "running"), first
        await page.evaluate("window.__notReloaded = true")
        await page.wait_for_selector(f"section.job[data-job-id='{job_id}'][data-status=succeeded]")
        assert await page.evaluate("window.__notReloaded === true")
        assert await page.locator("table.steps tbody tr").count() >= 1
        assert await page.locator("[data-field=status]").text_content() == "succeeded"
        await shot(page, "job")

        # Deployments: the ready deployment shows, with its actions.
        await page.goto(f"{host.admin_url}/admin/ui/deployments")
        row = page.locator("[data-deployment=tiny]")
        await page.wait_for_selector("[data-deployment=tiny][data-state=ready]")
        for action in ("load", "stop", "drain", "reset"):
            assert await row.locator(f"[data-action={action}]").count() == 1
        await chat(host)
        await shot(page, "deployments")

        # Activity: the two requests, with tokens; the stream has a time to first token.
        await page.goto(f"{host.admin_url}/admin/ui/activity")
        requests = page.locator("#activity tr.request[data-deployment=tiny]")
        assert await requests.count() == 2
        assert await page.locator("svg.chart").count() == 2
        await shot(page, "activity")

        # Engine output: the current generation's log tail.
        await page.goto(f"{host.admin_url}/admin/ui/logs")
        tail = page.locator("section.log[data-deployment=tiny] pre.tail")
        assert "listening" in (await tail.text_content() or "")
        await shot(page, "logs")

        # Cache: the resident artifact and the gc dry run.
        await page.goto(f"{host.admin_url}/admin/ui/cache")
        assert await page.locator("#artifacts tr[data-resident=true]").count() == 1
        assert "gc would delete" in (await page.locator("#gc-preview").text_content() or "")
        await shot(page, "cache")

        # Stop from the page: the row reaches stopped and the job's progress shows live.
        await page.goto(f"{host.admin_url}/admin/ui/deployments")
        await page.wait_for_selector("[data-deployment=tiny][data-state=ready]")
        await row.locator("[data-action=stop]").click()
        await page.wait_for_selector("[data-deployment=tiny] .job-live[data-job-id]")
        await page.wait_for_selector("[data-deployment=tiny][data-state=stopped]")
        await page.wait_for_selector("[data-deployment=tiny] .job-live[data-status=succeeded]")
        stop_job = await row.locator(".job-live").get_attribute("data-job-id")
        assert stop_job
        assert host.host.manager.snapshot("tiny").state.value == "stopped"
        await shot(page, "deployments-stopped")

        # Jobs list: both jobs, each row with its id.
        await page.goto(f"{host.admin_url}/admin/ui/jobs")
        for expected in (job_id, stop_job):
            assert await page.locator(f"#jobs tr[data-job-id='{expected}']").count() == 1
        await page.goto(f"{host.admin_url}/admin/ui/jobs?kind=drain")
        assert await page.locator("#jobs tr[data-job-id]").count() == 1
        await page.goto(f"{host.admin_url}/admin/ui/jobs")
        await shot(page, "jobs")
