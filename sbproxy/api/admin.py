"""The admin app: model-host status and lifecycle, jobs, metrics (reference section 2).

Every ``/admin/*`` route requires HTTP Basic credentials, compared in constant time; a
missing or wrong credential is a 401 with ``WWW-Authenticate``. Request bodies are bounded
to 512 KiB (413 ``request_body_too_large``); a malformed body is a 400 ``invalid_body``.
``/metrics`` (Prometheus text) and the OpenAPI document (``/schema``) are served without
credentials on the same listener, which stays on loopback unless TLS and an allowlist are
configured.

``GET /admin/model-host/status`` answers every deployment's live status and a ``config``
object (:meth:`~sbproxy.api.config_state.ConfigState.to_dict`): the active configuration
file's path and resolved path, the SHA-256 of its content, its runtime revision, the file
watcher's looks, and the last reload attempt (source, result, reason code, message, time,
job id).

Lifecycle routes (``load``, ``stop``, ``drain``, ``reset``) take ``{"deployment": id}`` (the
legacy key ``model`` is accepted), queue a durable job, start it in the background and answer
202 ``{schema_version: 1, deployment, state: "queued", job_id, poll_url}``.

Cache routes: ``GET /admin/model-host/catalog`` (the catalog in force, metadata only),
``GET /admin/model-host/files`` (the verified artifact cache, with ``resident`` set for the
artifact of a ready deployment), ``DELETE /admin/model-host/artifacts/{digest}`` (one exact
removal through the ``remove`` job) and ``POST /admin/model-host/gc`` (protected LRU
collection to ``cache.budget_gib`` through the ``gc`` job). Both mutations await their job
and protect the artifacts of configured deployments (``configured``) and of ready ones
(``resident``); the jobs add leases, locks and unfinished pulls. A protected removal is a
409 ``removal_blocked`` with its ``reason`` and runs no job.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio.abc
import anyio.to_thread
import msgspec
from litestar import Litestar, Request, Response, Router, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import HTTPRouteHandler
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sbproxy.api.activity import Activity
from sbproxy.api.config_state import ConfigState
from sbproxy.api.console import console_router, console_sampler, console_templates
from sbproxy.api.desired import desired_handlers
from sbproxy.api.errors import (
    CrossSiteRequest,
    InvalidBody,
    Unauthorized,
    admin_exception_handlers,
)
from sbproxy.api.fleet import fleet_admin_handlers
from sbproxy.api.fleet_admission import admission_handlers
from sbproxy.api.jobs import jobs_router
from sbproxy.api.metrics import Disconnects, Rejections, build_registry
from sbproxy.api.peers import PeerDispatch
from sbproxy.api.tracing import server_spans
from sbproxy.api.usage import UsageLedger, usage_handlers
from sbproxy.catalog import Catalog
from sbproxy.errors import SbproxyError
from sbproxy.fleet.agent import FleetAgent
from sbproxy.fleet.view import FleetStatus
from sbproxy.model_host.flows import (
    RemoveOutput,
)
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.service import ModelHostService
from sbproxy.store import JobRecord, JobStatus

__all__ = ["Admin", "create_admin_app"]

MAX_BODY_BYTES: Final = 512 * 1024
_DECODER = msgspec.json.Decoder()
# Integers above this lose precision in JSON readers that use doubles (reference section 2).
MAX_SAFE_JSON_INTEGER: Final = 2**53 - 1
MAX_METADATA_CHARS: Final = 256
_DIGEST = re.compile(r"[0-9a-f]{64}")
_BLOCKED_MARKER: Final = "cannot be removed: "


@dataclass
class Admin:
    """Shared state of the admin app.

    Attributes:
        manager: The runtime manager.
        username: HTTP Basic user name.
        password: HTTP Basic password (kept only as its SHA-256 below).
        rejections: Admission refusals counted by the gateway (for ``/metrics``).
        registry: Metrics registry (default: one reading ``manager``).
        allowlist: Client networks allowed (``proxy.admin.ip_allowlist``); empty: any.
        usage: The gateway's token usage (``GET /admin/model-host/usage``, ``/metrics``).
        disconnects: Client disconnects counted by the gateway (for ``/metrics``).
        config: The configuration file's state (default: from ``manager``).
        activity: The gateway's recent requests (the console's Activity page).
        peers: The gateway's peer dispatch, on a host with a fleet (for ``/metrics`` and
            the console's fleet page).
        fleet: The fleet's state, on a host of a fleet (the console's fleet page).
        agent: The fleet agent of a ``cluster_authority`` host (``/admin/fleet/*`` and the
            fleet's metrics); it is also that host's ``fleet``.
    """

    manager: RuntimeManager
    username: str
    password: str
    rejections: Rejections = field(default_factory=Rejections)
    registry: CollectorRegistry | None = None
    allowlist: tuple[str, ...] = ()
    usage: UsageLedger | None = None
    disconnects: Disconnects | None = None
    config: ConfigState | None = None
    activity: Activity = field(default_factory=Activity)
    peers: PeerDispatch | None = None
    fleet: FleetStatus | None = None
    agent: FleetAgent | None = None

    def __post_init__(self) -> None:
        if self.config is None:
            service = ModelHostService.serving(self.manager)
            self.config = ConfigState.of(service.served, revision=service.revision)
            self.manager.on_commit.append(self.config.on_commit)
        self._user = hashlib.sha256(self.username.encode()).digest()
        self._secret = hashlib.sha256(self.password.encode()).digest()
        self.password = ""
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in self.allowlist)
        if self.registry is None:
            self.registry = build_registry(
                self.manager,
                self.rejections,
                usage=self.usage,
                disconnects=self.disconnects,
                peers=self.peers,
                fleet=self.agent,
            )

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
        """Run ``work`` in the background; the manager's shutdown waits for it to settle."""
        self.manager.background(work)


_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


def same_site(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """Refuse a state-changing request a browser sent from another origin.

    A browser that holds cached Basic credentials for the admin origin (the console) sends
    them with any request to it, including a form posted by another site. Browsers mark
    those: ``Sec-Fetch-Site`` other than ``same-origin``/``none``, or an ``Origin`` that is
    not this listener's. Clients that are not browsers send neither and pass.

    Raises:
        CrossSiteRequest: ``cross_site_request``.
    """
    if connection.scope.get("method", "GET") in _SAFE_METHODS:
        return
    site = connection.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise CrossSiteRequest(f"cross-site admin request refused (Sec-Fetch-Site: {site[:32]})")
    origin = connection.headers.get("origin")
    if origin is not None:
        host = connection.headers.get("host", "")
        expected = f"{connection.url.scheme}://{host}"
        if origin.rstrip("/").lower() != expected.lower():
            raise CrossSiteRequest("cross-origin admin request refused (Origin does not match)")


def deployment_of(body: bytes) -> str:
    """The deployment id of a lifecycle body (``deployment``, or the legacy ``model``).

    Raises:
        InvalidBody: ``invalid_body``.
    """
    try:
        document = _DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
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


def _bounded(value: str) -> str:
    return value[:MAX_METADATA_CHARS]


def _exact(value: int | None) -> int | None:
    if value is not None and value > MAX_SAFE_JSON_INTEGER:
        raise SbproxyError("model catalog metadata exceeds the exact JSON integer range")
    return value


def catalog_document(catalog: Catalog) -> dict[str, object]:
    """The ``GET /admin/model-host/catalog`` body: metadata only (no sources or files).

    Raises:
        SbproxyError: ``internal`` when an integer exceeds 2^53 - 1.
    """
    models: dict[str, object] = {}
    for model_id, entry in sorted(catalog.models.items()):
        variants = [
            {
                "id": variant.id,
                "format": variant.format.value,
                "quant": _bounded(variant.quant),
                "engines": [engine.value for engine in variant.engines],
                "accelerators": sorted({a.value for a in variant.requirements.accelerators}),
                "min_memory_bytes": _exact(variant.requirements.min_memory_bytes),
                "download_size_bytes": _exact(variant.total_size_bytes),
                "stability": variant.stability.value,
                "certification": _bounded(variant.certification),
            }
            for variant in entry.variants
        ]
        models[model_id] = {
            "params": _bounded(entry.params),
            "license": _bounded(entry.license),
            "family": _bounded(entry.family),
            "context_length": _exact(entry.context_length),
            "allow_pickle": entry.allow_pickle,
            "variants": variants,
        }
    return {
        "schema_version": 1,
        "catalog_revision": catalog.catalog_revision,
        "models": models,
    }


def _blocked(digest: str, reason: str, job_id: str | None = None) -> SbproxyError:
    details: dict[str, str | None] = {"reason": reason, "artifact_digest": digest}
    if job_id is not None:
        details["job_id"] = job_id
    return SbproxyError(
        f"artifact removal refused: {reason}", code="removal_blocked", details=details
    )


def _job_failed(job: JobRecord, what: str) -> SbproxyError:
    code = job.error.code if job.error is not None else "job_failed"
    # A failure the map knows no status for reads as 502; the message stays generic.
    return SbproxyError(
        f"{what} failed ({code}); inspect the job", code=code, details={"job_id": job.id}
    )


def cache_handlers(manager: RuntimeManager) -> list[HTTPRouteHandler]:
    """The catalog, files, artifact removal and gc routes (under the admin router)."""

    @get("/model-host/catalog", sync_to_thread=False)
    def catalog() -> dict[str, object]:
        """The catalog in force: models and variants, metadata only."""
        return catalog_document(ModelHostService.serving(manager).catalog)

    @get("/model-host/files")
    async def files() -> dict[str, object]:
        """The verified artifact cache; ``resident`` marks the artifact of a ready deployment."""
        service = ModelHostService.serving(manager)
        published, total = await anyio.to_thread.run_sync(
            lambda: (service.cached(), service.cache.blob_bytes())
        )
        resident = {d for d, why in service.protected().items() if why == "resident"}
        return {
            "schema_version": 1,
            "cache_root": str(service.layout.root),
            "total_bytes": total,
            "artifacts": [
                {
                    "logical_model": m.logical_model,
                    "variant_id": m.variant_id,
                    "artifact_digest": m.artifact_digest,
                    "total_size_bytes": m.total_size_bytes,
                    "last_accessed_ms": m.last_accessed_ms,
                    "resident": m.artifact_digest in resident,
                }
                for m in published
            ],
        }

    @delete("/model-host/artifacts/{digest:str}", status_code=200)
    async def remove_artifact(digest: FromPath[str]) -> dict[str, object]:
        """Remove one exact verified artifact (a ``remove`` job, awaited)."""
        if not _DIGEST.fullmatch(digest):
            raise SbproxyError(
                "artifact digest must be 64 lowercase hex characters",
                code="invalid_artifact_digest",
            )
        details = {"artifact_digest": digest}
        service = ModelHostService.serving(manager)
        metadata = await anyio.to_thread.run_sync(lambda: service.cache.read_metadata(digest))
        if metadata is None:
            raise SbproxyError(
                "artifact is not in the verified cache", code="artifact_not_found", details=details
            )
        protected = service.protected()
        if digest in protected:
            raise _blocked(digest, protected[digest])
        job = await service.remove_digest(digest)
        if job.status != JobStatus.SUCCEEDED:
            if job.error is not None and job.error.code == "removal_blocked":
                reason = job.error.message.rpartition(_BLOCKED_MARKER)[2].strip() or "protected"
                raise _blocked(digest, reason, job.id)
            raise _job_failed(job, "artifact removal")
        output = RemoveOutput.model_validate(job.output)
        return {
            "artifact_digest": output.artifact_digest,
            "removed": output.removed,
            "reclaimed_bytes": output.reclaimed_bytes,
            "job_id": job.id,
        }

    @post("/model-host/gc", status_code=200)
    async def gc() -> dict[str, object]:
        """Protected LRU collection down to ``cache.budget_gib`` (a ``gc`` job, awaited)."""
        service = ModelHostService.serving(manager)
        budget = service.budget_bytes()  # floor(GiB x 2^30), as the reference sizes it
        if budget is None:
            raise SbproxyError(
                "no cache budget configured",
                code="no_cache_budget",
                remediation="Set proxy.model_host.cache.budget_gib.",
            )
        report, job = await service.gc(budget_bytes=budget)
        if report is None:
            raise _job_failed(job, "cache collection")
        return {**report.model_dump(mode="json"), "job_id": job.id}

    return [catalog, files, remove_artifact, gc]


def create_admin_app(admin: Admin, *, debug: bool = False) -> Litestar:
    """The admin app (see the module docstring)."""
    manager = admin.manager

    def allowlisted(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        admin.allowed(connection.client.host if connection.client else None)

    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        admin.allowed(connection.client.host if connection.client else None)
        admin.check(connection.headers.get("authorization"))
        same_site(connection)

    config = admin.config
    assert config is not None  # noqa: S101 - set in __post_init__

    @get("/model-host/status", sync_to_thread=False)
    def status() -> dict[str, object]:
        """Every deployment's live status, and the configuration file's: the active
        content's path, SHA-256 and revision, and the last reload's result."""
        rows = [entry.to_dict() for entry in manager.status()]
        return {
            "schema_version": 1,
            "serving": True,
            "runtime_revision": manager.revision,
            "config": config.to_dict(),
            "deployments": rows,
            "models": rows,
        }

    @post("/model-host/load", status_code=202)
    async def load(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Prepare and warm a deployment (a ``load`` command: joins the newest load, runs
        after earlier commands on the deployment)."""
        deployment = deployment_of(await request.body())
        return _queued(deployment, await manager.load(deployment, reason="admin"))

    async def _drain(request: Request[Any, Any, Any], reason: str) -> Response[dict[str, object]]:
        deployment = deployment_of(await request.body())
        return _queued(deployment, await manager.stop(deployment, reason=reason))

    @post("/model-host/stop", status_code=202)
    async def stop(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Drain and stop a deployment (a ``drain`` job); the artifact stays cached. A load
        in flight is cancelled: the last command wins."""
        return await _drain(request, "stop")

    @post("/model-host/drain", status_code=202)
    async def drain(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Same as stop (the reference's job kind for both is ``drain``)."""
        return await _drain(request, "drain")

    @post("/model-host/reset", status_code=202)
    async def reset(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Clear a retained failure (a ``reset`` job)."""
        deployment = deployment_of(await request.body())
        return _queued(deployment, await manager.reset(deployment))

    @get("/metrics", sync_to_thread=False, media_type=CONTENT_TYPE_LATEST, include_in_schema=False)
    def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        admin.allowed(request.client.host if request.client else None)
        assert admin.registry is not None  # noqa: S101 - set in __post_init__
        return Response(generate_latest(admin.registry), media_type=CONTENT_TYPE_LATEST)

    admin_router = Router(
        path="/admin",
        guards=[guard],
        route_handlers=[
            status,
            load,
            stop,
            drain,
            reset,
            *cache_handlers(manager),
            *desired_handlers(manager, config),
            *fleet_admin_handlers(admin.agent),
            *admission_handlers(admin.agent),
            jobs_router(lambda: ModelHostService.serving(manager), admin.spawn),
            *usage_handlers(admin.usage),
            console_router(manager, admin.activity, fleet=admin.fleet, peers=admin.peers),
        ],
    )
    return Litestar(
        route_handlers=[admin_router, metrics],
        exception_handlers=admin_exception_handlers(),
        middleware=[server_spans("admin")],
        request_max_body_size=MAX_BODY_BYTES,
        # The API description is open like /metrics (no secret in it), but only to clients
        # the listener's ip_allowlist admits.
        openapi_config=OpenAPIConfig(
            title="sbproxy admin",
            version="1",
            openapi_router=Router(
                path="/schema", guards=[allowlisted], route_handlers=[], include_in_schema=False
            ),
        ),
        template_config=console_templates(),
        lifespan=[console_sampler(manager, admin.activity)],
        debug=debug,
        # Logging is configured once by the process (sbproxy serve / run), not per app.
        logging_config=None,
    )
