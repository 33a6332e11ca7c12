"""The fleet's HTTP surface: ``/admin/fleet/*`` on the admin listener (HTTP Basic, as every
admin route) and the peer lease route on the gateway (fleet credential).

Admin routes (all JSON, ``schema_version: 1``; on a host that is not ``cluster_authority``
every one answers 409 ``fleet_disabled``):

* ``GET /admin/fleet/nodes[?all=true]`` -- ``{now_ms, controller, nodes: [...]}``, each
  node with the state the controller recorded, labels, devices, reported replicas and
  ``heartbeat_age_ms`` (database time); removed members only with ``all``;
* ``GET /admin/fleet/nodes/{node}`` -- one node (404 ``unknown_node``);
* ``POST /admin/fleet/nodes/{node}/{cordon|uncordon|drain|remove|admit}`` -- the operator's
  flag, recorded as a ``fleet.node`` job: 202 ``{job_id, node, action}``;
* ``POST /admin/fleet/nodes/{node}/revoke[?reason=...]`` -- revoke the member at once
  (:func:`~sbproxy.store.admission.revoke_node`): 202 ``{job_id, node, action}``;
* ``GET /admin/fleet/placements`` -- every placement and every replica's reported runtime
  (``sbproxy models ps --fleet``): its ``variant``, its ``estimate_basis`` (``gguf_header``
  or ``file_size``), ``stuck`` (``placement_timeout``, ``crash_loop``, ``load_failed``, or
  ``null``), the nodes deployments avoid after a stuck placement (``avoids``), and where
  each artifact is cached (``artifacts``: ``{artifact_digest, size_bytes, nodes, fetching}``,
  by digest);
* ``GET /admin/fleet/controller`` -- the lease: holder, epoch, expiry;
* ``GET /admin/fleet/events`` -- the newest fleet events (state moves, placements).

A journal that cannot be reached answers 503 ``journal_unavailable``.

Peer route: ``GET /fleet/v1/lease`` on the gateway, ``Authorization: Bearer <the calling
node's own node credential>`` with ``X-Sbproxy-Peer-Node: <its id>``, or the shared fleet
credential in force now while it is accepted (a reload that rotates it is honoured at once);
a revoked or removed member is refused whatever it presents (401 ``peer_unauthorized``):
``{node_id, renewed_at_ms, renewed_recently, fenced}`` -- what a host that cannot renew
asks its peers before fencing itself (it fences when a peer renewed, on database time, after
it lost the database).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

import anyio.to_thread
from litestar import Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath, QueryParameter

from sbproxy.api.errors import admin_error
from sbproxy.api.peer_auth import peer_refusal
from sbproxy.errors import SbproxyError
from sbproxy.fleet.agent import FleetAgent
from sbproxy.fleet.control import rpc_report_key, stuck_placements
from sbproxy.fleet.membership import LIVE_STATES, replica_state
from sbproxy.fleet.routing import replica_deployment_id
from sbproxy.fleet.view import cached_artifacts
from sbproxy.store.admission import revoke_node
from sbproxy.store.fleet import FleetSnapshot

__all__ = ["fleet_admin_handlers", "fleet_disabled", "fleet_store_error", "peer_handlers"]

_ACTIONS = {
    "cordon": {"cordoned": True},
    "uncordon": {"cordoned": False, "draining": False},
    "drain": {"cordoned": True, "draining": True},
    "remove": {"left": True},
    "admit": {"left": False},
}
EVENTS = 100


def fleet_disabled() -> Response[dict[str, object]]:
    """409 ``fleet_disabled``: this host is not a fleet member."""
    return admin_error(
        status=409,
        code="fleet_disabled",
        message="this host is not a fleet member (authority is not cluster_authority)",
        details={},
    )


def fleet_store_error(exc: SbproxyError) -> Response[dict[str, object]]:
    """The answer to a fleet store error: 503 for ``journal_unavailable``, else 500."""
    status = 503 if exc.code == "journal_unavailable" else 500
    return admin_error(status=status, code=exc.code, message=exc.message, details=exc.details)


def _nodes(
    agent: FleetAgent, snapshot: FleetSnapshot, *, removed: bool = True
) -> list[dict[str, Any]]:
    """Every member as the controller recorded it: one state, the controller's (issue 30,
    item 7), with ``heartbeat_age_ms`` beside it on database time; ``removed=False`` leaves
    out members removed from the fleet."""
    del agent  # the state shown is the controller's record, not this host's judgement
    rows = []
    for node in snapshot.nodes:
        if node.left and not removed:
            continue
        row = node.to_dict(snapshot.now_ms)
        row["controller"] = (
            snapshot.controller is not None
            and snapshot.controller.holder == node.id
            and snapshot.controller.expires_at_ms > snapshot.now_ms
        )
        rows.append(row)
    return rows


def _shown_runtime(
    node_state: str | None, runtime: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """A replica's runtime as its node last reported it -- except on a lost or departed
    node, whose report is history: shown ``unreachable``; and one keep-alive stopped, shown
    ``idle`` (a request loads it again); ``reported_state`` keeps the report."""
    if runtime is None:
        return None
    shown = replica_state(node_state, runtime.get("state"), reason_code=runtime.get("reason_code"))
    if shown == runtime.get("state"):
        return runtime
    return {**runtime, "state": shown, "reported_state": runtime.get("state")}


def _placement_row(
    placement: Any,
    states: dict[str, Any],
    reported: dict[str, dict[str, Any]],
    stuck: dict[str, Any],
) -> dict[str, Any]:
    """One placement as ``GET /admin/fleet/placements`` shows it: its row without the
    definition, whether it is stuck, its node's state, the id its node runs it under and
    that node's report of it; a split's workers each with their node's report (``state``:
    ``starting``, ``ready`` or ``failed``, ``gate_port``, ``error``) and node state."""
    row: dict[str, Any] = placement.to_dict()
    row.pop("definition")
    row["stuck"] = stuck.get(placement.id)
    row["node_state"] = states.get(placement.node)
    local = replica_deployment_id(placement.deployment, placement.replica)
    row["local_id"] = local
    row["runtime"] = _shown_runtime(row["node_state"], reported.get(placement.node, {}).get(local))
    for worker in row["workers"]:
        # A split's worker as its node reports it: starting, ready (with its gate) or failed.
        report = reported.get(worker["node"], {}).get(rpc_report_key(placement.id)) or {}
        worker["state"] = report.get("state")
        worker["gate_port"] = report.get("gate_port")
        worker["node_state"] = states.get(worker["node"])
        if report.get("error"):
            worker["error"] = report["error"]
    return row


def fleet_admin_handlers(agent: FleetAgent | None) -> list[HTTPRouteHandler]:
    """The ``/fleet/*`` admin routes (module docstring), mounted under ``/admin``."""

    async def read(events: int = 0) -> FleetSnapshot | Response[dict[str, object]]:
        """The snapshot, or the answer to give instead (no fleet, no journal)."""
        if agent is None:
            return fleet_disabled()
        try:
            return await anyio.to_thread.run_sync(lambda: agent.store.snapshot(events=events))
        except SbproxyError as exc:
            return fleet_store_error(exc)

    @get("/fleet/nodes")
    async def nodes(
        all_nodes: Annotated[bool, QueryParameter(name="all")] = False,
    ) -> Response[dict[str, object]]:
        """Every member (removed ones only with ``?all=true``), in the state the controller
        recorded, with its heartbeat age on database time."""
        snapshot = await read()
        if isinstance(snapshot, Response) or agent is None:
            return snapshot if isinstance(snapshot, Response) else fleet_disabled()
        return Response(
            {
                "schema_version": 1,
                "now_ms": snapshot.now_ms,
                "local_node": agent.identity.id,
                "controller": snapshot.controller.to_dict() if snapshot.controller else None,
                "nodes": _nodes(agent, snapshot, removed=all_nodes),
            }
        )

    @get("/fleet/nodes/{node:str}")
    async def node_show(node: FromPath[str]) -> Response[dict[str, object]]:
        """One member, and the placements on it."""
        snapshot = await read()
        if isinstance(snapshot, Response) or agent is None:
            return snapshot if isinstance(snapshot, Response) else fleet_disabled()
        found = next((row for row in _nodes(agent, snapshot) if row["id"] == node), None)
        if found is None:
            return admin_error(
                status=404,
                code="unknown_node",
                message=f"no fleet member {node!r} (sbproxy nodes list shows them)",
                details={"node": node},
            )
        found["placements"] = [p.to_dict() for p in snapshot.placements if p.node == node]
        return Response({"schema_version": 1, "node": found})

    @post("/fleet/nodes/{node:str}/{action:str}", status_code=202)
    async def node_action(
        node: FromPath[str],
        action: FromPath[str],
        reason: Annotated[str, QueryParameter(max_length=200)] = "",
    ) -> Response[dict[str, object]]:
        """Cordon, uncordon, drain, remove, admit or revoke a member (a ``fleet.node``
        job); ``reason`` is recorded with a revocation."""
        if agent is None:
            return fleet_disabled()
        flags = _ACTIONS.get(action)
        if flags is None and action != "revoke":
            return admin_error(
                status=404,
                code="unknown_action",
                message=f"unknown node action {action!r}; use {', '.join(_ACTIONS)}, revoke",
                details={"action": action},
            )
        try:
            job_id = await anyio.to_thread.run_sync(
                lambda: (
                    agent.store.set_flags(node, by=agent.identity.id, **flags)
                    if flags is not None
                    else revoke_node(
                        agent.store, node, by=agent.identity.id, reason=reason or "revoked"
                    )
                )
            )
        except SbproxyError as exc:
            return fleet_store_error(exc)
        if job_id is None:
            return admin_error(
                status=404,
                code="unknown_node",
                message=f"no fleet member {node!r} (sbproxy nodes list shows them)",
                details={"node": node},
            )
        return Response(
            {"schema_version": 1, "job_id": job_id, "node": node, "action": action},
            status_code=202,
        )

    @get("/fleet/placements")
    async def placements() -> Response[dict[str, object]]:
        """Every placement, with its node's reported runtime of the replica."""
        snapshot = await read()
        if isinstance(snapshot, Response) or agent is None:
            return snapshot if isinstance(snapshot, Response) else fleet_disabled()
        states = {row["id"]: row["state"] for row in _nodes(agent, snapshot)}
        reported = {node.id: node.replicas for node in snapshot.nodes}
        stuck = stuck_placements(
            snapshot.placements,
            snapshot.nodes,
            now_ms=snapshot.now_ms,
            timeout_ms=agent.timing.placement_timeout_ms,
        )
        rows = [_placement_row(p, states, reported, stuck) for p in snapshot.placements]
        return Response(
            {
                "schema_version": 1,
                "desired_revision": snapshot.desired_revision,
                "placements": rows,
                "avoids": [avoid.to_dict() for avoid in snapshot.avoids],
                "artifacts": [
                    row.to_dict() for row in cached_artifacts(snapshot.nodes, LIVE_STATES)
                ],
            }
        )

    @get("/fleet/controller")
    async def controller() -> Response[dict[str, object]]:
        """The controller lease."""
        snapshot = await read()
        if isinstance(snapshot, Response) or agent is None:
            return snapshot if isinstance(snapshot, Response) else fleet_disabled()
        lease = snapshot.controller
        return Response({"schema_version": 1, "controller": lease.to_dict() if lease else None})

    @get("/fleet/events")
    async def events() -> Response[dict[str, object]]:
        """The newest fleet events, newest first."""
        snapshot = await read(EVENTS)
        if isinstance(snapshot, Response):
            return snapshot
        return Response({"schema_version": 1, "events": list(snapshot.events)})

    return [nodes, node_show, node_action, placements, controller, events]


def peer_handlers(
    agent: FleetAgent | None, credential: Callable[[], str | None]
) -> list[HTTPRouteHandler]:
    """The gateway's peer route (module docstring); none without an agent.

    A peer presents its own node credential, naming itself in ``X-Sbproxy-Peer-Node``
    (a revoked or removed member is refused whatever it presents), or the shared credential
    ``credential()`` -- the one in force, read at each request (``None`` once it is no longer
    accepted): a reload that rotates it is honoured at once (the old one refused, the new one
    accepted)."""
    if agent is None:
        return []

    @get("/fleet/v1/lease", sync_to_thread=False, include_in_schema=False)
    def lease(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """This node's own view of its lease, for a peer deciding whether to fence."""
        refused = peer_refusal(request.headers, check=agent.check_peer, shared=credential())
        if refused is not None:
            return refused
        return Response(agent.lease_report())

    return [lease]
