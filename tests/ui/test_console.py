"""The operator console in a real browser: Debian's chromium driven by Playwright.

Nothing downloads a browser: Playwright launches ``/usr/bin/chromium`` (``executable_path``);
``scripts/test.sh`` installs the Debian package. Every page is saved as a screenshot under
``$SBPROXY_UI_SCREENSHOTS`` (default ``test-results/ui/`` in the repository) so a failing
run can be inspected.

One served host and one browser serve the module (:func:`console`); each test opens its own
page, and each test that changes a deployment has one of its own, so that no test depends on
another having run. The host's engines hold their launch while :attr:`Console.hold` exists,
which is how the job page is seen following a load that is certain to be still running.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
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
from sbproxy.store import JOB_TRANSITIONS, JobRecord, JobStatus
from tests.api.support import ADMIN, TINY, Served, served
from tests.support.hf_server import HfMirror
from tests.support.tools import without_tool

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Page, Playwright

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
JOB_DEADLINE_S = 30

if not CHROMIUM.exists():
    without_tool(
        "the console's browser tests need Debian's chromium at /usr/bin/chromium "
        "(apt-get install chromium; scripts/test.sh installs it when it runs as root)"
    )

_api = pytest.importorskip("playwright.async_api")
async_playwright = _api.async_playwright
PlaywrightError = _api.Error

# The deployments of the module's host, all the tiny model: ``tiny`` is loaded once and only
# read (chat, activity, logs, cache); each of the others belongs to the one test that moves it.
FOLLOWED = "followed"  # loaded, held, by the job-page test
STOPPABLE = "stoppable"  # loaded, then stopped from the page
IDLE = "idle"  # never loaded; the jobs-page test stops it for a drain job of its own
DEPLOYMENTS = {"tiny": TINY, FOLLOWED: TINY, STOPPABLE: TINY, IDLE: TINY}

# Installed before any script of a page: every value the job section's data-status takes,
# in order, from the one the server rendered on (MutationObserver records keep each old
# value, so two changes in one task are both seen).
RECORD_JOB_STATUSES = """
window.__jobStatuses = [];
document.addEventListener("DOMContentLoaded", () => {
  const section = document.querySelector("section.job[data-job-id]");
  if (!section) return;
  const seen = window.__jobStatuses;
  const note = (value) => { if (seen[seen.length - 1] !== value) seen.push(value); };
  note(section.dataset.status);
  const observer = new MutationObserver((records) => {
    for (const record of records) note(record.oldValue);
    note(section.dataset.status);
  });
  observer.observe(section, {
    attributes: true, attributeFilter: ["data-status"], attributeOldValue: true,
  });
});
"""


@dataclass
class Console:
    """The module's served host, an admin client, and a browser logged in as the admin."""

    host: Served
    admin: httpx.AsyncClient
    browser: Browser
    context: BrowserContext  # with the admin's credentials
    hold: Path  # while it exists, an engine being launched stays "loading"
    load_job: str  # the job that loaded ``tiny``

    def url(self, path: str) -> str:
        return f"{self.host.admin_url}/admin/ui{path}"

    async def command(self, verb: str, deployment: str) -> str:
        """POST an admin lifecycle command; its job id."""
        response = await self.admin.post(
            f"/admin/model-host/{verb}", json={"deployment": deployment}
        )
        assert response.status_code == 202, response.text
        job_id: str = response.json()["job_id"]
        return job_id

    async def finished(self, job_id: str) -> JobRecord:
        """The job once it ended (within :data:`JOB_DEADLINE_S`)."""
        with anyio.fail_after(JOB_DEADLINE_S):
            return await self.host.host.engine.join(job_id)


@asynccontextmanager
async def browser(playwright: Playwright) -> AsyncIterator[Browser]:
    """Debian's chromium, headless; each test context comes from :meth:`Browser.new_context`."""
    launched = await playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=ARGS, headless=True
    )
    try:
        yield launched
    finally:
        await launched.close()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """One event loop for the module: the shared host runs on it (asyncio, like the server)."""
    return "asyncio"


@pytest.fixture(scope="module")
async def console(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Console]:
    """A served host with ``tiny`` loaded and two chat requests answered (one plain, one
    streamed); a browser with the admin's credentials."""
    root = tmp_path_factory.mktemp("console")
    hold = root / "hold-engine-launch"
    async with (
        served(
            root,
            deployments=DEPLOYMENTS,
            mode=f"hold_file={hold}",
            model_host={"cache": {"budget_gib": 1}},
        ) as host,
        httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN, timeout=30) as admin,
        async_playwright() as playwright,
        browser(playwright) as chromium,
    ):
        context = await chromium.new_context(
            http_credentials={"username": ADMIN[0], "password": ADMIN[1]},
            viewport={"width": 1400, "height": 900},
        )
        try:
            shared = Console(host, admin, chromium, context, hold, load_job="")
            shared.load_job = await shared.command("load", "tiny")
            assert (await shared.finished(shared.load_job)).status == JobStatus.SUCCEEDED
            await chat(host)
            yield shared
        finally:
            await context.close()


