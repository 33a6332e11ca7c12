"""One host's part in the fleet: membership, the controller when elected, its own placements,
self-fencing, and the routing table the gateway reads.

:class:`FleetAgent` runs one loop per host (``heartbeat_ms`` apart); each beat:

1. **renews** this node's membership on database time, reporting every local replica's
   active and queued counts, the placement it runs for and whether it failed (load failed,
   crash loop), and its cached artifacts with their GGUF header facts;
2. if renewed, **holds or tries the controller lease** (``fleet_controller``, one holder,
   a fencing epoch, ``fence_after_ms`` long: a controller that cannot renew it is cut off
   and fences itself anyway); the holder observes every member on database time, records each
   state change (checked against the transition table, an event, a metric), runs the pure
   :func:`~sbproxy.fleet.placement.plan` and records each decision as a placement plus a
   ``fleet.place`` job -- every write fenced by its epoch in the database. Replicas are
   sized from a member's GGUF facts when any reported them; a placement stuck past
   ``placement_timeout_ms`` or failed on its node is moved to another node, which the
   deployment then avoids for as long;
3. **reconciles its own placements** through today's prepare-and-commit path: the
   deployments placed here become this host's desired state (``reload``: pull into its own
   cache, warm, route), run as this node's own jobs; a placement the controller moved or
   stopped is removed the same way, at once;
4. refreshes the **routing table** (:class:`~sbproxy.fleet.routing.RoutingTable`).

When a renewal fails the agent judges its own lease on its monotonic clock
(:func:`~sbproxy.fleet.membership.fence_verdict`): past ``fence_after_ms`` it asks its peers
(fleet credential); if a peer renewed recently, or none answers, it **fences**: stops
taking traffic (its replicas leave the routing table) and kills its engines, before the
fleet re-places them at ``lost_after_ms``. If the peers cannot renew either, the database
is down for everyone: it **holds** -- keeps serving, mutations answer
``journal_unavailable``. Once a renewal succeeds again it rejoins and the next reconcile
stops every engine whose placement moved.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import anyio.to_thread
import httpx
from ulid import ULID

from sbproxy.config import DeploymentConfig, RoutingPolicy
from sbproxy.errors import SbproxyError
from sbproxy.fleet.admission import JoinAdmission, PeerCheck, PeerCredentials
from sbproxy.fleet.control import (
    avoided_nodes,
    catalog_artifact,
    definition_digest,
    deployment_spec,
    device_capacities,
    failed_workers,
    forgettable,
    judge_own_lease,
    local_deployments,
    local_placements,
    node_moves,
    observe,
    partition_peers,
    placement_views,
    reported_facts,
    stuck_placements,
)
from sbproxy.fleet.membership import (
    LIVE_STATES,
    FenceVerdict,
    FleetTiming,
    PeerAnswer,
    idle_loadable,
    replica_state,
)
from sbproxy.fleet.placement import (
    DeploymentSpec,
    NodeView,
    PlacementPolicy,
    ReplaceReplica,
    StartReplica,
    StopReplica,
    StuckReason,
    UnplacedReplica,
    plan,
)
from sbproxy.fleet.routing import PeerReplica, RoutingTable, replica_deployment_id
from sbproxy.fleet.scaling import (
    Autoscaled,
    Autoscaler,
    autoscaled,
    in_flight,
    scaled_counts,
)
from sbproxy.fleet.split import SplitNode
from sbproxy.fleet.view import (
    ControllerRow,
    FleetView,
    NodeRow,
    PlacementJobRow,
    ReplicaRow,
    cached_artifacts,
)
from sbproxy.model_host.artifacts.peers import PEER_NODE_HEADER as PEER_NODE
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.reload import reload, with_deployments
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.model_host.service import ModelHostService
from sbproxy.store.admission import secret_hash
from sbproxy.store.fleet import (
    ControllerLease,
    Deposed,
    FleetSnapshot,
    FleetStore,
    NodeIdInUse,
    Renewal,
)
from sbproxy.store.fleet_scale import record_demand, record_scale
from sbproxy.workflows.faults import fault_point

__all__ = ["FleetAgent", "NodeIdentity", "PeerAsker", "ask_peers_http", "fleet_view"]

logger = logging.getLogger(__name__)

PEER_LEASE_PATH = "/fleet/v1/lease"
# PEER_NODE: the header naming the asking node on a fence ask, a hop or a blob fetch (its
# credential is checked as that node's).
PEER_TIMEOUT_S = 2.0
# A placed replica that is not serving is loaded again, and a failed reconcile is tried
# again, at most this often.
RELOAD_RETRY_S = 5.0
LEAST_OUTSTANDING = RoutingPolicy.LEAST_OUTSTANDING.value
# Fleet events are kept a week, and at least the newest 10,000, pruned by the controller
# at most once a minute (database time).
EVENTS_KEEP_MS = 7 * 24 * 3600 * 1000
EVENTS_KEEP = 10_000
EVENTS_PRUNE_EVERY_MS = 60_000
# A launch refused for want of room on the replica's devices (AdmissionReason's code).
_NO_ROOM = "insufficient_capacity"
_STARTABLE = frozenset(
    {DeploymentState.CONFIGURED, DeploymentState.STOPPED, DeploymentState.FAILED}
)

PeerAsker = Callable[[Sequence[tuple[str, str]]], Awaitable[list[PeerAnswer]]]
"""Ask ``[(node_id, base_url)]`` peers whether they renewed recently."""


@dataclass(frozen=True)
class NodeIdentity:
    """This host as a member: its id, labels and the URL peers reach its gateway at."""

    id: str
    labels: dict[str, str]
    advertise_url: str


def ask_peers_http(
    credential: str | Callable[[], str | None] | None,
    *,
    timeout_s: float = PEER_TIMEOUT_S,
    as_node: str | None = None,
) -> PeerAsker:
    """A :data:`PeerAsker` over HTTP: ``GET <base_url>/fleet/v1/lease`` with the fleet
    credential (a string, or a callable read at each ask, so that a reloaded credential is
    the one sent). A peer that does not answer 200 within ``timeout_s``, or whose answer
    names another node than the one asked (a loopback advertise URL reaching this host's
    own gateway, an address reused by another host), is not reached (issue 30, item 18).
    With ``as_node`` (the asking node's id, sent as ``X-Sbproxy-Peer-Node``), the credential is
    that node's own (docs/cluster.md, "Admitting nodes")."""

    def current() -> str | None:
        return credential() if callable(credential) else credential

    async def ask(peers: Sequence[tuple[str, str]]) -> list[PeerAnswer]:
        secret = current()
        if not secret:
            return [PeerAnswer(node_id=node, reached=False) for node, _ in peers]
        headers = {"Authorization": f"Bearer {secret}"}
        if as_node is not None:
            headers[PEER_NODE] = as_node
        answers: dict[str, PeerAnswer] = {}

        async def one(client: httpx.AsyncClient, node: str, base_url: str) -> None:
            try:
                with anyio.fail_after(timeout_s):
                    response = await client.get(base_url + PEER_LEASE_PATH, headers=headers)
                body = response.json() if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, TimeoutError):
                body = None
            if not isinstance(body, dict) or body.get("node_id") != node:
                if isinstance(body, dict):
                    logger.warning(
                        "fence ask: %s at %s answered as %r: not counted as reached",
                        node,
                        base_url,
                        body.get("node_id"),
                    )
                answers[node] = PeerAnswer(node_id=node, reached=False)
                return
            at, since = body.get("renewed_at_ms"), body.get("streak_since_ms")
            answers[node] = PeerAnswer(
                node_id=node,
                reached=True,
                renewed_at_ms=at if isinstance(at, int) else None,
                streak_since_ms=since if isinstance(since, int) else None,
            )

        async with (
            httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client,
            anyio.create_task_group() as group,
        ):
            for node, base_url in peers:
                group.start_soon(one, client, node, base_url)
        return [answers[node] for node, _ in peers]

    return ask


