"""Who may read ``/metrics`` (docs/security.md): no credentials, but only from the admin
listener's allowlist -- the same network boundary as every admin route, which additionally
needs the admin credentials."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sbproxy.api import Admin, create_admin_app
from tests.api.support import ADMIN, served

pytestmark = pytest.mark.anyio


def _client(admin: Admin, address: str) -> httpx.AsyncClient:
    # A transport, not a listener, so that the client address can be any address.
    app = create_admin_app(admin)
    transport = httpx.ASGITransport(app=app, client=(address, 40000))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://admin")


async def test_metrics_need_the_allowlist_not_the_credentials(tmp_path: Path) -> None:
    async with served(tmp_path) as host:
        admin = Admin(
            manager=host.host.manager,
            username=ADMIN[0],
            password=ADMIN[1],
            allowlist=("10.0.0.0/8",),
        )
        async with _client(admin, "10.1.2.3") as inside:
            scraped = await inside.get("/metrics")
            assert scraped.status_code == 200
            assert 'sbproxy_model_host_active_requests{deployment="tiny"}' in scraped.text
            assert ADMIN[1] not in scraped.text
            # Every other admin route still needs the credentials, inside the allowlist too.
            assert (await inside.get("/admin/model-host/status")).status_code == 401
            status = await inside.get("/admin/model-host/status", auth=ADMIN)
            assert status.status_code == 200
            assert (await inside.get("/schema/openapi.json")).status_code == 200
        async with _client(admin, "192.0.2.7") as outside:
            refused = await outside.get("/metrics")
            assert refused.status_code == 401
            assert refused.json()["code"] == "unauthorized"
            assert "sbproxy_model_host" not in refused.text
            with_credentials = await outside.get("/admin/model-host/status", auth=ADMIN)
            assert with_credentials.status_code == 401
            # The API description is behind the allowlist too.
            assert (await outside.get("/schema/openapi.json")).status_code == 401
