"""The console's routes under ``/admin/ui`` (mounted on the guarded admin router).

Pages are rendered on the server from the runtime's frozen snapshots
(:meth:`RuntimeManager.status`), the activity ring, and the job journal, engine logs and
cache as the model-host facade (:meth:`ModelHostService.serving`) reads them; the
page script (``static/console.js``) refreshes deployment states, sends actions and follows
job events over the jobs SSE stream.

Actions are ``POST /admin/ui/actions/{load|stop|drain|reset}`` with ``{"deployment": id}``:
the same manager commands as the admin lifecycle routes, answering 202 with the job id. They
require the header ``X-Sbproxy-Console: 1``, which only the page's own script sets: a
browser never adds a custom header to a cross-site form or a simple request, and a
cross-site ``fetch`` carrying one needs a CORS preflight this listener never grants.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Final

import anyio
import anyio.to_thread
from jinja2 import Environment, FileSystemLoader
from litestar import Litestar, Request, Response, Router, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from sbproxy.api.activity import REQUESTS_KEPT, SAMPLE_INTERVAL_S, Activity
from sbproxy.api.console.views import (
    Series,
    artifact_name,
    chart_svg,
    format_age_ms,
    format_bytes,
    format_ms,
    subject_label,
)
from sbproxy.api.errors import CrossSiteRequest, InvalidBody
from sbproxy.api.jobs import check_job_id
from sbproxy.api.peers import PeerDispatch
from sbproxy.errors import SbproxyError
from sbproxy.fleet.view import FleetStatus, FleetView
from sbproxy.model_host.runtime import probe_devices
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.service import ModelHostService
from sbproxy.store import JobRecord, JobStatus, wall_clock_ms

__all__ = ["CONSOLE_HEADER", "console_router", "console_sampler", "console_templates"]

HERE: Final = Path(__file__).parent
CONSOLE_HEADER: Final = "x-sbproxy-console"
ACTIONS: Final = ("load", "stop", "drain", "reset")
JOBS_SHOWN: Final = 200
EVENTS_SHOWN: Final = 50
CHART_WINDOW_MS: Final = 10 * 60 * 1000


def console_templates() -> TemplateConfig[JinjaTemplateEngine]:
    """The console's Jinja templates (autoescaped), with its display filters."""
    environment = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=True)
    environment.filters["bytes"] = format_bytes
    environment.filters["when"] = format_ms
    environment.filters["age"] = format_age_ms
    return TemplateConfig(engine=JinjaTemplateEngine.from_environment(environment))


def console_sampler(manager: RuntimeManager, activity: Activity) -> Any:
    """An app lifespan that samples active and queued requests into ``activity`` every
    :data:`~sbproxy.api.activity.SAMPLE_INTERVAL_S` (the Activity page's queue chart)."""

    @asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        async def sample() -> None:
            while True:
                rows = manager.status()
                activity.sample(
                    active=sum(r.active_requests for r in rows),
                    queued=sum(r.queued_requests for r in rows),
                )
                await anyio.sleep(SAMPLE_INTERVAL_S)

        async with anyio.create_task_group() as group:
            group.start_soon(sample)
            try:
                yield
            finally:
                group.cancel_scope.cancel()

    return lifespan


def check_console_request(request: Request[Any, Any, Any]) -> None:
    """Refuse an action the console's own script did not send.

    Raises:
        CrossSiteRequest: ``cross_site_request``.
    """
    if request.headers.get(CONSOLE_HEADER) != "1":
        raise CrossSiteRequest(
            "console actions must come from the console page (header X-Sbproxy-Console: 1)"
        )


def _deployment_of(body: dict[str, Any] | None) -> str:
    value = (body or {}).get("deployment")
    if not isinstance(value, str) or not value.strip():
        raise InvalidBody("missing 'deployment'")
    return value.strip()


def _capacity_bytes() -> int | None:
    try:
        devices = probe_devices()
    except SbproxyError:
        return None
    return sum(d.total_bytes for d in devices) or None


