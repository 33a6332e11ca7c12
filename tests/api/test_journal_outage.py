"""A served host whose PostgreSQL journal goes away keeps serving: the gateway and the
status route answer, a mutation that needs the journal is ``503 journal_unavailable``
naming ``host:port``, and once the server is back the same host runs the mutation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.api.support import ADMIN, TINY, served
from tests.support.postgres import PostgresServer

pytestmark = pytest.mark.anyio


async def chat(gateway_url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{gateway_url}/v1/chat/completions",
            json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]},
        )


async def test_serving_goes_on_while_the_journal_is_away(
    tmp_path: Path, own_postgres_server: PostgresServer
) -> None:
    url = own_postgres_server.create_database()
    host = {"journal": {"url": url}, "cache": {"budget_gib": 1}}
    warm = {"tiny": {**TINY, "warm": True}}
    async with (
        served(tmp_path, deployments=warm, model_host=host) as s,
        httpx.AsyncClient(auth=ADMIN, timeout=30) as admin,
    ):
        assert (await admin.post(f"{s.admin_url}/admin/model-host/gc")).status_code == 200
        assert (await chat(s.gateway_url)).status_code == 200  # loaded (its load job done)

        own_postgres_server.stop_server("fast")
        refused = await admin.post(f"{s.admin_url}/admin/model-host/gc")
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "journal_unavailable"
        assert f"127.0.0.1:{own_postgres_server.port}" in refused.text, refused.text
        status = await admin.get(f"{s.admin_url}/admin/model-host/status")
        assert status.status_code == 200
        answer = await chat(s.gateway_url)
        assert answer.status_code == 200, answer.text  # the loaded engine still serves

        own_postgres_server.start_server()
        again = await admin.post(f"{s.admin_url}/admin/model-host/gc")
        assert again.status_code == 200, again.text
