"""The admin app: model-host status and lifecycle, jobs, metrics (reference section 2).

Every ``/admin/*`` route requires HTTP Basic credentials, compared in constant time; a
missing or wrong credential is a 401 with ``WWW-Authenticate``. Request bodies are bounded
to 512 KiB (413 ``request_body_too_large``); a malformed body is a 400 ``invalid_body``.
``/metrics`` (Prometheus text) and the OpenAPI document (``/schema``) are served without
credentials on the same listener, which stays on loopback unless TLS and an allowlist are
configured.

Lifecycle routes (``load``, ``stop``, ``drain``, ``reset``) take ``{"deployment": id}`` (the
legacy key ``model`` is accepted), queue a durable job, start it in the background and answer
202 ``{schema_version: 1, deployment, state: "queued", job_id, poll_url}``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio.abc
import msgspec
from litestar import Litestar, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sbproxy.api.errors import InvalidBody, Unauthorized, admin_exception_handlers
from sbproxy.api.jobs import jobs_router
from sbproxy.api.metrics import Rejections, build_registry
from sbproxy.model_host.runtime.jobs import submit_drain, submit_load, submit_reset
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.store import JobRecord

__all__ = ["Admin", "create_admin_app"]

MAX_BODY_BYTES: Final = 512 * 1024
_DECODER = msgspec.json.Decoder()


@dataclass
class Admin:
    """Shared state of the admin app.

    Attributes:
        manager: The runtime manager.
        username: HTTP Basic user name.
        password: HTTP Basic password (kept only as its SHA-256 below).
        group: Task group that runs the jobs the routes start.
        rejections: Admission refusals counted by the gateway (for ``/metrics``).
        registry: Metrics registry (default: one reading ``manager``).
        allowlist: Client networks allowed (``proxy.admin.ip_allowlist``); empty: any.
    """

    manager: RuntimeManager
    username: str
    password: str
    group: anyio.abc.TaskGroup
    rejections: Rejections = field(default_factory=Rejections)
    registry: CollectorRegistry | None = None
    allowlist: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._user = hashlib.sha256(self.username.encode()).digest()
        self._secret = hashlib.sha256(self.password.encode()).digest()
        self.password = ""
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in self.allowlist)
        if self.registry is None:
            self.registry = build_registry(self.manager, self.rejections)

    def allowed(self, client: str | None) -> None:
        """Refuse a client outside the allowlist.

        Raises:
            Unauthorized: ``unauthorized``.
        """
        if not self._networks:
            return
        try:
            address = ipaddress.ip_address(client or "")
        except ValueError:
            raise Unauthorized("client address not allowed") from None
        if not any(address in network for network in self._networks):
            raise Unauthorized("client address not allowed")

    def check(self, authorization: str | None) -> None:
        """Verify HTTP Basic credentials.

        Raises:
            Unauthorized: ``unauthorized``.
        """
        scheme, _, encoded = (authorization or "").partition(" ")
        if scheme.lower() != "basic":
            raise Unauthorized("admin credentials required (HTTP Basic)")
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise Unauthorized("malformed HTTP Basic credentials") from None
        user_ok = hmac.compare_digest(hashlib.sha256(user.encode()).digest(), self._user)
        password_ok = hmac.compare_digest(hashlib.sha256(password.encode()).digest(), self._secret)
        if not (sep and user_ok and password_ok):
            raise Unauthorized("wrong admin credentials")

    def spawn(self, work: Callable[[], Awaitable[object]]) -> None:
        """Run ``work`` in the background task group."""

        async def run() -> None:
            await work()

        self.group.start_soon(run)


def deployment_of(body: bytes) -> str:
    """The deployment id of a lifecycle body (``deployment``, or the legacy ``model``).

    Raises:
        InvalidBody: ``invalid_body``.
    """
    try:
        document = _DECODER.decode(body)
    except msgspec.DecodeError:
        raise InvalidBody("invalid JSON body; expected {deployment}") from None
    if not isinstance(document, dict):
        raise InvalidBody("invalid JSON body; expected {deployment}")
    value = document.get("deployment", document.get("model"))
    if not isinstance(value, str) or not value.strip():
        raise InvalidBody("missing 'deployment' (or legacy 'model')")
    return value.strip()


def _queued(deployment: str, job: JobRecord) -> Response[dict[str, object]]:
    return Response(
        {
            "schema_version": 1,
            "deployment": deployment,
            "state": "queued",
            "job_id": job.id,
            "poll_url": f"/admin/model-host/jobs/{job.id}",
        },
        status_code=202,
    )


def create_admin_app(admin: Admin, *, debug: bool = False) -> Litestar:
    """The admin app (see the module docstring)."""
    manager = admin.manager

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        admin.allowed(connection.client.host if connection.client else None)
        admin.check(connection.headers.get("authorization"))

    @get("/model-host/status", sync_to_thread=False)
    def status() -> dict[str, object]:
        """Every deployment's live status."""
        rows = [entry.to_dict() for entry in manager.status()]
        return {
            "schema_version": 1,
            "serving": True,
            "deployments": rows,
            "models": rows,
        }

    @post("/model-host/load", status_code=202)
    async def load(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Prepare and warm a deployment (a ``load`` job)."""
        deployment = deployment_of(await request.body())
        manager.slot(deployment)
        job = await submit_load(manager, deployment)
        manager.begin_load(deployment)  # joins the same job (idempotency key load:<id>)
        if not manager.slot(deployment).loading:
            admin.spawn(lambda: manager.engine.run_job(job.id))
        return _queued(deployment, job)

    async def _drain(request: Request[Any, Any, Any], reason: str) -> Response[dict[str, object]]:
        deployment = deployment_of(await request.body())
        manager.slot(deployment)
        job = await submit_drain(manager, deployment, reason=reason)
        admin.spawn(lambda: manager.engine.run_job(job.id))
        return _queued(deployment, job)

    @post("/model-host/stop", status_code=202)
    async def stop(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Drain and stop a deployment (a ``drain`` job); the artifact stays cached."""
        return await _drain(request, "stop")

    @post("/model-host/drain", status_code=202)
    async def drain(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Same as stop (the reference's job kind for both is ``drain``)."""
        return await _drain(request, "drain")

    @post("/model-host/reset", status_code=202)
    async def reset(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Clear a retained failure (a ``reset`` job)."""
        deployment = deployment_of(await request.body())
        manager.slot(deployment)
        job = await submit_reset(manager, deployment)
        admin.spawn(lambda: manager.engine.run_job(job.id))
        return _queued(deployment, job)

    @get("/metrics", sync_to_thread=False, media_type=CONTENT_TYPE_LATEST, include_in_schema=False)
    def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        admin.allowed(request.client.host if request.client else None)
        assert admin.registry is not None  # noqa: S101 - set in __post_init__
        return Response(generate_latest(admin.registry), media_type=CONTENT_TYPE_LATEST)

    admin_router = Router(
        path="/admin",
        guards=[guard],
        route_handlers=[status, load, stop, drain, reset, jobs_router(manager.engine, admin.spawn)],
    )
    return Litestar(
        route_handlers=[admin_router, metrics],
        exception_handlers=admin_exception_handlers(),
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="sbproxy admin", version="1"),
        debug=debug,
        # Logging is configured once by the process (sbproxy serve / run), not per app.
        logging_config=None,
    )
