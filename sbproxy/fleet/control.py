"""The controller's and the node's decisions over a fleet snapshot, as pure functions.

:mod:`sbproxy.fleet.agent` reads a :class:`~sbproxy.store.fleet.FleetSnapshot`, calls these,
and carries out what they return (fenced writes, a local reload). Nothing here does I/O or
reads a clock: database time comes in the snapshot.

* :func:`observe` -- each member's state on database time. A controller that took the lease
  less than ``lost_after_ms`` ago counts a member's silence only from its own take-over
  (ARCHITECTURE.md "No re-placement storms"): a new controller never declares a node lost
  for silence it did not witness.
* :func:`node_moves` -- the recorded state changes, each checked against the transition
  table (:func:`~sbproxy.fleet.membership.move`).
* :func:`placement_views` -- the recorded placements as the planner sees them: a placement
  whose definition is the deployment's current one counts as the current revision, so a
  change to one deployment does not roll every other one.
* :func:`judge_own_lease`, :func:`partition_peers` -- whether a node that cannot renew
  fences itself, and whom it asks.
* :func:`forgettable` -- placements on gone nodes whose replica now serves elsewhere.
* :func:`local_deployments` -- what one node must run: its placements' definitions (with the
  variant a placement names pinned).
* :func:`stuck_placements` -- placements never ready past ``placement_timeout_ms``, or whose
  node reports the load failed or the engine in a crash loop.
* :func:`reported_facts`, :func:`facts_of`, :func:`device_capacities` -- what a node reports
  of itself: GGUF header facts per artifact, each device with its own budget.
* :func:`deployment_spec` -- one desired deployment as the planner sees it: its estimate from
  a member's GGUF facts when one reported them, else from file sizes; under
  ``heterogeneous_variants`` with no pinned variant, every catalog variant as a choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from sbproxy.catalog import (
    Accelerator,
    ArtifactFormat,
    Catalog,
    ResolvedArtifact,
    pinned_artifact,
)
from sbproxy.config import FENCE_ASKS, DeploymentConfig
from sbproxy.errors import SbproxyError
from sbproxy.fleet.membership import (
    FenceVerdict,
    FleetTiming,
    IllegalNodeTransition,
    NodeState,
    NodeTransition,
    PeerAnswer,
    derive_state,
    fence_verdict,
    move,
)
from sbproxy.fleet.placement import (
    DeploymentSpec,
    DeviceCapacity,
    EstimateBasis,
    NodeView,
    PlacementState,
    PlacementView,
    SplitWorker,
    StuckReason,
    VariantChoice,
)
from sbproxy.fleet.routing import replica_deployment_id
from sbproxy.model_host.runtime.memory import GgufFacts, estimate_memory

__all__ = [
    "PLACEMENT_FIELDS",
    "UNREACHED_ASKS_TO_FENCE",
    "DeviceTable",
    "NodeMove",
    "avoided_nodes",
    "catalog_artifact",
    "definition_digest",
    "deployment_spec",
    "device_capacities",
    "facts_of",
    "failed_workers",
    "forgettable",
    "judge_own_lease",
    "local_deployments",
    "local_placements",
    "node_moves",
    "observe",
    "partition_peers",
    "placement_views",
    "reported_facts",
    "rpc_report_key",
    "stuck_placements",
]

logger = logging.getLogger(__name__)

_GONE = frozenset({NodeState.LOST, NodeState.LEFT})


UNREACHED_ASKS_TO_FENCE = FENCE_ASKS
"""Asks in a row that reach no peer at all before a minority partition fences: one slow
answer on a busy host is not a partition (part of :func:`~sbproxy.config.fence_bound_ms`)."""


def judge_own_lease(
    *,
    since_own_renewal_ms: int,
    cut_off_at_ms: int,
    timing: FleetTiming,
    peers_known: int,
    answers: Sequence[PeerAnswer],
    unreached_before: int,
    failing_until_ms: int | None = None,
) -> tuple[FenceVerdict, int]:
    """:func:`~sbproxy.fleet.membership.fence_verdict`, with a minority-partition fence
    confirmed by a second ask.

    Returns:
        The verdict and the count of asks in a row that reached no peer (pass it back as
        ``unreached_before`` next time). A ``fence`` because no peer answered becomes
        ``hold`` until :data:`UNREACHED_ASKS_TO_FENCE` asks in a row reached none; a peer
        that renewed while this node failed (from ``cut_off_at_ms`` to
        ``failing_until_ms``) fences at once.
    """
    verdict = fence_verdict(
        since_own_renewal_ms=since_own_renewal_ms,
        cut_off_at_ms=cut_off_at_ms,
        timing=timing,
        peers_known=peers_known,
        answers=answers,
        failing_until_ms=failing_until_ms,
    )
    none_reached = bool(answers) and not any(answer.reached for answer in answers)
    unreached = unreached_before + 1 if none_reached else 0
    if none_reached and unreached < UNREACHED_ASKS_TO_FENCE:
        verdict = FenceVerdict.HOLD
    return verdict, unreached


def partition_peers(
    nodes: Sequence[Any], *, node_id: str, at_ms: int, timing: FleetTiming
) -> list[Any]:
    """The members a node that cannot renew asks before fencing: every other member, not
    ``left``, with an advertise URL, that renewed within ``lost_after_ms`` of ``at_ms`` (the
    database time of this node's last successful renewal). A member dead for longer is no
    partition peer: counting it would fence the only survivor of a two-node fleet in an
    outage for everyone (issue 30, item 19).

    Args:
        nodes: ``NodeRow``-shaped members of this node's last snapshot.
        node_id: This node.
        at_ms: This node's last successful renewal, on database time.
        timing: The fleet's timing.
    """
    return [
        node
        for node in nodes
        if node.id != node_id
        and not node.left
        and node.advertise_url
        and at_ms - node.renewed_at_ms < timing.lost_after_ms
    ]


@dataclass(frozen=True)
class NodeMove:
    """A member's recorded state that must change: ``node`` and the checked transition.

    ``routine``: nothing is wrong -- back to ``ready``, a graceful stop (``leaving``), or
    ``suspect`` only because a controller that just took over has not seen the node renew
    yet while its last renewal is recent (:func:`observe`); logged as information, the
    rest as warnings."""

    node: str
    transition: NodeTransition
    routine: bool = False


PLACEMENT_FIELDS = frozenset(
    {"replicas", "required_labels", "spread_by", "heterogeneous_variants", "routing"}
)
"""Fields that say where and how many replicas run, or how gateways pick among them
(``routing``: read from the desired state by every routing table), not what one replica
runs: a change of them re-plans, it does not roll the replicas that stay."""


def definition_digest(definition: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys) of what one replica runs: the
    definition without :data:`PLACEMENT_FIELDS`."""
    body = {k: v for k, v in definition.items() if k not in PLACEMENT_FIELDS}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def observe(
    nodes: Sequence[Any],
    *,
    now_ms: int,
    timing: FleetTiming,
    watching_since_ms: int | None = None,
    renewed_here: str | None = None,
) -> list[NodeView]:
    """Every member as the planner sees it, its state derived on database time.

    Args:
        nodes: ``NodeRow``-shaped members.
        now_ms: Database now.
        timing: The fleet's timing.
        watching_since_ms: When this controller took the lease (database time), while it
            is younger than ``lost_after_ms``. A member's silence before it is not counted
            toward ``lost`` (ARCHITECTURE.md "No re-placement storms"), but a member with no
            renewal since it is ``suspect``, never ``ready``: it takes no new replica until
            this controller has seen it renew (issue 30, item 4). A member already recorded
            ``lost`` or ``left`` gets no such grace: it stays gone until it renews (item 21).
        renewed_here: The controller's own node, whose renewal it made itself in the
            same beat, before this pass: seen, so never ``unconfirmed`` (a new controller
            is not ``suspect`` to itself).
    """
    views = []
    for node in nodes:
        inventory = getattr(node, "inventory", None) or {}
        verified = {
            digest: int(entry.get("bytes", 0))
            for digest, entry in inventory.items()
            if entry.get("verified")
        }
        last = node.renewed_at_ms
        unconfirmed = False
        gone = node.state in (NodeState.LOST.value, NodeState.LEFT.value)
        seen = node.id == renewed_here
        if watching_since_ms is not None and not gone and not seen and last < watching_since_ms:
            last, unconfirmed = watching_since_ms, True
        leaving = getattr(node, "leaving_at_ms", None)
        if leaving is not None and node.renewed_at_ms <= leaving:
            # A graceful leave: its grace counts from the mark, or from this controller's
            # take-over if later (nobody watched before).
            leaving = max(leaving, watching_since_ms or leaving)
        else:
            leaving = None
        state = derive_state(
            last_renewal_ms=last,
            now_ms=now_ms,
            timing=timing,
            cordoned=node.cordoned,
            draining=node.draining,
            left=node.left,
            unconfirmed=unconfirmed,
            leaving_since_ms=leaving,
        )
        views.append(
            NodeView(
                id=node.id,
                state=state,
                draining=bool(node.draining),
                labels=dict(node.labels),
                engines=frozenset(node.engines),
                devices=tuple(DeviceCapacity.model_validate(d) for d in node.devices),
                # Locality: what it reported verified (the inventory, and the digest list
                # of hosts that report no inventory yet).
                cached_artifacts=frozenset(node.artifacts) | frozenset(verified),
                cached_bytes=verified,
            )
        )
    return views


def node_moves(
    nodes: Sequence[Any],
    views: Sequence[NodeView],
    *,
    now_ms: int | None = None,
    timing: FleetTiming | None = None,
) -> list[NodeMove]:
    """The recorded states that differ from the observed ones, each a checked move; a move
    the table forbids is logged and skipped (a stale read: the next pass sees it again).
    With ``now_ms`` (database time) and ``timing``, a move to ``suspect`` of a node whose
    last renewal is not late is told apart as routine (:attr:`NodeMove.routine`)."""
    observed = {view.id: view.state for view in views}
    moves = []
    for node in nodes:
        recorded = NodeState(node.state)
        now = observed.get(node.id)
        if now is None or now == recorded:
            continue
        try:
            transition = move(recorded, now)
        except IllegalNodeTransition as exc:
            logger.warning("node %s: %s", node.id, exc)
            continue
        unconfirmed = (
            now is NodeState.SUSPECT
            and now_ms is not None
            and timing is not None
            and now_ms - node.renewed_at_ms <= timing.suspect_after_ms
        )
        routine = now in (NodeState.READY, NodeState.LEAVING) or unconfirmed
        moves.append(NodeMove(node.id, transition, routine=routine))
    return moves


def placement_views(
    placements: Sequence[Any],
    current: Mapping[str, tuple[int, str]],
    stuck: Mapping[str, StuckReason] | None = None,
    sizes: Mapping[tuple[str, str | None], int] | None = None,
    failed_on: Mapping[str, str] | None = None,
) -> list[PlacementView]:
    """Recorded placements for :func:`~sbproxy.fleet.placement.plan`.

    Args:
        placements: ``PlacementRow``-shaped placements.
        current: ``{deployment: (revision, definition digest)}`` of the desired state; a
            placement with that digest is shown at that revision.
        stuck: ``{placement id: reason}`` from :func:`stuck_placements`.
        sizes: ``{(deployment, variant): bytes per device}`` of the desired state's choices
            now; a placement of the current definition holds that many bytes in the plan
            rather than what it was placed with (so a replica placed on file sizes before
            any node reported the GGUF header is sized from the header once one has); a
            split keeps the shares it was placed with.
        failed_on: ``{placement id: node}`` of the splits whose worker failed on that node
            (:func:`failed_workers`).
    """
    stuck = stuck or {}
    sizes = sizes or {}
    failed_on = failed_on or {}
    views = []
    for placement in placements:
        revision = placement.revision
        reserved = placement.reserved_bytes
        wanted = current.get(placement.deployment)
        if wanted is not None and definition_digest(placement.definition) == wanted[1]:
            revision = wanted[0]
            if not placement.workers:
                reserved = sizes.get((placement.deployment, placement.variant), reserved)
        views.append(
            PlacementView(
                id=placement.id,
                deployment=placement.deployment,
                replica=placement.replica,
                revision=revision,
                node=placement.node,
                devices=tuple(placement.devices),
                reserved_bytes=reserved,
                state=PlacementState(placement.state),
                replaces=placement.replaces,
                stuck=stuck.get(placement.id),
                workers=tuple(SplitWorker.model_validate(w) for w in placement.workers),
                stuck_node=failed_on.get(placement.id),
            )
        )
    return views


def rpc_report_key(placement_id: str) -> str:
    """The key of a split's worker in its node's report (beside the local replicas'
    ids, which never hold a colon)."""
    return f"rpc:{placement_id}"


def failed_workers(placements: Sequence[Any], nodes: Sequence[Any]) -> dict[str, str]:
    """``{placement id: node}`` of the splits one of whose workers reports its
    ``ggml-rpc-server`` failed (exited, or could not start), with the first such node.
    A worker on a node that is gone is the planner's to see (its node's state)."""
    reports = {node.id: node.replicas for node in nodes if not node.left}
    found: dict[str, str] = {}
    for placement in placements:
        if placement.state == PlacementState.STOPPING.value:
            continue
        for worker in placement.workers:
            report = (reports.get(worker["node"]) or {}).get(rpc_report_key(placement.id))
            if report and report.get("state") == "failed":
                found[placement.id] = worker["node"]
                break
    return found


def forgettable(
    views: Sequence[PlacementView],
    nodes: Sequence[NodeView],
    *,
    wanted: frozenset[str] | None = None,
) -> list[str]:
    """Placements on gone (lost, left or unknown) nodes that nothing will ever run again:
    their replica has a ``ready`` placement of the same or a newer revision on a live node,
    or their deployment is no longer desired (``wanted``: the desired deployments, frozen
    ones included; ``None``: not checked). Their rows can go -- a node that comes back
    finds nothing of them to start (issue 30, item 21)."""
    states = {node.id: node.state for node in nodes}

    def gone(view: PlacementView) -> bool:
        return states.get(view.node, NodeState.LEFT) in _GONE

    newest: dict[tuple[str, int], int] = {}
    for v in views:
        if v.state is PlacementState.READY and not gone(v):
            key = (v.deployment, v.replica)
            newest[key] = max(newest.get(key, 0), v.revision)
    return sorted(
        v.id
        for v in views
        if gone(v)
        and (
            newest.get((v.deployment, v.replica), 0) >= v.revision
            or (wanted is not None and v.deployment not in wanted)
        )
    )


def local_placements(placements: Sequence[Any], node_id: str) -> dict[str, Any]:
    """``{local id: placement}`` node ``node_id`` runs: its placements that are not
    ``stopping``, keyed by the id its runtime runs each replica under
    (:func:`~sbproxy.fleet.routing.replica_deployment_id`), the newest revision when one
    replica has several there."""
    chosen: dict[str, Any] = {}
    for placement in placements:
        if placement.node != node_id or placement.state == PlacementState.STOPPING.value:
            continue
        local = replica_deployment_id(placement.deployment, placement.replica)
        held = chosen.get(local)
        if held is None or placement.revision > held.revision:
            chosen[local] = placement
    return chosen


def local_deployments(placements: Sequence[Any], node_id: str) -> dict[str, dict[str, Any]]:
    """The deployment definitions node ``node_id`` must run (:func:`local_placements`), by
    local id: each warm and pulled on boot (a placed replica is started, not left for the
    first request), one replica, on the devices its placement holds, with the variant its
    placement names pinned."""
    chosen = local_placements(placements, node_id)
    return {
        local: {
            **placement.definition,
            **({"variant": placement.variant} if placement.variant else {}),
            "warm": True,
            "pull": "on_boot",
            "replicas": 1,
            "devices": sorted(placement.devices),
        }
        for local, placement in sorted(chosen.items())
    }


def stuck_placements(
    placements: Sequence[Any], nodes: Sequence[Any], *, now_ms: int, timeout_ms: int
) -> dict[str, StuckReason]:
    """The placements to move elsewhere, by id.

    A ``pending``/``starting`` placement is stuck when its node reports, for it (the report
    names the placement), ``failure: load_failed`` (preparing it failed) or ``crash_looped``
    (its engine is held in a crash loop) -- at once; so is a split whose RPC worker failed
    on its node (``worker_failed``, :func:`failed_workers`); else when it was last moved
    more than ``timeout_ms`` ago on database time (``placement_timeout``). A ``ready`` placement is
    stuck only when its node reports its engine held in a crash loop, or its load failed
    there (it served once, and no longer can: a device it holds is gone after a restart,
    its devices are full). Placements on nodes that are not members are left to the
    gone-node path.

    Args:
        placements: ``PlacementRow``-shaped placements.
        nodes: ``NodeRow``-shaped members (their ``replicas`` reports).
        now_ms: Database now.
        timeout_ms: ``placement_timeout_ms``.
    """
    reports = {node.id: node.replicas for node in nodes if not node.left}
    found: dict[str, StuckReason] = dict.fromkeys(
        failed_workers(placements, nodes), StuckReason.WORKER_FAILED
    )
    for placement in placements:
        if placement.id in found:
            continue
        ready = placement.state == PlacementState.READY.value
        if not ready and placement.state not in (
            PlacementState.PENDING.value,
            PlacementState.STARTING.value,
        ):
            continue
        report = reports.get(placement.node)
        if report is None:
            continue
        mine = report.get(replica_deployment_id(placement.deployment, placement.replica)) or {}
        if ready:
            if mine.get("placement") == placement.id:
                if mine.get("crash_looped"):
                    found[placement.id] = StuckReason.CRASH_LOOP
                elif mine.get("failure") == StuckReason.LOAD_FAILED.value:
                    found[placement.id] = StuckReason.LOAD_FAILED
            continue
        if mine.get("placement") == placement.id:
            if mine.get("failure") == StuckReason.LOAD_FAILED.value:
                found[placement.id] = StuckReason.LOAD_FAILED
                continue
            if mine.get("crash_looped"):
                found[placement.id] = StuckReason.CRASH_LOOP
                continue
        if now_ms - placement.updated_at_ms > timeout_ms:
            found[placement.id] = StuckReason.PLACEMENT_TIMEOUT
    return found


def avoided_nodes(avoids: Sequence[Any], *, now_ms: int) -> dict[str, frozenset[str]]:
    """``{deployment: nodes}`` from ``AvoidRow``-shaped rows still in force at ``now_ms``."""
    out: dict[str, set[str]] = {}
    for row in avoids:
        if row.until_ms > now_ms:
            out.setdefault(row.deployment, set()).add(row.node)
    return {deployment: frozenset(nodes) for deployment, nodes in out.items()}


def facts_of(facts: GgufFacts) -> dict[str, Any]:
    """The JSON form of GGUF header facts a node reports (every field)."""
    return asdict(facts)


def reported_facts(nodes: Sequence[Any]) -> dict[str, GgufFacts]:
    """``{artifact digest: GGUF facts}`` the members reported (the smallest node id wins
    where two did; a malformed report is skipped with a warning)."""
    found: dict[str, GgufFacts] = {}
    for node in sorted(nodes, key=lambda n: n.id):
        for digest, body in node.artifact_facts.items():
            if digest in found:
                continue
            try:
                found[digest] = GgufFacts(**body)
            except TypeError as exc:
                logger.warning("node %s: unreadable facts for %s: %s", node.id, digest, exc)
    return found


class TableDevice(Protocol):
    """What :func:`device_capacities` reads of one device of a host's device table."""

    @property
    def index(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def compute_capability(self) -> tuple[int, int] | None: ...


class DeviceTable(Protocol):
    """What :func:`device_capacities` reads of a host's device table
    (:class:`~sbproxy.model_host.runtime.devices.HostDevices`)."""

    @property
    def accelerator(self) -> Accelerator: ...

    @property
    def devices(self) -> Sequence[TableDevice]: ...


def device_capacities(devices: DeviceTable) -> list[dict[str, Any]]:
    """The devices a node reports at join: its runtime's device table
    (:class:`~sbproxy.model_host.runtime.devices.HostDevices`), so that the planner places
    on exactly the devices the runtime reserves against -- each GPU with its free memory at
    the probe (memory other processes held then is not offered), or each share of a CPU
    host's budget (``proxy.model_host.cpu_devices``). Each entry: ``index``,
    ``capacity_bytes``, ``accelerator`` and, on CUDA, ``compute_capability``
    (``[major, minor]``, ``None`` when unknown) -- what a variant's needs are matched
    against."""
    kind = devices.accelerator.value
    reported: list[dict[str, Any]] = []
    for device in devices.devices:
        entry: dict[str, Any] = {
            "index": device.index,
            "capacity_bytes": max(0, device.capacity_bytes),
            "accelerator": kind,
        }
        if kind == "cuda":
            entry["compute_capability"] = device.compute_capability
        reported.append(entry)
    return reported


def _choice(
    config: DeploymentConfig,
    artifact: ResolvedArtifact,
    *,
    facts: Mapping[str, GgufFacts],
    safety_margin: float,
    variant: str | None,
    engines: Sequence[str],
    catalog: Catalog,
) -> VariantChoice:
    """One variant choice: its estimate, and the hardware it needs when it is named (a
    variant the node resolves itself runs anywhere)."""
    known = facts.get(artifact.digest)
    estimate = estimate_memory(
        weights_bytes=max(1, artifact.total_size_bytes),
        facts=known,
        seq_len=max(1, min(config.max_context or artifact.context_length, 1 << 20)),
        concurrency=config.max_concurrency,
        kv_quant=config.kv_quant,
        safety_margin=safety_margin,
        format_quant=artifact.quant,
        tensor_parallel=config.tensor_parallel or 1,
    )
    needs = None
    if variant is not None:
        entry = catalog.models[config.model]
        needs = next((v.requirements for v in entry.variants if v.id == variant), None)
    minimum = needs.min_compute_capability if needs is not None else None
    return VariantChoice(
        variant=variant,
        engines=tuple(engines),
        estimate=estimate,
        artifact_digest=artifact.digest,
        estimate_basis=EstimateBasis.FILE_SIZE if known is None else EstimateBasis.GGUF_HEADER,
        accelerators=frozenset(a.value for a in needs.accelerators) if needs else frozenset(),
        min_compute_capability=minimum.as_tuple() if minimum is not None else None,
    )


def _alternatives(
    config: DeploymentConfig, catalog: Catalog
) -> list[tuple[ResolvedArtifact, tuple[str, ...]]]:
    """Every variant of ``config.model`` a node might run, in resolution order (pickle
    last, and only with ``allow_pickle``), each with the engines it can be served by."""
    entry = catalog.models[config.model]
    found = []
    for variant in sorted(entry.variants, key=lambda v: v.format is ArtifactFormat.PICKLE):
        if variant.format is ArtifactFormat.PICKLE and not entry.allow_pickle:
            continue
        engines = tuple(e.value for e in variant.engines)
        if str(config.engine) != "auto":
            engines = tuple(e for e in engines if e == str(config.engine))
        if not engines:
            continue
        artifact = pinned_artifact(catalog, config.model, entry, variant, engine=variant.engines[0])
        found.append((artifact, engines))
    return found


def catalog_artifact(
    config: DeploymentConfig,
    catalog: Catalog,
    resolve_here: Callable[[DeploymentConfig], ResolvedArtifact],
) -> ResolvedArtifact:
    """The artifact a controller plans ``config`` with, from the catalog rather than its own
    hardware (issue 30, item 16): a pinned variant as pinned (the planner checks its
    hardware per candidate node); else the controller's own resolution when it has one;
    else the model's first variant an engine serves (each node resolves its own).

    Raises:
        SbproxyError | KeyError | ValueError: the model or variant is not in the catalog.
    """
    entry = catalog.models[config.model]
    if config.variant is not None:
        variant = next(v for v in entry.variants if v.id == config.variant)
        return pinned_artifact(catalog, config.model, entry, variant, engine=variant.engines[0])
    try:
        return resolve_here(config)
    except SbproxyError:
        alternatives = _alternatives(config, catalog)
        if not alternatives:
            raise
        return alternatives[0][0]


def deployment_spec(
    deployment: str,
    config: DeploymentConfig,
    *,
    revision: int,
    resolved: ResolvedArtifact,
    catalog: Catalog,
    facts: Mapping[str, GgufFacts],
    safety_margin: float,
    avoid: frozenset[str] = frozenset(),
    replicas: int | None = None,
) -> DeploymentSpec:
    """The planner's spec of one desired deployment.

    Args:
        deployment: Its id.
        config: Its definition.
        revision: The desired-state revision.
        resolved: Its artifact as the controller resolves it (used when the variant is
            pinned, or heterogeneous variants are off).
        catalog: The catalog ``resolved`` came from.
        facts: ``{artifact digest: GGUF facts}`` the members reported
            (:func:`reported_facts`); an artifact with facts is sized from its header
            (``estimate_basis: gguf_header``), else from its file sizes (``file_size``).
        safety_margin: ``model_host.safety_margin``.
        avoid: Nodes the deployment avoids now (:func:`avoided_nodes`).
        replicas: The count the autoscaler set for it (``None``: its configured count).

    With ``heterogeneous_variants: true`` and no pinned ``variant``, every variant of the
    model is a choice (first in catalog order) and each placement names the one it got;
    otherwise the one choice is ``resolved`` (variant named only when pinned).
    """
    heterogeneous = config.heterogeneous_variants and config.variant is None
    if heterogeneous:
        options = [
            _choice(
                config, artifact, facts=facts, safety_margin=safety_margin,
                variant=artifact.variant_id, engines=engines, catalog=catalog,
            )
            for artifact, engines in _alternatives(config, catalog)
        ]  # fmt: skip
    else:
        options = []
    if not options:
        options = [
            _choice(
                config, resolved, facts=facts, safety_margin=safety_margin,
                variant=config.variant, engines=[resolved.engine.value], catalog=catalog,
            )
        ]  # fmt: skip
    first, rest = options[0], options[1:]
    return DeploymentSpec.from_config(
        deployment,
        config,
        revision=revision,
        estimate=first.estimate,
        engines=first.engines,
        artifact_digest=first.artifact_digest,
        variant=first.variant,
        estimate_basis=first.estimate_basis,
        alternatives=rest,
        avoid_nodes=avoid,
        accelerators=first.accelerators,
        min_compute_capability=first.min_compute_capability,
        replicas=replicas,
    )
