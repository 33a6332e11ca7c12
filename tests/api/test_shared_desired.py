"""Two hosts (separate caches) on one PostgreSQL journal under ``authority: admin_managed``
share one desired state: what one writes the other reads, and of two writing at once one
wins and the other answers ``409 revision_conflict``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.api.support import served
from tests.api.test_desired import get, put
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio


def shared(root: Path, url: str) -> dict[str, Any]:
    return {
        "authority": "admin_managed",
        "store_path": str(root / "state" / "desired.json"),
        "journal": {"url": url},
    }


async def test_two_hosts_share_the_desired_state_and_conflict_once(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database()
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    async with (
        served(a_root, deployments={}, model_host=shared(a_root, url)) as a,
        served(b_root, deployments={}, model_host=shared(b_root, url)) as b,
    ):
        first = await put(a.admin_url, {"expected_revision": None, "deployments": {}})
        assert first.status_code == 200, first.text
        assert first.json()["revision"] == 1
        seen = await get(b.admin_url)
        assert (seen["revision"], seen["content_digest"]) == (1, first.json()["content_digest"])
        assert not (a_root / "state" / "desired.json").exists()  # the store is the database

        answers: list[httpx.Response] = []

        async def write(admin_url: str) -> None:
            answers.append(await put(admin_url, {"expected_revision": 1, "deployments": {}}))

        async with anyio.create_task_group() as group:
            group.start_soon(write, a.admin_url)
            group.start_soon(write, b.admin_url)
        codes = sorted(answer.status_code for answer in answers)
        assert codes == [200, 409], [answer.text for answer in answers]
        lost = next(answer for answer in answers if answer.status_code == 409)
        assert lost.json()["code"] == "revision_conflict"
        assert (lost.json()["expected_revision"], lost.json()["actual_revision"]) == (1, 2)
        assert (await get(a.admin_url))["revision"] == (await get(b.admin_url))["revision"] == 2