@pytest.fixture
async def page(console: Console) -> AsyncIterator[Page]:
    """A fresh tab of the module's browser, closed after the test."""
    tab = await console.context.new_page()
    tab.set_default_timeout(TIMEOUT_MS)
    try:
        yield tab
    finally:
        await tab.close()


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """Engines launched meanwhile stay "loading" until the block ends (or :meth:`Path.unlink`)."""
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


async def shot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
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


def legal_walk(statuses: list[str]) -> bool:
    """Whether each status follows the one before it in ``JOB_TRANSITIONS``."""
    walk = [JobStatus(s) for s in statuses]
    return all(after in JOB_TRANSITIONS[before] for before, after in pairwise(walk))


async def test_console_without_credentials_is_401(console: Console) -> None:
    context = await console.browser.new_context()
    try:
        page = await context.new_page()
        url = console.url("/deployments")
        seen: list[Any] = []
        # Playwright wraps handlers by attribute: a bound builtin cannot be one.
        page.on("response", lambda response: seen.append(response))  # noqa: PLW0108
        # Without credentials chromium gives up on the Basic challenge: the navigation
        # fails, after the 401 arrived.
        with contextlib.suppress(PlaywrightError):
            await page.goto(url)
        (response,) = [r for r in seen if r.url == url]
        assert response.status == 401
        headers = await response.all_headers()
        assert headers["www-authenticate"].startswith("Basic")
        await page.wait_for_load_state()
        await shot(page, "unauthorized")
    finally:
        await context.close()


async def test_deployments_page_shows_the_ready_deployment_with_its_actions(
    console: Console, page: Page
) -> None:
    await page.goto(console.url("/deployments"))
    await page.wait_for_selector("[data-deployment=tiny][data-state=ready]")
    row = page.locator("[data-deployment=tiny]")
    for action in ("load", "stop", "drain", "reset"):
        assert await row.locator(f"[data-action={action}]").count() == 1
    await shot(page, "deployments")


async def test_job_page_follows_a_running_load_live_until_it_succeeds(
    console: Console, page: Page
) -> None:
    await page.add_init_script(RECORD_JOB_STATUSES)
    with holding(console.hold):
        job_id = await console.command("load", FOLLOWED)
        section = f"section.job[data-job-id='{job_id}']"
        # The engine stays "loading" while the hold lasts, so once the job runs it keeps
        # running: the page is certain to render it running and to follow it.
        with anyio.fail_after(JOB_DEADLINE_S):
            while (await console.host.host.engine.get(job_id)).status != JobStatus.RUNNING:
                await anyio.sleep(0.05)
        await page.goto(console.url(f"/jobs/{job_id}"))
        await page.wait_for_selector(section)
        assert await page.locator("[data-field=live]").text_content() == "(live)"
        await page.evaluate("window.__notReloaded = true")
        assert (await console.host.host.engine.get(job_id)).status == JobStatus.RUNNING
    # Released: the load ends, and its progress reaches the open page over SSE.
    await page.wait_for_selector(f"{section}[data-status=succeeded]")
    assert await page.evaluate("window.__notReloaded === true")
    statuses: list[str] = await page.evaluate("window.__jobStatuses")
    assert statuses[0] == "running" and statuses[-1] == "succeeded", statuses
    assert legal_walk(statuses), statuses
    assert await page.locator("table.steps tbody tr").count() >= 1
    assert await page.locator("[data-field=status]").text_content() == "succeeded"
    assert await page.locator("[data-field=live]").text_content() == ""
    assert (await console.finished(job_id)).status == JobStatus.SUCCEEDED
    await shot(page, "job")


async def test_activity_page_shows_the_requests_and_the_charts(
    console: Console, page: Page
) -> None:
    await page.goto(console.url("/activity"))
    # The plain and the streamed request of the module's host.
    assert await page.locator("#activity tr.request[data-deployment=tiny]").count() == 2
    assert await page.locator("svg.chart").count() == 2
    await shot(page, "activity")


async def test_logs_page_shows_the_engine_output_of_the_current_generation(
    console: Console, page: Page
) -> None:
    await page.goto(console.url("/logs"))
    tail = page.locator("section.log[data-deployment=tiny] pre.tail")
    assert "listening" in (await tail.text_content() or "")
    await shot(page, "logs")