class FleetAgent:
    """One host's fleet membership and controller (module docstring).

    Args:
        store: The fleet's rows in the shared journal.
        manager: This host's runtime.
        identity: This node.
        timing: Heartbeat, fence and lost timing.
        policy: Placement scoring and the re-placement cap.
        artifacts: Digests of the artifacts in this node's cache.
        ask_peers: How to ask peers before fencing (:func:`ask_peers_http`).
        clock: Monotonic seconds (tests inject one).
        artifact_facts: ``{digest: GGUF facts JSON}`` of the verified GGUF artifacts in this
            node's cache (read from their headers; none by default).
        admission: Its node credential file and join token (docs/cluster.md, "Admitting
            nodes"); ``None``: it joins without admission (a caller that predates it: tests
            of the agent alone).
        inventory: ``{digest: {"bytes", "verified"}}`` of the artifacts in this node's cache
            (:class:`~sbproxy.fleet.cluster.CacheInventory`); sent at join and with a
            renewal only when it changed (none by default).

    Attributes:
        split: This node's part in split replicas (:class:`~sbproxy.fleet.split.SplitNode`;
            ``None``: it takes none -- the agent alone in tests).
    """

    split: SplitNode | None = None

    # Private state with immutable starting values (each instance rebinds its own).
    _facts_sent: frozenset[str] | None = None
    _reconciling = False
    _reload_failed_at = float("-inf")
    _unreached = 0
    _unspecified: frozenset[str] = frozenset()
    _unplaced: Mapping[tuple[str, int], str] = MappingProxyType({})
    _events_pruned_at = 0
    _renewing_since: float | None = None
    _failed_since: float | None = None
    _failed_start: float | None = None
    _lost_seen = False
    # Whether this process renewed since its last join (a join may find the node lost).
    _renewed_since_join = False

    def __init__(
        self,
        *,
        store: FleetStore,
        manager: RuntimeManager,
        identity: NodeIdentity,
        timing: FleetTiming,
        policy: PlacementPolicy,
        artifacts: Callable[[], list[str]],
        ask_peers: PeerAsker,
        clock: Callable[[], float] = time.monotonic,
        artifact_facts: Callable[[], dict[str, dict[str, Any]]] = dict,
        admission: JoinAdmission | None = None,
        inventory: Callable[[], dict[str, dict[str, Any]]] = dict,
    ) -> None:
        self.store = store
        self.admission = admission
        self._secret: str | None = None
        self._peers = PeerCredentials.empty()
        self._unknown_peer_at = float("-inf")
        # An operator revoked this node: it runs nothing and renews nothing.
        self.revoked = False
        self.manager = manager
        self.identity = identity
        self.timing = timing
        self.policy = policy
        self.artifacts = artifacts
        self.ask_peers = ask_peers
        self.clock = clock
        self.artifact_facts = artifact_facts
        self.inventory = inventory
        self._inventory_sent: dict[str, dict[str, Any]] | None = None
        self.fenced = False
        self.instance = str(ULID())
        """This process's token for the node id (a twin with the same id is refused)."""
        self.renewed_at_ms: int | None = None
        """Database time of this node's last successful renewal."""
        self.streak_since_ms: int | None = None
        """Database time its current run of successful renewals began (join, or the first
        success after a failure)."""
        self.removed = False
        """The fleet removed this node: it runs nothing until an operator admits it."""
        self.leaving = False
        """A graceful stop is marking (or marked) this node leaving."""
        self._leave_lock = anyio.Lock()
        self.left_at: float | None = None
        """When (this node's clock) the graceful stop that marked it leaving began; ``None``
        while it runs. From then on it renews, joins and controls nothing (the mark released
        its id), and its engines stop once ``leaving_grace_ms`` has passed since."""
        self.holding: ControllerLease | None = None
        self.snapshot: FleetSnapshot | None = None
        self.views: list[NodeView] = []
        self.last_renewal: float | None = None
        self.verdict = FenceVerdict.SERVE
        self.node_transitions: Counter[tuple[str, str]] = Counter()
        self.replacements = 0
        self.placements_made = 0
        self.stuck_replacements: Counter[str] = Counter()
        """Stuck or failed placements this host moved as the controller, by reason."""
        self.stuck_staying: dict[str, str] = {}
        """Stuck placements no other node takes now: ``{placement: why}`` (last pass)."""
        self.scaler = Autoscaler()
        """Load samples and scaling decisions while this host is the controller."""
        self._demanded: dict[str, float] = {}
        # {deployment: placement id} a failed reconcile could not load, and its code
        self._load_failure: tuple[dict[str, str], str] | None = None
        self._changed = anyio.Event()
        self._reported: dict[str, dict[str, Any]] = {}
        self._loaded_at: dict[str, float] = {}
        self._table = RoutingTable(identity.id, {}, clock())

    # -- what others read --------------------------------------------------------------

    def routing(self) -> RoutingTable:
        """The last routing table (FleetDirectory); never blocks."""
        return self._table

    def node_secret(self) -> str | None:
        """This node's own credential (presented to peers); ``None`` before it joined with
        one (:class:`~sbproxy.fleet.admission.PeerAdmission`)."""
        return self._secret

    def credential_hash(self, node: str) -> str | None:
        """The credential hash member ``node`` proves to this node's RPC gates, as this host
        last read the fleet; ``None`` for a revoked, removed or unknown node (refused)."""
        return self._peers.hashes.get(node)

    def check_peer(self, node: str, secret: str) -> PeerCheck:
        """``secret`` presented as member ``node``, checked against the fleet as this host last
        read it -- at its last heartbeat or the last change announced (a revocation is
        announced): :class:`~sbproxy.fleet.admission.PeerCheck`. A node this host does not
        know yet (it joined since the last read) makes it read the fleet again at once, at
        most once a second."""
        check = self._peers.check(node, secret)
        if check is PeerCheck.UNKNOWN and not self._peers.knows(node):
            now = self.clock()
            if now - self._unknown_peer_at >= 1.0:
                self._unknown_peer_at = now
                self._changed.set()
        return check

    def renewed_recently(self) -> bool:
        """This node renewed within ``fence_after_ms``."""
        if self.last_renewal is None:
            return False
        return (self.clock() - self.last_renewal) * 1000 < self.timing.fence_after_ms

    def lease_report(self) -> dict[str, Any]:
        """What a peer that cannot renew is told (``GET /fleet/v1/lease``): this node's id,
        its last successful renewal on database time, whether that was recent, and whether
        it fenced itself."""
        return {
            "node_id": self.identity.id,
            "renewed_at_ms": self.renewed_at_ms,
            "streak_since_ms": self.streak_since_ms,
            "renewed_recently": self.renewed_recently(),
            "fenced": self.fenced,
        }

    def replica_counts(self) -> dict[str, tuple[int, int, int]]:
        """``{deployment: (desired, ready, idle)}`` at the last heartbeat, over placements
        ``ready`` on a live (not lost or left) node: ``idle`` counts the replicas whose
        engine keep-alive stopped (its node loads it for the next request), ``ready`` the
        others."""
        snapshot = self.snapshot
        if snapshot is None or snapshot.desired_document is None:
            return {}
        wanted = json.loads(snapshot.desired_document).get("deployments", {})
        live = {v.id for v in self.views if v.state.value not in ("lost", "left")}
        reports = {node.id: node.replicas for node in snapshot.nodes}
        scaled = scaled_counts(snapshot, autoscaled(snapshot.desired_document))
        counts: dict[str, tuple[int, int, int]] = {}
        for deployment, body in wanted.items():
            ready: set[int] = set()
            idle: set[int] = set()
            for p in snapshot.placements:
                if p.deployment != deployment or p.state != "ready" or p.node not in live:
                    continue
                local = replica_deployment_id(p.deployment, p.replica)
                report = reports.get(p.node, {}).get(local) or {}
                (idle if idle_loadable(report) else ready).add(p.replica)
            want = scaled.get(deployment)
            if want is None:
                want = int(body.get("replicas", 1))
            counts[deployment] = (want, len(ready), len(idle - ready))
        return counts

    def autoscale_counts(self) -> dict[str, tuple[int, int]]:
        """``{deployment: (desired, current)}`` of the autoscaled deployments at the last
        heartbeat: the count the last scaling decision set, and the replicas placed (not
        being stopped) on live nodes."""
        snapshot = self.snapshot
        if snapshot is None:
            return {}
        scaled = autoscaled(snapshot.desired_document)
        gone = [v.id for v in self.views if v.state.value in ("lost", "left")]
        return {
            deployment: (count, in_flight(snapshot, deployment, gone=gone)[1])
            for deployment, count in scaled_counts(snapshot, scaled).items()
        }

    async def view(self) -> FleetView:
        """The fleet now for the console (FleetStatus): one database read.

        Raises:
            JournalUnavailable: ``journal_unavailable``.
        """
        snapshot = await anyio.to_thread.run_sync(self.store.snapshot)
        return fleet_view(snapshot, self.identity.id, self.timing)

    # -- the loop ----------------------------------------------------------------------

    async def join(self) -> None:
        """Join the fleet (at start) as this process's instance of the node id.

        When another instance holds the id and renewed within ``lost_after_ms`` (a crashed
        run of this host, or a twin), the join watches that renewal for two heartbeats and
        a peer ask: it takes the id over when the renewal stood still (the holder is dead
        or frozen), and is refused when it moved (a live twin).

        Raises:
            JournalUnavailable: ``journal_unavailable``.
            NodeIdInUse: ``node_id_in_use`` -- another live process holds this node id.
            NodeRemoved: ``node_removed`` -- an operator removed this node from the fleet.
            JoinRefused: ``join_token_required``, ``join_token_invalid``,
                ``join_token_expired``, ``join_token_used_up``, ``node_revoked``,
                ``node_credential_invalid`` (docs/cluster.md, "Admitting nodes").
        """
        worker = ModelHostService.serving(self.manager).worker()
        devices = device_capacities(self.manager.devices)
        facts = await anyio.to_thread.run_sync(self.artifact_facts)
        admission = self.admission
        secret = (
            None
            if admission is None
            else await anyio.to_thread.run_sync(admission.credential_file.load_or_make)
        )
        token = admission.join_token() if admission is not None else None
        shared = admission.shared_admits() if admission is not None else True
        inventory = await anyio.to_thread.run_sync(self.inventory)

        def send(take_over: int | None) -> int:
            return self.store.join(
                self.identity.id,
                advertise_url=self.identity.advertise_url,
                labels=self.identity.labels,
                engines=sorted(e.value for e in worker.engines),
                devices=devices,
                artifacts=self.artifacts(),
                artifact_facts=facts,
                inventory=inventory,
                instance=self.instance,
                live_within_ms=self.timing.lost_after_ms,
                take_over_renewed_at_ms=take_over,
                credential_sha256=None if secret is None else secret_hash(secret),
                join_token=token,
                shared_admits=shared,
            )

        await self._check_advertise_url()
        try:
            now = await anyio.to_thread.run_sync(send, None)
        except NodeIdInUse as held:
            seen = int(str(held.details["renewed_at_ms"]))
            logger.info(
                "node id %s was renewed %s ms ago by another process; watching it",
                self.identity.id,
                held.details.get("ms_ago"),
            )
            await anyio.sleep(
                (2 * self.timing.heartbeat_ms + self.timing.peer_ask_timeout_ms) / 1000
            )
            # Refused again (NodeIdInUse) when the holder renewed meanwhile: it lives.
            now = await anyio.to_thread.run_sync(send, seen)
        self._facts_sent = frozenset(facts)
        self._inventory_sent = inventory
        self._renewed_since_join = False
        self.last_renewal = self.clock()
        self.renewed_at_ms = now
        self.streak_since_ms = now
        self._failed_since = None
        self.removed = False
        self.revoked = False
        self._secret = secret
        logger.info("joined the fleet as node %s (%s)", self.identity.id, worker.describe())

    async def _check_advertise_url(self) -> None:
        """Refuse a loopback advertise URL when a live member is on another machine: peers
        could not reach this host, and its fence ask would reach its own gateway (issue 30,
        item 18). A fleet all on one machine (every member loopback) is fine.

        Raises:
            SbproxyError: ``invalid_advertise_url`` naming ``proxy.model_host.node.advertise_url``.
        """
        if not _is_loopback(self.identity.advertise_url):
            return
        snapshot = await anyio.to_thread.run_sync(self.store.snapshot)
        remote = sorted(
            node.id
            for node in snapshot.nodes
            if node.id != self.identity.id
            and not node.left
            and node.advertise_url
            and not _is_loopback(node.advertise_url)
            and snapshot.now_ms - node.renewed_at_ms < self.timing.lost_after_ms
        )
        if remote:
            raise SbproxyError(
                f"this host would advertise {self.identity.advertise_url} to the fleet, a "
                f"loopback address, but members {', '.join(remote)} are on other machines: "
                "they could not reach it",
                code="invalid_advertise_url",
                remediation="Set proxy.model_host.node.advertise_url to the address peers "
                "reach this host's gateway at (e.g. http://10.0.0.5:8080).",
                details={"path": "proxy.model_host.node.advertise_url"},
            )

    async def leave(self) -> None:
        """A graceful stop (SIGTERM): mark this node leaving on database time -- out of every
        gateway's rotation at once; its replicas are re-placed after ``rejoin_grace_ms``
        unless it is back -- and release the node id for the restart. Best effort: a
        journal that does not answer leaves the fleet to notice the silence.

        Once marked, the beats stop (a renewal would find the id released, and this node
        must not take it back from its own restart), and :meth:`check_lease` stops the
        engines when the grace ends, as the controller may start their replacements then:
        a drain gets at most the grace."""
        async with self._leave_lock:  # the signal's leave and the stop's: one mark
            if self.left_at is None:
                await self._leave()

    async def _leave(self) -> None:
        began = self.clock()
        # From now on a beat already under way may find the id released: not a twin.
        self.leaving = True
        try:
            with anyio.fail_after(min(self.timing.fence_after_ms / 1000, self.store.deadline_s)):
                left = await anyio.to_thread.run_sync(
                    partial(self.store.leave, self.identity.id, instance=self.instance),
                    abandon_on_cancel=True,
                )
        except (SbproxyError, TimeoutError) as exc:
            self.leaving = False
            logger.warning("node %s could not mark itself leaving: %s", self.identity.id, exc)
            return
        self.leaving = left
        if left:
            self.left_at = began
            logger.info(
                "node %s marked itself leaving (replicas re-placed after %d ms unless it is back)",
                self.identity.id,
                self.timing.leaving_grace_ms,
            )

    async def run(self, group: anyio.abc.TaskGroup) -> None:
        """Beat every ``heartbeat_ms`` until cancelled; reloads run in ``group``. The lease
        watch runs beside the beats on its own clock, so that a renewal blocked in a call
        never delays the fence decision (ARCHITECTURE.md "Several hosts")."""
        group.start_soon(self.watch_lease)
        group.start_soon(self.follow_changes)
        period = self.timing.heartbeat_ms / 1000
        while True:
            started = self.clock()
            try:
                await self.beat(group)
            except SbproxyError as exc:
                logger.warning("fleet beat failed: [%s] %s", exc.code, exc)
            # Between beats, a change another host made (a replica ready, a placement
            # stopping) re-reads the fleet and re-routes at once (issue 30, item 11).
            while (left := period - (self.clock() - started)) > 0:
                with anyio.move_on_after(left):
                    await self._changed.wait()
                if not self._changed.is_set():
                    break
                self._changed = anyio.Event()
                try:
                    await self.refresh(group)
                except SbproxyError as exc:
                    logger.warning("fleet refresh failed: [%s] %s", exc.code, exc)

    async def follow_changes(self) -> None:
        """Listen for fleet changes (``LISTEN``) and wake the loop for each; the heartbeat
        stays the fallback while the listening connection is away."""
        period = self.timing.heartbeat_ms / 1000
        while True:
            try:
                changed = await anyio.to_thread.run_sync(
                    self.store.wait_for_change, max(period, 1.0), abandon_on_cancel=True
                )
            except SbproxyError:
                await anyio.sleep(period)
                continue
            if changed:
                self._changed.set()

    async def refresh(self, group: anyio.abc.TaskGroup) -> None:
        """Re-read the fleet, rebuild the routing table and reconcile this node's own
        placements (no renewal, no controller pass): what a change notification asks."""
        if self.fenced or self.removed or self.left_at is not None:
            return
        snapshot = await anyio.to_thread.run_sync(self.store.snapshot)
        self.snapshot = snapshot
        self.views = observe(snapshot.nodes, now_ms=snapshot.now_ms, timing=self.timing)
        self._refresh_routing(snapshot)
        await self._reconcile(snapshot, group)

    async def watch_lease(self) -> None:
        """Judge this node's own lease every half heartbeat, whatever the beat is doing; and
        notice a pause of this process itself."""
        period = self.timing.heartbeat_ms / 2000
        last = self.clock()
        while True:
            await anyio.sleep(period)
            now = self.clock()
            away_ms = (now - last) * 1000
            last = now
            if away_ms >= self.timing.lost_after_ms and not self.fenced:
                # This process did not run (SIGSTOP, a frozen VM) past lost_after_ms: the
                # fleet may have placed its replicas elsewhere already. Stop the engines
                # before anything else; the ones still placed here start again after the
                # rejoin. Measured here, between two ticks of this loop, which waits on no
                # call: a beat blocked on a silent database is not a pause.
                logger.warning("node %s was paused for %d ms", self.identity.id, away_ms)
                self.fence()
            await self.check_lease()

    async def check_lease(self) -> None:
        """One look at the lease: past ``fence_after_ms`` without a successful renewal, ask
        the peers and fence or hold (:meth:`_judge_own_lease`). Only :meth:`watch_lease`
        calls it, one look at a time; a successful renewal sets the verdict back."""
        if self.fenced or self.removed or self.last_renewal is None:
            return
        if self.left_at is not None:
            # Leaving: no renewals come; the grace, not the lease, bounds the engines.
            if (self.clock() - self.left_at) * 1000 >= self.timing.leaving_grace_ms:
                logger.warning(
                    "node %s: its leaving grace (%d ms) is over, its replicas may start "
                    "elsewhere now: the engines still draining stop",
                    self.identity.id,
                    self.timing.leaving_grace_ms,
                )
                self.fence()
            return
        if (self.clock() - self.last_renewal) * 1000 >= self.timing.fence_after_ms:
            await self._judge_own_lease()

    async def beat(self, group: anyio.abc.TaskGroup) -> None:
        """One heartbeat (module docstring); none once this node marked itself leaving."""
        if self.left_at is not None or not await self._renew():
            return
        await self._control()
        snapshot = await anyio.to_thread.run_sync(self.store.snapshot)
        self.snapshot = snapshot
        self.views = observe(snapshot.nodes, now_ms=snapshot.now_ms, timing=self.timing)
        self._refresh_routing(snapshot)
        await self._reconcile(snapshot, group)

    # -- membership and fencing --------------------------------------------------------

    def _replica_counts(self) -> dict[str, dict[str, Any]]:
        """Each local replica as reported: runtime counts and state, the placement it runs
        for, a retained crash loop; a placed replica whose load failed -- the reload that
        should run it, or its engine's launch here for want of room (``insufficient_capacity``:
        its devices are full, or one it holds is gone after a restart; a relaunch cannot
        help, unlike after an engine exit) -- is reported ``failure: load_failed`` with the
        error code."""
        mine = self._my_placements()
        counts: dict[str, dict[str, Any]] = {}
        for row in self.manager.status():
            counts[row.deployment] = {
                "generation": row.generation,
                "state": row.state.value,
                "reason_code": row.reason_code,
                "routable": row.routable,
                "active": row.active_requests,
                "queued": row.queued_requests,
                "port": row.port,
                "placement": mine.get(row.deployment),
                "crash_looped": row.crash_looped,
            }
            if row.state is DeploymentState.FAILED and row.reason_code == _NO_ROOM:
                counts[row.deployment]["failure"] = StuckReason.LOAD_FAILED.value
                counts[row.deployment]["error"] = row.reason_code
        if self.split is not None:
            counts.update(self.split.report())
        if self._load_failure is not None:
            failed, code = self._load_failure
            for deployment, placement in sorted(failed.items()):
                # A failure is reported for the placement it was for, never a later one.
                if deployment not in counts and mine.get(deployment) == placement:
                    counts[deployment] = {
                        "state": "failed",
                        "routable": False,
                        "placement": mine[deployment],
                        "failure": StuckReason.LOAD_FAILED.value,
                        "error": code,
                    }
        return counts

    def _my_placements(self) -> dict[str, str]:
        """``{local id: placement id}`` this node runs (the newest, not stopping)."""
        snapshot = self.snapshot
        if snapshot is None:
            return {}
        chosen = local_placements(snapshot.placements, self.identity.id)
        return {local: placement.id for local, placement in chosen.items()}

    async def _renew(self) -> bool:
        counts = self._replica_counts()
        facts = await anyio.to_thread.run_sync(self.artifact_facts)
        # The facts travel again only when the set of artifacts changed.
        changed = None if frozenset(facts) == self._facts_sent else facts
        # So does the inventory: a renewal stays one small row update in steady state.
        inventory = await anyio.to_thread.run_sync(self.inventory)
        stocked = None if inventory == self._inventory_sent else inventory
        self._renewing_since = self.clock()
        try:
            renewed = await anyio.to_thread.run_sync(
                lambda: self.store.renew(
                    self.identity.id,
                    replicas=counts,
                    artifacts=self.artifacts(),
                    artifact_facts=changed,
                    inventory=stocked,
                    instance=self.instance,
                )
            )
        except SbproxyError as exc:
            # The database did not answer this renewal: the fence question asks whether a
            # peer renewed across it (its start).
            self._failed_start = self._renewing_since
            if self._failed_since is None:
                self._failed_since = self._renewing_since
            logger.warning("membership renewal failed: [%s] %s", exc.code, exc)
            return False
        finally:
            self._renewing_since = None
        if renewed is None:  # our row is gone (by hand): join again, unless leaving
            if self.leaving:
                return False
            await self.join()
            return True
        if not renewed.renewed:
            return await self._not_renewed(renewed)
        if changed is not None:
            self._facts_sent = frozenset(changed)
        if stocked is not None:
            self._inventory_sent = stocked
        self._reported = counts
        self.last_renewal = self.clock()
        if self._failed_since is not None or self.streak_since_ms is None:
            self.streak_since_ms = renewed.now_ms
        self.renewed_at_ms = renewed.now_ms
        self._failed_since = None
        self._failed_start = None
        self._unreached = 0
        if self.removed:  # an operator admitted it again while it ran
            logger.info("node %s was admitted again", self.identity.id)
            self.removed = False
        lost = renewed.state == "lost"
        if lost and not self._lost_seen:
            self._declared_lost()
        self._lost_seen = lost
        self._renewed_since_join = True
        if self.fenced:
            logger.warning("node %s renewed again after fencing: rejoining", self.identity.id)
            self.fenced = False
        self.verdict = FenceVerdict.SERVE
        return True

    def _declared_lost(self) -> None:
        """A renewal found this node recorded ``lost``: lost means over -- the fleet gave
        up on it and ended its placements -- so it stops every engine it held before
        anything runs here again (once: until the controller records it back, its new
        placements run). A process that just joined after the loss (stopped past its grace,
        say) and runs no engine has nothing to stop: it only holds its launches until the
        reconcile sees what the fleet places here."""
        if not self._renewed_since_join and not self.manager.holds_engines():
            logger.info(
                "node %s was declared lost while it was away: its old placements ended; it "
                "runs what the fleet places here from now on",
                self.identity.id,
            )
            self.manager.hold_launches()
        elif not self.fenced:
            logger.warning(
                "node %s was declared lost: stopping every engine it held", self.identity.id
            )
            self.fence()

    async def _not_renewed(self, renewal: Renewal) -> bool:
        """The database answered but refused the renewal: removed from the fleet, or the
        node id is held by another process now. Either way this node runs nothing -- unless
        it is leaving: its own leave released the id under a renewal already under way."""
        if self.leaving:
            return False
        if renewal.revoked:
            if not self.revoked:
                logger.warning(
                    "node %s was revoked (sbproxy nodes revoke): it stops its engines, its "
                    "peers refuse it, and it joins again only with a fresh join token",
                    self.identity.id,
                )
            self.revoked = True
            self.removed = True
            self.holding = None
            self._secret = None
            if not self.fenced:
                self.fence()
            return False
        if renewal.left:
            if not self.removed:
                logger.warning(
                    "node %s was removed from the fleet: it stops its engines and serves "
                    "nothing until `sbproxy nodes admit %s`",
                    self.identity.id,
                    self.identity.id,
                )
            self.removed = True
            self.holding = None
            if not self.fenced:
                self.fence()
            return False
        logger.error(
            "node id %s is held by another sbproxy process now: this one stops its engines "
            "and joins again only once that one is gone",
            self.identity.id,
        )
        if not self.fenced:
            self.fence()
        self.holding = None
        try:
            await self.join()
        except SbproxyError as exc:
            logger.error("node %s cannot join again: [%s] %s", self.identity.id, exc.code, exc)
        return False

    async def _judge_own_lease(self) -> None:
        now = self.clock()
        last = self.last_renewal if self.last_renewal is not None else now
        since_ms = int((now - last) * 1000)
        # The renewals the database did not answer since the last success, first and latest
        # (their starts, on this node's clock): one in flight counts once it has waited past
        # one round trip's deadline (no call is trusted to end on time).
        first, latest = self._failed_since, self._failed_start
        started = self._renewing_since
        if started is not None and now - started >= self.store.statement_deadline_s:
            first = started if first is None else first
            latest = started
        if first is None or latest is None:
            # None failed nor hangs: none was tried (the beat is stuck elsewhere); the one
            # that was due is the one the database did not get.
            first = latest = last + self.timing.heartbeat_ms / 1000
        own_ms = self.renewed_at_ms or 0
        cut_off_at_ms = own_ms + int((first - last) * 1000)
        failing_until_ms = own_ms + int((latest - last) * 1000)
        snapshot = self.snapshot
        peers = [
            (node.id, node.advertise_url or "")
            for node in partition_peers(
                snapshot.nodes if snapshot else (),
                node_id=self.identity.id,
                at_ms=own_ms,
                timing=self.timing,
            )
        ]
        answers: list[PeerAnswer] = []
        if since_ms >= self.timing.fence_after_ms and peers:
            answers = await self.ask_peers(peers)
        verdict, self._unreached = judge_own_lease(
            since_own_renewal_ms=since_ms,
            cut_off_at_ms=cut_off_at_ms,
            timing=self.timing,
            peers_known=len(peers),
            answers=answers,
            unreached_before=self._unreached,
            failing_until_ms=failing_until_ms,
        )
        if verdict is not self.verdict:
            logger.warning(
                "node %s has not renewed for %d ms: %s (%d of %d peers reached)",
                self.identity.id,
                since_ms,
                verdict.value,
                sum(1 for a in answers if a.reached),
                len(peers),
            )
        self.verdict = verdict
        if verdict is FenceVerdict.FENCE and not self.fenced:
            self.fence()

    def fence(self) -> list[int]:
        """Stop taking traffic and kill every engine of this host now (split workers too);
        the pids killed."""
        self.fenced = True
        self.holding = None
        self._refresh_routing(self.snapshot)
        # Nothing it held starts again (a restart after an engine's death) before the
        # reconcile after it renews has seen what the fleet still places here.
        self.manager.hold_launches()
        killed = self.manager.kill_every_engine()
        if self.split is not None:
            killed += [pid for pid in self.split.kill_all() if pid not in killed]
        logger.warning(
            "node %s fenced itself: %d engine(s) killed, no traffic until it renews",
            self.identity.id,
            len(killed),
        )
        return killed

    # -- the controller ----------------------------------------------------------------

    async def _control(self) -> None:
        try:
            lease = await anyio.to_thread.run_sync(
                lambda: self.store.hold_controller(
                    self.identity.id, lease_ms=self.timing.fence_after_ms, instance=self.instance
                )
            )
        except SbproxyError as exc:
            logger.warning("controller lease: [%s] %s", exc.code, exc)
            self.holding = None
            return
        if lease is not None and lease.fresh:
            logger.info("node %s is the controller (epoch %d)", lease.holder, lease.epoch)
        self.holding = lease
        if lease is None:
            self.scaler.forget()
            return
        try:
            await self._control_pass(lease)
        except Deposed as exc:
            logger.warning("controller deposed: %s", exc)
            self.holding = None
            self.scaler.forget()

    async def _control_pass(self, lease: ControllerLease) -> None:
        snapshot = await anyio.to_thread.run_sync(self.store.snapshot)
        # A controller younger than lost_after_ms counts silence from its take-over only.
        young = snapshot.now_ms - lease.acquired_at_ms < self.timing.lost_after_ms
        views = observe(
            snapshot.nodes,
            now_ms=snapshot.now_ms,
            timing=self.timing,
            watching_since_ms=lease.acquired_at_ms if young else None,
            # A pass runs only after this beat's renewal succeeded (beat()).
            renewed_here=self.identity.id,
        )
        moves = node_moves(snapshot.nodes, views, now_ms=snapshot.now_ms, timing=self.timing)
        for change in moves:
            moved = await anyio.to_thread.run_sync(
                partial(
                    self.store.move_node,
                    lease,
                    change.node,
                    from_state=change.transition.from_state.value,
                    to=change.transition.to_state.value,
                )
            )
            if moved:
                self.node_transitions[
                    (change.transition.from_state.value, change.transition.to_state.value)
                ] += 1
                # A node back to ready, leaving gracefully, or not yet seen renewing by a
                # new controller is routine; one going quiet or away is not.
                logger.log(
                    logging.INFO if change.routine else logging.WARNING,
                    "node %s: %s%s",
                    change.node,
                    change.transition.to_dict(),
                    " (its renewal is recent: not seen renewing since this controller took over)"
                    if change.routine and change.transition.to_state.value == "suspect"
                    else "",
                )
        counts = await self._autoscale(lease, snapshot, views)
        specs, definitions, frozen = self._specs(snapshot, counts)
        current = {d: (s.revision, definition_digest(definitions[d])) for d, s in specs.items()}
        stuck = stuck_placements(
            snapshot.placements,
            snapshot.nodes,
            now_ms=snapshot.now_ms,
            timeout_ms=self.timing.placement_timeout_ms,
        )
        sizes = {
            (d, choice.variant): choice.estimate.total_bytes
            for d, spec in specs.items()
            for choice in spec.choices()
        }
        failed_on = failed_workers(snapshot.placements, snapshot.nodes)
        placed = placement_views(snapshot.placements, current, stuck, sizes, failed_on)
        decided = plan(views, list(specs.values()), placed, policy=self.policy, frozen=frozen)
        self._note_staying(stuck, placed, decided.decisions)
        self._note_unplaced(decided.decisions)
        await self._carry_out(lease, decided.decisions, definitions)
        if snapshot.now_ms - self._events_pruned_at >= EVENTS_PRUNE_EVERY_MS:
            self._events_pruned_at = snapshot.now_ms
            await anyio.to_thread.run_sync(
                partial(self.store.prune_events, lease, keep_ms=EVENTS_KEEP_MS, keep=EVENTS_KEEP)
            )
        wanted = frozenset(specs) | frozen
        for placement in forgettable(placed, views, wanted=wanted):
            await anyio.to_thread.run_sync(
                partial(self.store.forget_placement, lease, placement, why="re-placed")
            )

    async def _autoscale(
        self, lease: ControllerLease, snapshot: FleetSnapshot, views: Sequence[NodeView]
    ) -> dict[str, int]:
        """Sample and decide the autoscaled deployments' counts (:mod:`.scaling`), record
        each decision as a fenced ``fleet.scale`` job; the counts to plan with now."""
        scaled = autoscaled(snapshot.desired_document)
        counts = scaled_counts(snapshot, scaled)
        if not scaled:
            return counts
        gone = [v.id for v in views if v.state.value in ("lost", "left")]
        for decision in self.scaler.decide(snapshot, scaled, gone=gone):
            body = decision.model_dump(mode="json")
            job = await anyio.to_thread.run_sync(partial(record_scale, self.store, lease, body))
            if job is None:
                continue
            self.scaler.recorded(decision)
            counts[decision.deployment] = decision.to_replicas
            logger.info(
                "scaled %s from %d to %d replicas (%s: %s; job %s)",
                decision.deployment,
                decision.from_replicas,
                decision.to_replicas,
                decision.reason.value,
                decision.message,
                job,
            )
        return counts

    async def wake(self, deployment: str) -> bool:
        """Ask the fleet for a replica of ``deployment``, autoscaled and at zero (a request
        waits for it): the demand is recorded once per deployment however many requests
        ask (:func:`~sbproxy.store.fleet_scale.record_demand`), again from this host at
        most once a heartbeat while it waits; whether this call wrote it.

        Raises:
            JournalUnavailable: ``journal_unavailable``.
        """
        now = self.clock()
        if now - self._demanded.get(deployment, float("-inf")) < self.timing.heartbeat_ms / 1000:
            return False
        self._demanded[deployment] = now
        written = await anyio.to_thread.run_sync(
            partial(record_demand, self.store, deployment, node=self.identity.id)
        )
        if written:
            logger.info("a request wants %s, scaled to zero: demand recorded", deployment)
        return written

    def _note_unplaced(self, decisions: Sequence[Any]) -> None:
        """Log each replica no node takes (once, and again when its reason changes)."""
        unplaced = {
            (d.deployment, d.replica): f"[{d.reason.value}] {d.message}"
            for d in decisions
            if isinstance(d, UnplacedReplica)
        }
        for (deployment, replica), why in sorted(unplaced.items()):
            if self._unplaced.get((deployment, replica)) != why:
                logger.warning("replica %d of %s is not placed: %s", replica, deployment, why)
        self._unplaced = unplaced

    def _note_staying(
        self, stuck: dict[str, StuckReason], placed: Sequence[Any], decisions: Sequence[Any]
    ) -> None:
        """Remember (and log once) the stuck placements no other node takes now."""
        refused = {
            (d.deployment, d.replica): d.message
            for d in decisions
            if isinstance(d, UnplacedReplica)
        }
        staying = {
            view.id: refused[(view.deployment, view.replica)]
            for view in placed
            if view.id in stuck and (view.deployment, view.replica) in refused
        }
        for placement, why in staying.items():
            if placement not in self.stuck_staying:
                logger.warning("placement %s: %s", placement, why)
        self.stuck_staying = staying

    def _specs(
        self, snapshot: FleetSnapshot, counts: dict[str, int] | None = None
    ) -> tuple[dict[str, DeploymentSpec], dict[str, dict[str, Any]], frozenset[str]]:
        """The desired deployments as planner specs, their definitions (JSON), and the ones
        this controller cannot build a spec for (frozen: never stopped for it); ``counts``:
        the replicas of the autoscaled ones.

        A spec comes from the catalog, not from this controller's own hardware: a pinned
        variant is taken as pinned (its hardware is checked per candidate node by the
        planner), and an unpinned one is resolved on this worker when it can be, else sized
        as the model's first variant an engine serves (the node resolves its own)."""
        if snapshot.desired_document is None or snapshot.desired_revision is None:
            return {}, {}, frozenset()
        document = json.loads(snapshot.desired_document)
        specs: dict[str, DeploymentSpec] = {}
        definitions: dict[str, dict[str, Any]] = {}
        frozen: set[str] = set()
        service = ModelHostService.serving(self.manager)
        # Sized from a member's GGUF header where one holds the artifact, else file sizes.
        facts = reported_facts(snapshot.nodes)
        avoid = avoided_nodes(snapshot.avoids, now_ms=snapshot.now_ms)
        for deployment, body in sorted(document.get("deployments", {}).items()):
            try:
                config = DeploymentConfig.model_validate(body)
                artifact = catalog_artifact(
                    config,
                    service.catalog,
                    lambda c: self.manager.resolve_config(c, service.catalog),
                )
                specs[deployment] = deployment_spec(
                    deployment,
                    config,
                    revision=snapshot.desired_revision,
                    resolved=artifact,
                    catalog=service.catalog,
                    facts=facts,
                    safety_margin=self.manager.safety_margin,
                    avoid=avoid.get(deployment, frozenset()),
                    replicas=(counts or {}).get(deployment),
                )
            except (SbproxyError, ValueError, KeyError) as exc:
                if deployment not in self._unspecified:
                    logger.warning(
                        "deployment %s cannot be planned by this controller: %s; its "
                        "placements are kept as they are",
                        deployment,
                        exc,
                    )
                frozen.add(deployment)
                continue
            definitions[deployment] = config.model_dump(mode="json", exclude_unset=True)
        self._unspecified = frozenset(frozen)
        return specs, definitions, frozenset(frozen)

    async def _carry_out(
        self,
        lease: ControllerLease,
        decisions: Sequence[Any],
        definitions: dict[str, dict[str, Any]],
    ) -> None:
        # A stuck placement's move stops it in the replacement's own transaction.
        moved = {
            d.replaces
            for d in decisions
            if isinstance(d, ReplaceReplica) and d.cause != "node_gone"
        }
        for decision in decisions:
            if isinstance(decision, StopReplica) and decision.placement in moved:
                continue
            if isinstance(decision, StartReplica | ReplaceReplica):
                body = decision.model_dump(mode="json")
                definition = definitions[decision.deployment]
                fault_point("fleet.place:before")
                placement, job = await anyio.to_thread.run_sync(
                    partial(
                        self.store.place,
                        lease,
                        body,
                        definition=definition,
                        avoid_ms=self.timing.placement_timeout_ms,
                    )
                )
                fault_point("fleet.place:committed")
                self.placements_made += 1
                if isinstance(decision, ReplaceReplica):
                    self.replacements += 1
                    if decision.cause != "node_gone":
                        self.stuck_replacements[decision.cause] += 1
                logger.info(
                    "placed %s replica %d on %s (placement %s, job %s, variant %s, %s "
                    "bytes from %s%s): %s",
                    decision.deployment,
                    decision.replica,
                    decision.node,
                    placement,
                    job,
                    decision.variant or "resolved by the node",
                    decision.reserved_bytes,
                    decision.estimate_basis.value,
                    f", replacing {decision.replaces} of {decision.from_node}: {decision.cause}"
                    if isinstance(decision, ReplaceReplica)
                    else "",
                    decision.reason,
                )
            elif isinstance(decision, StopReplica):
                fault_point("fleet.stop:before")
                await anyio.to_thread.run_sync(
                    partial(
                        self.store.stop_placement, lease, decision.placement, cause=decision.cause
                    )
                )
                fault_point("fleet.stop:committed")

    # -- this node's placements --------------------------------------------------------

    async def close_splits(self) -> None:
        """Stop this node's split workers and tunnels (the host is stopping)."""
        if self.split is not None:
            await self.split.aclose()

    async def _reconcile(self, snapshot: FleetSnapshot, group: anyio.abc.TaskGroup) -> None:
        if self.fenced or self.leaving:
            return
        me = next((n for n in snapshot.nodes if n.id == self.identity.id), None)
        wanted = {} if me is None or me.left else local_deployments(snapshot.placements, me.id)
        # What a fence held and the fleet still places here may launch again.
        self.manager.release_launches(wanted)
        if self.split is not None:
            await self._reconcile_splits(
                snapshot, wanted, group, member=me is not None and not me.left
            )
        running = {
            d: c.model_dump(mode="json", exclude_unset=True)
            for d, c in ModelHostService.serving(self.manager).served.deployments.items()
        }
        if _normal(wanted) != _normal(running):
            retry_at = self._reload_failed_at + RELOAD_RETRY_S
            if not self._reconciling and self.clock() >= retry_at:
                self._reconciling = True
                group.start_soon(self._reload_to, wanted)
            return
        status = {row.deployment: row for row in self.manager.status()}
        mine = self._my_placements()
        for placement in snapshot.placements:
            if placement.node != self.identity.id:
                continue
            local = replica_deployment_id(placement.deployment, placement.replica)
            row = status.get(local)
            # Stopped once its local id runs nothing, or runs another placement now.
            if placement.state == "stopping" and mine.get(local) != placement.id:
                await anyio.to_thread.run_sync(
                    partial(self.store.placement_stopped, self.identity.id, placement.id)
                )
            elif (
                placement.state in ("pending", "starting")
                and row is not None
                and row.routable
                # Ready once the fleet has this node's report of it routable too: every
                # gateway then routes it the moment it sees the placement ready.
                and (self._reported.get(local) or {}).get("routable")
                # A split's engine runs with its own placement's workers, not the last one's
                # (still up for a moment after the split moved, its workers gone).
                and (not placement.workers or self.manager.split_placement(local) == placement.id)
            ):
                await anyio.to_thread.run_sync(
                    partial(self.store.placement_ready, self.identity.id, placement.id)
                )
        self._restart_idle(wanted, status)

    async def _reconcile_splits(
        self,
        snapshot: FleetSnapshot,
        wanted: dict[str, Any],
        group: anyio.abc.TaskGroup,
        *,
        member: bool,
    ) -> None:
        """Run this node's split workers; take out of ``wanted`` the splits it leads whose
        workers are not all ready (a running one drains and stops), and tell the runtime how
        the others launch (their tunnels)."""
        assert self.split is not None  # noqa: S101 - the caller checked
        live = frozenset(v.id for v in self.views if v.state.value not in ("lost", "left"))
        await self.split.sync(snapshot.placements if member else (), live, group)
        nodes = {node.id: node for node in snapshot.nodes}
        # A worker whose node is leaving stops with it: the split is not run meanwhile.
        serving = frozenset(v.id for v in self.views if v.state in LIVE_STATES)
        leading, waiting = await self.split.lead(
            snapshot.placements if member else (), nodes, serving, group
        )
        for local in waiting:
            wanted.pop(local, None)
        self.manager.lead_splits(leading)

    def _restart_idle(self, wanted: dict[str, Any], status: dict[str, Any]) -> None:
        """Load a placed replica that is not running (after a fence or an engine exit)."""
        now = self.clock()
        for deployment in wanted:
            row = status.get(deployment)
            if row is None or row.routable or row.state not in _STARTABLE:
                continue
            if row.reason_code == "keep_alive":
                continue  # idle: the first request loads it (a routing candidate meanwhile)
            if now - self._loaded_at.get(deployment, -RELOAD_RETRY_S) < RELOAD_RETRY_S:
                continue
            self._loaded_at[deployment] = now
            try:
                self.manager.request_load(deployment, reason="fleet")
            except SbproxyError as exc:
                logger.warning("fleet load of %s: [%s] %s", deployment, exc.code, exc)

    async def _reload_to(self, wanted: dict[str, dict[str, Any]]) -> None:
        """Make ``wanted`` this host's desired state through the reload transaction."""
        try:
            deployments = {d: DeploymentConfig.model_validate(b) for d, b in wanted.items()}
            candidate = with_deployments(ModelHostService.serving(self.manager).served, deployments)
            job_id, report = await reload(self.manager, candidate, source="fleet")
            logger.info("fleet reconcile %s: %s", job_id, report.plan.to_dict())
            self._load_failure = None
        except (SbproxyError, ValueError) as exc:
            # Tried again RELOAD_RETRY_S later, not at every heartbeat; reported with the
            # renewals meanwhile, so the controller can move the placement elsewhere.
            self._reload_failed_at = self.clock()
            mine = self._my_placements()
            failed = {d: mine[d] for d in _failed_deployments(exc, wanted) if d in mine}
            self._load_failure = (failed, _code(exc))
            logger.warning("fleet reconcile failed: %s", exc)
        finally:
            self._reconciling = False

    # -- routing -----------------------------------------------------------------------

    def _refresh_routing(self, snapshot: FleetSnapshot | None) -> None:
        """Rebuild the routing table from ``snapshot``: every placement not being stopped,
        ``ready`` when its engine is routable on a ``ready``, ``cordoned`` or ``draining``
        node, or when keep-alive stopped it on a ``ready`` node (idle and loadable: listed
        ``loaded=False``, picked after loaded replicas, loaded by the hop's request); this
        node's own replicas are never ready while it is fenced."""
        if snapshot is None:
            return
        self._peers = PeerCredentials.from_nodes(snapshot.nodes)
        states = {view.id: view.state.value for view in self.views}
        nodes = {node.id: node for node in snapshot.nodes}
        policies = routing_policies(snapshot.desired_document)
        table: dict[str, list[PeerReplica]] = {}
        for placement in snapshot.placements:
            node = nodes.get(placement.node)
            if node is None or placement.state == "stopping":
                continue
            local = replica_deployment_id(placement.deployment, placement.replica)
            reported = node.replicas.get(local, {})
            state = states.get(node.id)
            routable = bool(reported.get("routable"))
            idle = state == "ready" and placement.state == "ready" and idle_loadable(reported)
            ready = ((routable and state in ("ready", "cordoned", "draining")) or idle) and not (
                node.id == self.identity.id and self.fenced
            )
            table.setdefault(placement.deployment, []).append(
                PeerReplica(
                    deployment=placement.deployment,
                    node_id=node.id,
                    base_url=node.advertise_url or "",
                    generation=int(reported.get("generation") or 0),
                    ready=ready,
                    active=int(reported.get("active") or 0),
                    queued=int(reported.get("queued") or 0),
                    loaded=routable,
                    local_id=local,
                    routing=policies.get(placement.deployment, LEAST_OUTSTANDING),
                )
            )
        self._table = RoutingTable(
            self.identity.id,
            {d: tuple(r) for d, r in table.items()},
            self.clock(),
            wakeable=_wakeable(autoscaled(snapshot.desired_document)),
        )


