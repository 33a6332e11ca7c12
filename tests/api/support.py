"""A served host for API tests: the runtime host of the runtime tests with the gateway and
admin apps on real uvicorn listeners on loopback (ephemeral ports)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import uvicorn

from sbproxy.api import Admin, Gateway, KeyPlane, Routing, create_admin_app, create_gateway_app
from sbproxy.api.peers import PeerDispatch
from sbproxy.api.server import Listener
from sbproxy.config import ApiKeyRecord, Route
from sbproxy.fleet.view import FleetStatus
from tests.model_host.runtime.host import Host, runtime_host

ADMIN = ("admin", "correct horse battery staple")
TINY = {"model": "tiny", "variant": "q4_k_m", "max_concurrency": 2, "queue_timeout_ms": 15000}
ROUTES = (
    Route(
        origin="localhost",
        provider="local",
        public_model="tiny-chat",
        deployment="tiny",
        default=True,
    ),
)


@dataclass
class Served:
    host: Host
    gateway: Gateway
    admin: Admin
    gateway_url: str
    admin_url: str


def _port(server: Listener) -> int:
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


@asynccontextmanager
async def served(
    root: Path,
    *,
    deployments: dict[str, dict[str, Any]] | None = None,
    mode: str | None = None,
    keys: Sequence[ApiKeyRecord] = (),
    model_host: dict[str, Any] | None = None,
    routes: Sequence[Route] = ROUTES,
    fleet: PeerDispatch | None = None,
    fleet_status: FleetStatus | None = None,
) -> AsyncIterator[Served]:
    """``fleet``: the gateway's peer dispatch (a host of a fleet); ``fleet_status``: what the
    console's fleet page shows."""
    async with (
        runtime_host(
            root,
            deployments={"tiny": TINY} if deployments is None else deployments,
            mode=mode,
            host=model_host,
        ) as host,
        anyio.create_task_group() as group,
    ):
        gateway = Gateway(
            manager=host.manager,
            routing=Routing(tuple(routes)),
            keys=KeyPlane(list(keys)),
            fleet=fleet,
            deployments=host.manager.compiled.deployments,
        )
        admin = Admin(
            manager=host.manager,
            username=ADMIN[0],
            password=ADMIN[1],
            rejections=gateway.rejections,
            usage=gateway.usage,
            disconnects=gateway.disconnects,
            activity=gateway.activity,
            peers=fleet,
            fleet=fleet_status,
        )
        servers = [
            Listener(
                uvicorn.Config(
                    app,
                    host="127.0.0.1",
                    port=0,
                    lifespan="on",
                    log_level="warning",
                    access_log=False,
                    timeout_graceful_shutdown=2,
                )
            )
            for app in (create_gateway_app(gateway), create_admin_app(admin))
        ]
        finished: list[Listener] = []

        async def run(server: Listener) -> None:
            await server.serve()
            finished.append(server)

        for server in servers:
            group.start_soon(run, server)
        with anyio.fail_after(10):
            while not all(s.started for s in servers):
                await anyio.sleep(0.02)
        try:
            yield Served(
                host=host,
                gateway=gateway,
                admin=admin,
                gateway_url=f"http://localhost:{_port(servers[0])}",
                admin_url=f"http://127.0.0.1:{_port(servers[1])}",
            )
        finally:
            for server in servers:
                server.should_exit = True
            with anyio.move_on_after(5):
                while len(finished) < len(servers):
                    await anyio.sleep(0.05)
            group.cancel_scope.cancel()
