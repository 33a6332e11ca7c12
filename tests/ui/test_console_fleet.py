"""The console's fleet page in a real browser (Debian's chromium driven by Playwright): a
served host of a fleet whose state (a static :class:`~sbproxy.fleet.view.FleetStatus`, the
input under test) names three nodes, a controller, replicas and a placement job; and the
page's two other faces, a host outside any fleet and a fleet whose state cannot be read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from sbproxy.api.peers import PeerDispatch
from sbproxy.errors import SbproxyError
from sbproxy.fleet.routing import PeerReplica
from sbproxy.fleet.view import (
    ArtifactRow,
    ControllerRow,
    FleetView,
    NodeRow,
    PlacementJobRow,
    ReplicaRow,
)
from tests.api.fleet_hosts import CREDENTIAL, StaticDirectory
from tests.api.support import ADMIN, served
from tests.ui.test_console import ARGS, CHROMIUM, TIMEOUT_MS, shot

if TYPE_CHECKING:
    from playwright.async_api import Page

pytestmark = [pytest.mark.anyio, pytest.mark.ui]

_api = pytest.importorskip("playwright.async_api")
async_playwright = _api.async_playwright

JOB = "01JFLEETPLACEMENT00000000A"
VIEW = FleetView(
    local_node_id="a",
    nodes=(
        NodeRow("a", "ready", 800, "http://10.0.0.1:8080", {"zone": "eu-1", "gpu": "l4"}),
        NodeRow("b", "suspect", 3_500, "http://10.0.0.2:8080"),
        NodeRow("c", "lost", 25_000, "http://10.0.0.3:8080"),
        NodeRow("d", "cordoned", None),
    ),
    desired={"tiny": 2, "big": 1},
    replicas=(
        ReplicaRow("tiny", "a", "ready", generation=3, port=40001, active=1, queued=0),
        ReplicaRow("tiny", "b", "loading", generation=1, port=40002),
    ),
    controller=ControllerRow("a", epoch=7, lease_expires_in_ms=4_200),
    jobs=(PlacementJobRow(JOB, "replace", "tiny", "b", "running", 61_000),),
    artifacts=(ArtifactRow("1f2e3d4c5b6a" + "0" * 52, 2**30, ("a", "c"), ("b",)),),
)


class StaticFleet:
    def __init__(self, view: FleetView | None) -> None:
        self.current = view

    async def view(self) -> FleetView:
        if self.current is None:
            raise SbproxyError(
                "the journal's PostgreSQL server does not answer", code="journal_unavailable"
            )
        return self.current


@pytest.fixture
async def page() -> AsyncIterator[Page]:
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=ARGS, headless=True
        )
        try:
            context = await browser.new_context(
                http_credentials={"username": ADMIN[0], "password": ADMIN[1]},
                viewport={"width": 1400, "height": 900},
            )
            tab = await context.new_page()
            tab.set_default_timeout(TIMEOUT_MS)
            yield tab
        finally:
            await browser.close()


async def test_the_fleet_page_shows_nodes_replicas_controller_and_jobs(
    tmp_path: Path, page: Page
) -> None:
    directory = StaticDirectory("a")
    peers = PeerDispatch(directory, credential=CREDENTIAL)
    peers.out_of_rotation(
        PeerReplica("tiny", "b", "http://10.0.0.2:8080", 1, True, 0, 0), "ClientConnectorError"
    )
    async with served(tmp_path, fleet=peers, fleet_status=StaticFleet(VIEW)) as host:
        await page.goto(f"{host.admin_url}/admin/ui/fleet")
        assert await page.locator("nav a[aria-current=page]").inner_text() == "Fleet"
        controller = page.locator("#controller")
        assert (
            await controller.get_attribute("data-node"),
            await controller.get_attribute("data-epoch"),
        ) == ("a", "7")
        assert "runs out in 4.2 s" in await controller.inner_text()
        nodes = page.locator("#nodes tr.node")
        assert await nodes.count() == 4
        for node, state, heartbeat in (
            ("a", "ready", "800 ms ago"),
            ("b", "suspect", "3.5 s ago"),
            ("c", "lost", "25.0 s ago"),
            ("d", "cordoned", "never"),
        ):
            row = page.locator(f"#nodes tr[data-node={node}]")
            assert await row.get_attribute("data-state") == state
            assert await row.locator("[data-field=heartbeat]").inner_text() == heartbeat
        assert "(this host)" in await page.locator("#nodes tr[data-node=a]").inner_text()
        assert "zone=eu-1" in await page.locator("#nodes tr[data-node=a]").inner_text()
        # b failed a request of this gateway's: out of its rotation, whatever membership says.
        assert await page.locator("#nodes tr[data-node=b] [data-field=rotation]").count() == 1
        assert await page.locator("#nodes tr[data-node=a] [data-field=rotation]").count() == 0
        tiny = page.locator("#replicas tr[data-deployment=tiny]")
        assert await tiny.count() == 2
        ready = tiny.first.locator("[data-field=ready]")
        assert (
            await ready.get_attribute("data-ready"),
            await ready.get_attribute("data-desired"),
        ) == ("1", "2")
        assert (
            await page.locator("#replicas tr[data-deployment=tiny][data-node=b]").get_attribute(
                "data-state"
            )
            == "loading"
        )
        big = page.locator("#replicas tr[data-deployment=big]")
        assert await big.get_attribute("data-state") == "unplaced"
        assert "0 / 1" in await big.inner_text()
        job = page.locator(f'#placement-jobs tr[data-job-id="{JOB}"]')
        assert await job.get_attribute("data-status") == "running"
        assert await job.locator("a").get_attribute("href") == f"/admin/ui/jobs/{JOB}"
        assert "1 min 1 s" in await job.inner_text()
        # Where each artifact is cached, and who is pulling it now.
        artifact = page.locator("#artifacts tr.artifact")
        assert await artifact.count() == 1
        assert await artifact.get_attribute("data-nodes") == "a c"
        text = await artifact.inner_text()
        assert "sha256:1f2e3d4c5b6a" in text and "1.0 GiB" in text and "b" in text
        await shot(page, "fleet")


async def test_the_fleet_page_says_when_the_fleet_cannot_be_read_or_there_is_none(
    tmp_path: Path, page: Page
) -> None:
    fleet = StaticFleet(None)
    async with served(tmp_path / "down", fleet_status=fleet) as host:
        await page.goto(f"{host.admin_url}/admin/ui/fleet")
        error = page.locator("#fleet-error")
        assert await error.get_attribute("data-code") == "journal_unavailable"
        assert "does not answer" in await error.inner_text()
        await shot(page, "fleet-unreadable")
        fleet.current = VIEW  # the next look reads it again
        await page.reload()
        assert await page.locator("#nodes tr.node").count() == 4
    async with served(tmp_path / "alone") as host:
        async with httpx.AsyncClient(base_url=host.admin_url, auth=ADMIN) as admin:
            answer = await admin.get("/admin/ui/fleet")
        assert answer.status_code == 200
        assert 'id="no-fleet"' in answer.text