def _job_row(job: JobRecord, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A job for the templates: its record, ``terminal``, and ``subject_label`` (the
    ``model:variant`` of an artifact subject, see :func:`subject_label`)."""
    return {
        **job.to_dict(),
        "terminal": job.terminal,
        "subject_label": subject_label(job.subject, job.input, names or {}),
    }


def _artifact_names(service: ModelHostService, jobs: Sequence[JobRecord]) -> dict[str, str]:
    """Artifact digest -> ``model:variant``, from the published cache and the pulls in
    ``jobs`` (a remove or gc job's input names only the digest). Blocking: reads the cache."""
    names = service.artifact_names()
    for job in jobs:
        named = artifact_name(job.input)
        if named is not None:
            names.setdefault(*named)
    return names


def _deployment_routes(manager: RuntimeManager, activity: Activity) -> list[HTTPRouteHandler]:
    """The deployments page and the actions it sends."""

    def deployment_rows(capacity: int | None) -> list[dict[str, Any]]:
        rows = []
        for entry in manager.status():
            memory = (entry.memory or {}).get("total_bytes")
            # From the runtime's own clock: the gate's last release plus keep_alive_secs.
            left_s = entry.extra.get("keep_alive_expires_in_s")
            expires = wall_clock_ms() + int(left_s * 1000) if left_s is not None else None
            rows.append(
                {
                    **entry.to_dict(),
                    "memory_bytes": memory,
                    "memory_share": memory / capacity if memory and capacity else None,
                    "keep_alive_secs": entry.keep_alive_secs,
                    "keep_alive_expires_ms": expires,
                }
            )
        return rows

    @get("/", name="console:index")
    async def index() -> Redirect:
        return Redirect("/admin/ui/deployments")

    @get("/deployments")
    async def deployments() -> Template:
        """State, generation, engine, artifact, memory, requests, keep-alive, last error."""
        capacity = await anyio.to_thread.run_sync(_capacity_bytes)
        return Template(
            "deployments.html",
            context={
                "page": "deployments",
                "rows": deployment_rows(capacity),
                "capacity": capacity,
                "actions": ACTIONS,
            },
        )

    @post("/actions/{action:str}", status_code=202)
    async def action(
        action: FromPath[str], request: Request[Any, Any, Any]
    ) -> Response[dict[str, Any]]:
        """Run one lifecycle command from the page; 202 with its job."""
        check_console_request(request)
        if action not in ACTIONS:
            raise InvalidBody(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
        try:
            body = await request.json()
        except (ValueError, SbproxyError):
            body = None
        deployment = _deployment_of(body if isinstance(body, dict) else None)
        if action == "load":
            job = await manager.load(deployment, reason="console")
        elif action == "reset":
            job = await manager.reset(deployment)
        else:
            job = await manager.stop(deployment, reason=action)
        return Response(
            {
                "deployment": deployment,
                "action": action,
                "job_id": job.id,
                "job_url": f"/admin/ui/jobs/{job.id}",
                "stream_url": f"/admin/model-host/jobs/{job.id}/stream",
            },
            status_code=202,
        )

    return [index, deployments, action]


def _job_routes(manager: RuntimeManager) -> list[HTTPRouteHandler]:
    """The jobs list and a job's detail."""

    @get("/jobs")
    async def jobs(
        status: FromQuery[str | None] = None,
        kind: FromQuery[str | None] = None,
        node: FromQuery[str | None] = None,
    ) -> Template:
        """Jobs, newest first, filtered by status, kind and node (``?node=``: the node that
        submitted the job -- on a fleet's shared journal every node's jobs are listed)."""
        statuses = (JobStatus(status),) if status in set(JobStatus) else ()
        chosen_kind = kind.strip() if kind and kind.strip() else None
        chosen_node = node.strip() if node and node.strip() else None
        service = ModelHostService.serving(manager)
        listed = await service.jobs(
            statuses=statuses, kind=chosen_kind, limit=JOBS_SHOWN, node=chosen_node
        )
        names = await anyio.to_thread.run_sync(_artifact_names, service, listed)
        return Template(
            "jobs.html",
            context={
                "page": "jobs",
                "jobs": [_job_row(j, names) for j in listed],
                "statuses": [s.value for s in JobStatus],
                "status": status if statuses else "",
                "kind": chosen_kind or "",
                "node": chosen_node or "",
                "limit": JOBS_SHOWN,
            },
        )

    @get("/jobs/{job_id:str}")
    async def job_detail(job_id: FromPath[str]) -> Template:
        """One job: its steps, attempts, error, progress and latest events, then live."""
        service = ModelHostService.serving(manager)
        job = await service.job(check_job_id(job_id))
        steps = await service.job_steps(job.id)
        events: list[dict[str, Any]] = []
        last_seq = 0
        for _ in range(40):  # bounded: at most 40 pages of 500 events
            page = await service.job_events(job.id, after_seq=last_seq, limit=500)
            if not page:
                break
            last_seq = page[-1].seq
            # The event's own sequence number apart: a step event's data has a "seq" too
            # (the step's position), which wins in to_dict().
            shown = (
                {"id": e.seq, "at_ms": e.at_ms, "type": e.type, "data": e.to_dict()} for e in page
            )
            events = [*events, *shown][-EVENTS_SHOWN:]
        names = await anyio.to_thread.run_sync(_artifact_names, service, [job])
        return Template(
            "job.html",
            context={
                "page": "jobs",
                "job": _job_row(job, names),
                "steps": [s.to_dict() for s in steps],
                "events": events,
                "last_seq": last_seq,
            },
        )

    return [jobs, job_detail]


def _activity_routes(activity: Activity) -> list[HTTPRouteHandler]:
    """The activity page."""

    @get("/activity")
    async def activity_page(
        n: Annotated[int, QueryParameter(ge=1, le=REQUESTS_KEPT)] = 100,
    ) -> Template:
        """The last requests, and charts of tokens/s and queue depth (ten minutes)."""
        limit = n
        recent = activity.recent(limit)
        end = int(time.time() * 1000)
        start = end - CHART_WINDOW_MS
        speeds = [
            (e.ended_at_ms, e.tokens_per_s)
            for e in reversed(activity.recent())
            if e.tokens_per_s is not None
        ]
        samples = activity.samples()
        return Template(
            "activity.html",
            context={
                "page": "activity",
                "requests": recent,
                "limit": limit,
                "speed_chart": chart_svg(
                    [Series("tokens/s", [(t, v) for t, v in speeds if v is not None], "speed")],
                    start_ms=start,
                    end_ms=end,
                    title="Completion tokens/s per request",
                    unit="tokens/s",
                ),
                "queue_chart": chart_svg(
                    [
                        Series("queued", [(s.at_ms, float(s.queued)) for s in samples], "queued"),
                        Series("active", [(s.at_ms, float(s.active)) for s in samples], "active"),
                    ],
                    start_ms=start,
                    end_ms=end,
                    title="Queued and active requests (all deployments)",
                    unit="requests",
                ),
            },
        )

    return [activity_page]


def _log_routes(manager: RuntimeManager) -> list[HTTPRouteHandler]:
    """The engine-output page."""

    @get("/logs")
    async def logs(
        deployment: FromQuery[str | None] = None,
        generation: Annotated[int | None, QueryParameter(ge=0)] = None,
    ) -> Template:
        """The bounded, redacted tail of each deployment's engine log."""
        service = ModelHostService.serving(manager)
        found = await anyio.to_thread.run_sync(service.engine_logs)
        known = {entry.deployment: entry.generation for entry in manager.status()}
        panels = []
        for name in sorted(set(known) | set(found)):
            if deployment and name != deployment:
                continue
            generations = found.get(name, [])
            chosen = generation if deployment and generation is not None else None
            if chosen is None:
                current = known.get(name)
                chosen = current if current in generations else next(iter(generations), None)
            tail = (
                await anyio.to_thread.run_sync(service.engine_log, name, chosen)
                if chosen is not None and chosen in generations
                else None
            )
            panels.append(
                {
                    "deployment": name,
                    "generation": chosen,
                    "generations": generations,
                    "current": known.get(name),
                    "tail": tail,
                }
            )
        return Template("logs.html", context={"page": "logs", "panels": panels})

    return [logs]


def _cache_routes(manager: RuntimeManager) -> list[HTTPRouteHandler]:
    """The cache page."""

    @get("/cache")
    async def cache() -> Template:
        """Artifacts with sizes and flags, budget use, and what gc and prune would delete."""
        service = ModelHostService.serving(manager)
        overview = await service.overview()
        protected, preview, budget = overview.protected, overview.gc_preview, overview.budget_bytes
        used = overview.used_bytes
        rows = [
            {
                "logical_model": m.logical_model,
                "variant_id": m.variant_id,
                "artifact_digest": m.artifact_digest,
                "total_size_bytes": m.total_size_bytes,
                "last_accessed_ms": m.last_accessed_ms,
                "resident": protected.get(m.artifact_digest) == "resident",
                "configured": m.artifact_digest in protected,
                "gc_victim": preview is not None and m.artifact_digest in preview.victims,
            }
            for m in overview.published
        ]
        return Template(
            "cache.html",
            context={
                "page": "cache",
                "root": str(service.layout.root),
                "artifacts": rows,
                "used_bytes": used,
                "budget_bytes": budget,
                "budget_share": used / budget if budget else None,
                "preview": preview,
                "orphans": overview.orphans,
            },
        )

    return [cache]


def _fleet_groups(view: FleetView) -> list[dict[str, Any]]:
    """Per deployment of ``view``: its replicas, how many are ready, how many are desired."""
    groups = []
    for deployment in view.deployments():
        replicas = view.replicas_of(deployment)
        groups.append(
            {
                "deployment": deployment,
                "replicas": sorted(replicas, key=lambda r: r.node_id),
                "ready": sum(r.state == "ready" for r in replicas),
                "desired": view.desired.get(deployment, 0),
            }
        )
    return groups


def _fleet_routes(fleet: FleetStatus | None, peers: PeerDispatch | None) -> list[HTTPRouteHandler]:
    """The fleet page."""

    @get("/fleet")
    async def fleet_page() -> Template:
        """Nodes with state and heartbeat age, replicas per deployment, the controller, the
        placement jobs in progress, and the peers this gateway keeps out of rotation."""
        context: dict[str, Any] = {"page": "fleet", "in_fleet": fleet is not None}
        if fleet is not None:
            try:
                view = await fleet.view()
            except SbproxyError as exc:
                context["error"] = {"code": exc.code, "message": exc.message}
            else:
                context["view"] = view
                context["deployments"] = _fleet_groups(view)
                context["out_of_rotation"] = set(peers.out_now()) if peers is not None else set()
        return Template("fleet.html", context=context)

    return [fleet_page]


def console_router(
    manager: RuntimeManager,
    activity: Activity,
    *,
    fleet: FleetStatus | None = None,
    peers: PeerDispatch | None = None,
) -> Router:
    """The ``/ui`` routes (pages, actions, static assets), to mount under ``/admin``; the
    fleet page reads ``fleet`` (and ``peers``, this gateway's rotation) on a host of a
    fleet."""
    static = create_static_files_router(
        path="/static", directories=[HERE / "static"], name="console:static"
    )
    return Router(
        path="/ui",
        route_handlers=[
            *_deployment_routes(manager, activity),
            *_job_routes(manager),
            *_activity_routes(activity),
            *_log_routes(manager),
            *_cache_routes(manager),
            *_fleet_routes(fleet, peers),
            static,
        ],
        include_in_schema=False,
    )