def routing_policies(desired_document: str | None) -> dict[str, str]:
    """Each deployment's ``routing`` in the fleet's desired state (``least_outstanding``
    where it sets none): the routing table carries the current one, so switching it needs
    no new placement (``routing`` is one of the placement fields)."""
    if desired_document is None:
        return {}
    deployments = json.loads(desired_document).get("deployments", {})
    return {
        name: str(body.get("routing") or LEAST_OUTSTANDING) for name, body in deployments.items()
    }


def fleet_view(snapshot: FleetSnapshot, local_node: str, timing: FleetTiming) -> FleetView:
    """The console's :class:`~sbproxy.fleet.view.FleetView` of ``snapshot``: each node in
    the one state the controller recorded (as ``/admin/fleet/nodes`` shows it; issue 30,
    item 7), with its heartbeat age on database time; a replica's state as its node
    reported it (``placing`` before that); placements not yet ready as the jobs in
    progress. ``timing`` is kept for callers; the controller applied it when it recorded."""
    del timing
    now = snapshot.now_ms
    views = {node.id: node.state for node in snapshot.nodes}
    nodes = tuple(
        NodeRow(
            node_id=node.id,
            state=views[node.id],
            heartbeat_age_ms=max(0, now - node.renewed_at_ms),
            advertise_url=node.advertise_url,
            labels=dict(node.labels),
        )
        for node in snapshot.nodes
    )
    reported = {node.id: node.replicas for node in snapshot.nodes}
    replicas = []
    jobs = []
    for placement in sorted(snapshot.placements, key=lambda p: (p.deployment, p.node)):
        local = replica_deployment_id(placement.deployment, placement.replica)
        row = reported.get(placement.node, {}).get(local) or {}
        replicas.append(
            ReplicaRow(
                deployment=placement.deployment,
                node_id=placement.node,
                state=replica_state(
                    views.get(placement.node), row.get("state"), reason_code=row.get("reason_code")
                )
                or "placing",
                generation=int(row.get("generation") or 0),
                port=row.get("port"),
                active=int(row.get("active") or 0),
                queued=int(row.get("queued") or 0),
            )
        )
        if placement.state in ("pending", "starting", "stopping"):
            jobs.append(
                PlacementJobRow(
                    job_id=placement.job_id,
                    kind="stop"
                    if placement.state == "stopping"
                    else ("replace" if placement.replaces else "place"),
                    deployment=placement.deployment,
                    node_id=placement.node,
                    status=placement.state,
                    age_ms=max(0, now - placement.updated_at_ms),
                )
            )
    desired: dict[str, int] = {}
    if snapshot.desired_document is not None:
        scaled = scaled_counts(snapshot, autoscaled(snapshot.desired_document))
        for deployment, body in json.loads(snapshot.desired_document)["deployments"].items():
            count = scaled.get(deployment)
            desired[deployment] = int(body.get("replicas", 1)) if count is None else count
    lease = snapshot.controller
    controller = None
    if lease is not None and lease.expires_at_ms > now:
        controller = ControllerRow(lease.holder, lease.epoch, lease.expires_at_ms - now)
    return FleetView(
        local_node_id=local_node,
        nodes=nodes,
        desired=desired,
        replicas=tuple(replicas),
        controller=controller,
        jobs=tuple(sorted(jobs, key=lambda j: -j.age_ms)),
        artifacts=cached_artifacts(snapshot.nodes, LIVE_STATES),
    )