async def test_cache_page_shows_the_resident_artifact_and_the_gc_dry_run(
    console: Console, page: Page
) -> None:
    await page.goto(console.url("/cache"))
    # Every deployment of the host serves the same artifact: one row, resident.
    assert await page.locator("#artifacts tr[data-resident=true]").count() == 1
    assert "gc would delete" in (await page.locator("#gc-preview").text_content() or "")
    await shot(page, "cache")


async def test_stop_from_the_deployments_page_reaches_stopped_and_shows_its_job_live(
    console: Console, page: Page
) -> None:
    load = await console.command("load", STOPPABLE)
    assert (await console.finished(load)).status == JobStatus.SUCCEEDED
    await page.goto(console.url("/deployments"))
    row = page.locator(f"[data-deployment={STOPPABLE}]")
    await page.wait_for_selector(f"[data-deployment={STOPPABLE}][data-state=ready]")
    await row.locator("[data-action=stop]").click()
    await page.wait_for_selector(f"[data-deployment={STOPPABLE}] .job-live[data-job-id]")
    await page.wait_for_selector(f"[data-deployment={STOPPABLE}][data-state=stopped]")
    await page.wait_for_selector(f"[data-deployment={STOPPABLE}] .job-live[data-status=succeeded]")
    stop_job = await row.locator(".job-live").get_attribute("data-job-id")
    assert stop_job
    stopped = await console.finished(stop_job)
    assert (stopped.kind, stopped.status) == ("drain", JobStatus.SUCCEEDED)
    assert console.host.host.manager.snapshot(STOPPABLE).state.value == "stopped"
    await shot(page, "deployments-stopped")


async def test_jobs_page_lists_the_jobs_and_filters_them_by_kind(
    console: Console, page: Page
) -> None:
    drain = await console.command("stop", IDLE)
    assert (await console.finished(drain)).status == JobStatus.SUCCEEDED
    rows = "#jobs tr[data-job-id]"

    async def listed() -> set[str]:
        return {str(await r.get_attribute("data-job-id")) for r in await page.locator(rows).all()}

    await page.goto(console.url("/jobs"))
    for expected in (console.load_job, drain):
        assert await page.locator(f"#jobs tr[data-job-id='{expected}']").count() == 1
    await shot(page, "jobs")
    # The filter shows exactly the store's drain jobs (another test may have made one).
    await page.goto(console.url("/jobs?kind=drain"))
    drains = await console.host.host.engine.store.list_jobs(kind="drain", limit=-1)
    assert await listed() == {j.id for j in drains}
    assert drain in {j.id for j in drains} and console.load_job not in {j.id for j in drains}


async def test_jobs_page_shows_each_jobs_node_and_filters_by_it(
    console: Console, page: Page
) -> None:
    # On a fleet's shared journal the page lists every node's jobs: one of them is made
    # another node's here (the column and the filter are what is under test).
    drain = await console.command("stop", IDLE)
    assert (await console.finished(drain)).status == JobStatus.SUCCEEDED
    journal = console.host.host.layout.root / "jobs" / "journal.db"
    with contextlib.closing(sqlite3.connect(journal, timeout=10)) as connection, connection:
        connection.execute("UPDATE jobs SET node = 'node-b' WHERE id = ?", (drain,))
    own = (await console.host.host.engine.get(console.load_job)).node
    assert own and own != "node-b"

    await page.goto(console.url("/jobs"))
    assert await page.locator("#jobs thead th").nth(2).inner_text() == "Node"
    theirs = page.locator(f"#jobs tr[data-job-id='{drain}']")
    assert await theirs.get_attribute("data-node") == "node-b"
    assert await theirs.locator("td.node").inner_text() == "node-b"
    mine = page.locator(f"#jobs tr[data-job-id='{console.load_job}']")
    assert await mine.locator("td.node").inner_text() == own
    # The node's link filters the list by it, and the form keeps the filter.
    await theirs.locator("td.node a").click()
    await page.wait_for_url("**/jobs?node=node-b")
    nodes = {
        await r.get_attribute("data-node")
        for r in await page.locator("#jobs tr[data-job-id]").all()
    }
    assert nodes == {"node-b"}
    assert await page.locator("input[name=node]").input_value() == "node-b"
    await page.goto(console.url(f"/jobs?node={own}"))
    listed = {
        await r.get_attribute("data-job-id")
        for r in await page.locator("#jobs tr[data-job-id]").all()
    }
    assert console.load_job in listed and drain not in listed
    await page.goto(console.url("/jobs?node=nowhere"))
    assert await page.locator("#jobs tr[data-job-id]").count() == 0
    assert "No jobs match." in await page.locator("#jobs").inner_text()


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
    console: Console, page: Page, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HfMirror() as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        job = await failed_pull(console.host)
    assert job.error is not None
    error = f"{job.error.code}: {job.error.message}"
    assert len(error) > 200, error

    await page.goto(console.url("/jobs"))
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