def _wakeable(scaled: Mapping[str, Autoscaled]) -> dict[str, int]:
    """``{deployment: queue_timeout_ms}`` of the autoscaled deployments that may have no
    replica (``min: 0``): a request for one waits for a replica the fleet places."""
    return {d: a.queue_timeout_ms for d, a in scaled.items() if a.bounds.min == 0}


def _is_loopback(url: str) -> bool:
    """Whether ``url``'s host is a loopback or unspecified address (or ``localhost``)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in ("localhost", ""):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _failed_deployments(exc: Exception, wanted: dict[str, Any]) -> frozenset[str]:
    """The deployments a failed reconcile names (``details.deployment``), else all of
    ``wanted`` (the transaction failed as a whole)."""
    named = exc.details.get("deployment") if isinstance(exc, SbproxyError) else None
    if isinstance(named, str) and named in wanted:
        return frozenset({named})
    return frozenset(wanted)


def _code(exc: Exception) -> str:
    return exc.code if isinstance(exc, SbproxyError) else "invalid_definition"


def _normal(deployments: dict[str, Any]) -> dict[str, Any]:
    """Definitions compared by meaning: validated and dumped the same way."""
    return {
        d: DeploymentConfig.model_validate(b).model_dump(mode="json")
        for d, b in deployments.items()
    }
