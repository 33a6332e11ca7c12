"""The fleet's shared records in the PostgreSQL journal: members, the controller lease,
placements and fleet events (migration 9); the members' GGUF facts, each placement's variant
and estimate basis, and the nodes a deployment avoids after a stuck placement (migration 10).

Every time here is **database time** (``clock_timestamp()`` of the server, epoch ms): a
renewal, a lease's expiry and "now" when a member is judged are all read from the one clock
every host shares (ARCHITECTURE.md "Several hosts").

The controller holds the one row of ``fleet_controller`` with an ``epoch`` that grows with
each new holder. Every write the controller makes runs in a transaction that first locks
that row (``FOR SHARE``) and checks it still holds it at its epoch; a host that took over
has updated the row (which waits for the lock), so a deposed controller's write either
committed before the take-over or is refused (:class:`Deposed`, ``controller_deposed``) --
the database does the fencing, not the deposed host's own idea of time.

Synchronous and short: each call one transaction; callers run it on a worker thread. Two
connections per :class:`FleetStore`, each with its own lock, so that a node's membership
renewal (``join``, ``renew``) never queues behind a controller pass or an admin read on the
other; each is reopened at the next call after a failure (a third, ``LISTEN``, waits for
changes). Connection timeouts and deadlines are short so that a host cut off from the server
learns it within a heartbeat: a connection attempt gives up after :data:`CONNECT_TIMEOUT_S`,
and each round trip after the store's ``statement_deadline_s`` (:data:`STATEMENT_DEADLINE_S`
by default) without an answer -- a client-side deadline (:mod:`sbproxy.store.deadline`),
since a blackholed or frozen server never ends the wait by itself -- and the server cancels
a statement that runs past :func:`server_timeout_ms` of it (the connection stays usable).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import psycopg
from ulid import ULID

from sbproxy.errors import SbproxyError
from sbproxy.store.admission import JoinRefused, admit
from sbproxy.store.deadline import DeadlineConnection, transport_params
from sbproxy.store.migrations import migrate_postgres
from sbproxy.store.postgres import PgTarget
from sbproxy.store.revisions import FLEET_CHANNEL

__all__ = [
    "AvoidRow",
    "ControllerLease",
    "DemandRow",
    "Deposed",
    "FleetSnapshot",
    "FleetStore",
    "NodeIdInUse",
    "NodeRemoved",
    "NodeRow",
    "PlacementRow",
    "Renewal",
    "ScaleRow",
]

_NOW = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT"
_GONE = frozenset({"lost", "left"})
# Fleet events after which a host's routing table is out of date.
_ROUTING_EVENTS = frozenset(
    {"placed", "replaced", "ready", "stopping", "stopped", "forgotten", "node_state",
     "node_flags", "node_joined", "node_leaving", "node_revoked"}
)  # fmt: skip
# The kernel notices a dead peer of an idle LISTEN connection (libpq parameters).
_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 2,
}
# One connection attempt's bound (libpq's minimum).
CONNECT_TIMEOUT_S = 2
# How long one round trip waits for an answer by default: a renewal must fail well inside
# a heartbeat period (``heartbeat_ms``, 2 s by default) plus its slack, so that a node cut
# off from the server knows it before ``fence_after_ms``. A call finding its connection lost
# spends at most CONNECT_TIMEOUT_S + this.
STATEMENT_DEADLINE_S = 2.0


def server_timeout_ms(deadline_s: float) -> int:
    """The server-side ``statement_timeout`` beside a client deadline of ``deadline_s``: a
    quarter shorter, so that a live but slow server cancels the statement itself (the
    connection stays usable) before the client gives up on it."""
    return max(1, int(deadline_s * 750))


class Deposed(SbproxyError):
    """This host no longer holds the controller lease at its epoch (``controller_deposed``):
    its write was refused by the database."""

    default_code = "controller_deposed"


class NodeIdInUse(SbproxyError):
    """Another live process holds this node id (``node_id_in_use``, exit 2): a copied cache
    or a cloned machine with the same ``<cache>/node-id``, or the same ``node.id`` set on
    two hosts. ``details``: ``node_id``, ``renewed_at_ms`` (the holder's last renewal,
    database time) and ``ms_ago``."""

    default_code = "node_id_in_use"


class NodeRemoved(SbproxyError):
    """This node was removed from the fleet (``node_removed``, exit 2): it joins again only
    once an operator admits it (``sbproxy nodes admit NODE``)."""

    default_code = "node_removed"


@dataclass(frozen=True)
class Renewal:
    """What one membership renewal found.

    Attributes:
        now_ms: The renewal's database time (epoch ms); ``None`` when nothing was renewed.
        state: The node's recorded state (the controller's view), when renewed.
        left: The node was removed from the fleet: nothing was renewed, it runs nothing
            until an operator admits it again.
        held_elsewhere: Another process instance holds this node id now: nothing was
            renewed; this process must stop its engines and join again (refused while
            the other one lives).
        revoked: An operator revoked the node (``sbproxy nodes revoke``): nothing was
            renewed, it runs nothing, and it joins again only with a fresh join token.
    """

    now_ms: int | None
    state: str | None = None
    left: bool = False
    held_elsewhere: bool = False
    revoked: bool = False

    @property
    def renewed(self) -> bool:
        """Whether the lease was renewed."""
        return self.now_ms is not None


@dataclass(frozen=True)
class NodeRow:
    """One member as recorded (times on database time, epoch ms)."""

    id: str
    advertise_url: str | None
    labels: dict[str, str]
    engines: list[str]
    devices: list[dict[str, Any]]
    artifacts: list[str]
    replicas: dict[str, dict[str, Any]]
    state: str
    cordoned: bool
    draining: bool
    left: bool
    joined_at_ms: int
    renewed_at_ms: int
    artifact_facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{artifact digest: GGUF header facts}`` the node read from its verified artifacts
    (:class:`~sbproxy.model_host.runtime.memory.GgufFacts` fields)."""
    instance: str = ""
    """The process instance holding the node id ('' -- released by a graceful stop)."""
    leaving_at_ms: int | None = None
    """Database time the node marked itself leaving (a graceful stop); ``None`` while it
    runs."""
    revoked_at_ms: int | None = None
    """Database time an operator revoked the node (``sbproxy nodes revoke``); ``None``."""
    revoked_reason: str | None = None
    """Why it was revoked, as the operator said."""
    credential_sha256: str | None = field(default=None, repr=False)
    """The SHA-256 of the node's own credential (peers check hops against it); never shown."""
    inventory: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{artifact digest: {"bytes": total size, "verified": bool}}`` of the artifacts its
    cache holds (migration 14): what placement locality and peer fetches read."""

    @property
    def revoked(self) -> bool:
        """An operator revoked the node: peers refuse it, it renews nothing."""
        return self.revoked_at_ms is not None

    def holds(self, digest: str) -> bool:
        """Whether this node reported ``digest`` verified in its cache."""
        entry = self.inventory.get(digest)
        return entry is not None and bool(entry.get("verified"))

    def to_dict(self, now_ms: int | None = None) -> dict[str, Any]:
        """The JSON form (``/admin/fleet/nodes``); with ``now_ms``, ``heartbeat_age_ms``."""
        out: dict[str, Any] = {
            "id": self.id,
            "state": self.state,
            "advertise_url": self.advertise_url,
            "labels": self.labels,
            "engines": self.engines,
            "devices": self.devices,
            "cached_artifacts": self.artifacts,
            "artifact_facts": self.artifact_facts,
            "artifact_inventory": self.inventory,
            "replicas": self.replicas,
            "cordoned": self.cordoned,
            "draining": self.draining,
            "left": self.left,
            "joined_at_ms": self.joined_at_ms,
            "renewed_at_ms": self.renewed_at_ms,
            "leaving_at_ms": self.leaving_at_ms,
            "revoked_at_ms": self.revoked_at_ms,
            "revoked_reason": self.revoked_reason,
        }
        if now_ms is not None:
            out["heartbeat_age_ms"] = max(0, now_ms - self.renewed_at_ms)
        return out


@dataclass(frozen=True)
class PlacementRow:
    """One placed replica as recorded."""

    id: str
    deployment: str
    replica: int
    revision: int
    node: str
    devices: tuple[int, ...]
    engine: str
    reserved_bytes: int
    state: str
    replaces: str | None
    definition: dict[str, Any]
    epoch: int
    job_id: str
    updated_at_ms: int
    variant: str | None = None
    """The catalog variant it runs; ``None``: its node resolves one."""
    estimate_basis: str | None = None
    """What ``reserved_bytes`` was sized from: ``gguf_header`` or ``file_size``."""
    workers: tuple[dict[str, Any], ...] = ()
    """A split replica's RPC workers (``{"node", "devices", "reserved_bytes"}``), the
    leader's node first; empty for a replica on one node."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``/admin/fleet/placements``)."""
        return {
            "id": self.id,
            "deployment": self.deployment,
            "replica": self.replica,
            "revision": self.revision,
            "node": self.node,
            "devices": list(self.devices),
            "engine": self.engine,
            "reserved_bytes": self.reserved_bytes,
            "state": self.state,
            "replaces": self.replaces,
            "definition": self.definition,
            "epoch": self.epoch,
            "job_id": self.job_id,
            "updated_at_ms": self.updated_at_ms,
            "variant": self.variant,
            "estimate_basis": self.estimate_basis,
            "workers": [dict(worker) for worker in self.workers],
        }


@dataclass(frozen=True)
class ControllerLease:
    """The controller lease as one host holds it (or as read, ``holder`` anyone's).

    Attributes:
        holder: The node holding it.
        epoch: Its fencing epoch.
        acquired_at_ms: When this holder took it (database time).
        expires_at_ms: When it lapses unless renewed (database time).
        now_ms: Database time when this was read.
        fresh: This call took the lease (a new epoch), not renewed it.
        instance: The holder's process instance (a twin with the same node id holds
            nothing: the lease is held by node and instance).
    """

    holder: str
    epoch: int
    acquired_at_ms: int
    expires_at_ms: int
    now_ms: int
    fresh: bool = False
    instance: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``/admin/fleet/controller``)."""
        return {
            "holder": self.holder,
            "epoch": self.epoch,
            "acquired_at_ms": self.acquired_at_ms,
            "expires_at_ms": self.expires_at_ms,
            "expired": self.expires_at_ms <= self.now_ms,
        }


@dataclass(frozen=True)
class AvoidRow:
    """A node deployment ``deployment`` is kept off until ``until_ms`` (database time),
    because its placement ``placement`` there got stuck or failed (``reason``)."""

    deployment: str
    node: str
    until_ms: int
    reason: str
    placement: str

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {
            "deployment": self.deployment,
            "node": self.node,
            "until_ms": self.until_ms,
            "reason": self.reason,
            "placement": self.placement,
        }


@dataclass(frozen=True)
class ScaleRow:
    """The replica count the last ``fleet.scale`` decision set for one deployment."""

    deployment: str
    replicas: int
    decided_at_ms: int
    reason: str
    epoch: int
    job_id: str


@dataclass(frozen=True)
class DemandRow:
    """A gateway's request for a deployment at zero replicas (one per deployment)."""

    deployment: str
    at_ms: int
    node: str


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything a controller pass or a reader needs, read in one transaction."""

    now_ms: int
    nodes: tuple[NodeRow, ...]
    placements: tuple[PlacementRow, ...]
    controller: ControllerLease | None
    desired_revision: int | None = None
    desired_document: str | None = None
    events: tuple[dict[str, Any], ...] = field(default=())
    avoids: tuple[AvoidRow, ...] = field(default=())
    """The nodes deployments avoid now (``until_ms`` after ``now_ms``)."""
    scales: tuple[ScaleRow, ...] = field(default=())
    """The replica counts autoscaling decisions set (migration 12)."""
    demands: tuple[DemandRow, ...] = field(default=())
    """Deployments at zero replicas a gateway asked for."""


def _node(row: Sequence[Any]) -> NodeRow:
    return NodeRow(
        id=str(row[0]),
        advertise_url=row[1],
        labels=json.loads(row[2]),
        engines=json.loads(row[3]),
        devices=json.loads(row[4]),
        artifacts=json.loads(row[5]),
        replicas=json.loads(row[6]),
        state=str(row[7]),
        cordoned=bool(row[8]),
        draining=bool(row[9]),
        left=bool(row[10]),
        joined_at_ms=int(row[11]),
        renewed_at_ms=int(row[12]),
        artifact_facts=json.loads(row[13]),
        instance=str(row[14]),
        leaving_at_ms=None if row[15] is None else int(row[15]),
        revoked_at_ms=None if row[16] is None else int(row[16]),
        revoked_reason=row[17],
        credential_sha256=row[18],
        inventory=json.loads(row[19]),
    )


def _placement(row: Sequence[Any]) -> PlacementRow:
    return PlacementRow(
        id=str(row[0]),
        deployment=str(row[1]),
        replica=int(row[2]),
        revision=int(row[3]),
        node=str(row[4]),
        devices=tuple(json.loads(row[5])),
        engine=str(row[6]),
        reserved_bytes=int(row[7]),
        state=str(row[8]),
        replaces=row[9],
        definition=json.loads(row[10]),
        epoch=int(row[11]),
        job_id=str(row[12]),
        updated_at_ms=int(row[13]),
        variant=row[14],
        estimate_basis=row[15],
        workers=tuple(json.loads(row[16]) if row[16] else ()),
    )


_NODE_COLUMNS = (
    "id, advertise_url, labels_json, engines_json, devices_json, artifacts_json,"
    " replicas_json, state, cordoned, draining, left_fleet, joined_at_ms, renewed_at_ms,"
    " artifact_facts_json, instance, leaving_at_ms, revoked_at_ms, revoked_reason,"
    " credential_sha256, artifact_inventory_json"
)
_PLACEMENT_COLUMNS = (
    "id, deployment, replica, revision, node, devices_json, engine, reserved_bytes, state,"
    " replaces, definition_json, epoch, job_id, updated_at_ms, variant, estimate_basis,"
    " workers_json"
)


def _workers_json(workers: Sequence[Mapping[str, Any]] | None) -> str | None:
    if not workers:
        return None
    return json.dumps(
        [
            {
                "node": str(w["node"]),
                "devices": [int(d) for d in w["devices"]],
                "reserved_bytes": int(w["reserved_bytes"]),
            }
            for w in workers
        ]
    )


def _facts_json(facts: Mapping[str, Mapping[str, Any]] | None) -> str:
    return json.dumps({k: dict(v) for k, v in (facts or {}).items()}, sort_keys=True)


def _inventory_json(inventory: Mapping[str, Mapping[str, Any]] | None) -> str | None:
    if inventory is None:
        return None
    return json.dumps({k: dict(v) for k, v in inventory.items()}, sort_keys=True)


@dataclass
class _Channel:
    """One kept connection of a :class:`FleetStore` and the lock its calls take in turn."""

    name: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    connection: DeadlineConnection | None = None


class FleetStore:
    """The fleet's rows in the PostgreSQL journal at ``url`` (module docstring).

    Every method raises ``journal_unavailable`` (:class:`~sbproxy.store.postgres.
    JournalUnavailable`) when the server cannot be reached or does not answer in time.

    Args:
        url: The journal's ``postgresql://`` URL.
        statement_deadline_s: Seconds one round trip waits for the server before the call
            fails ``journal_unavailable`` and its connection is dropped (reopened at the
            next call); the agent may derive it from the fleet's timing.
    """

    def __init__(self, url: str, *, statement_deadline_s: float = STATEMENT_DEADLINE_S) -> None:
        if not statement_deadline_s > 0:
            raise ValueError(f"statement_deadline_s must be positive, not {statement_deadline_s}")
        self.target = PgTarget.parse(url)
        self.statement_deadline_s = statement_deadline_s
        # Membership renewals on a connection of their own: never behind a controller pass.
        self._control = _Channel("control")
        self._membership = _Channel("membership")
        self._schema_lock = threading.Lock()
        self._listener: DeadlineConnection | None = None
        self._listen_lock = threading.Lock()
        self._migrated = False
        self.deadline_s = CONNECT_TIMEOUT_S + statement_deadline_s
        """The longest one call waits on a server gone silent before it fails
        (``journal_unavailable``): a connection attempt, then one round trip."""

    # -- plumbing ----------------------------------------------------------------------

    def _ensure_schema(self) -> None:
        if self._migrated:
            return
        with self._schema_lock:
            if not self._migrated:
                migrate_postgres(self.target)
                self._migrated = True

    def _connect(self, channel: _Channel) -> DeadlineConnection:
        if channel.connection is not None and not channel.connection.closed:
            return channel.connection
        try:
            connection = DeadlineConnection.connect(
                self.target.conninfo,
                connect_timeout=CONNECT_TIMEOUT_S,
                options=f"-c statement_timeout={server_timeout_ms(self.statement_deadline_s)}",
                prepare_threshold=self.target.prepare_threshold,
                application_name=f"sbproxy-fleet-{channel.name}",
                **transport_params(self.target.conninfo),
            )
        except psycopg.OperationalError as exc:
            raise self.target.unavailable(exc) from None
        connection.deadline_s = self.statement_deadline_s
        channel.connection = connection
        return connection

    @contextmanager
    def _transaction(self, *, membership: bool = False) -> Iterator[psycopg.Cursor[Any]]:
        """One transaction on a kept connection -- the membership one (``join``, ``renew``)
        or the control one (everything else); a connection failure, or a round trip past
        the deadline, drops it."""
        channel = self._membership if membership else self._control
        with channel.lock:
            self._ensure_schema()
            connection = self._connect(channel)
            try:
                with connection.transaction(), connection.cursor() as cursor:
                    yield cursor
            except psycopg.OperationalError as exc:
                self._drop(channel)
                raise self.target.unavailable(exc) from None
            except psycopg.Error:
                if connection.broken:
                    self._drop(channel)
                raise

    @contextmanager
    def fenced(self, lease: ControllerLease) -> Iterator[tuple[psycopg.Cursor[Any], int]]:
        """A controller's transaction: ``(cursor, database now)`` with the lease row locked
        and checked (for the fleet records of other modules, :mod:`.fleet_scale`).

        Raises:
            Deposed: the lease is no longer this controller's.
            JournalUnavailable: ``journal_unavailable``.
        """
        with self._transaction() as cursor:
            yield cursor, self._fence(cursor, lease)

    @contextmanager
    def transaction(self) -> Iterator[tuple[psycopg.Cursor[Any], int]]:
        """A plain transaction on the control connection: ``(cursor, database now)``.

        Raises:
            JournalUnavailable: ``journal_unavailable``.
        """
        with self._transaction() as cursor:
            yield cursor, self._now(cursor)

    @staticmethod
    def _drop(channel: _Channel) -> None:
        connection, channel.connection = channel.connection, None
        if connection is not None:
            with suppress(psycopg.Error):
                connection.close()

    def close(self) -> None:
        """Close the kept connections (a later call opens new ones)."""
        for channel in (self._membership, self._control):
            with channel.lock:
                self._drop(channel)
        listener, self._listener = self._listener, None
        if listener is not None:
            with suppress(psycopg.Error):
                listener.close()

    @staticmethod
    def _now(cursor: psycopg.Cursor[Any]) -> int:
        row = cursor.execute(f"SELECT {_NOW}").fetchone()
        assert row is not None  # noqa: S101 - SELECT of an expression returns a row
        return int(row[0])

    @staticmethod
    def _event(
        cursor: psycopg.Cursor[Any], now: int, kind: str, subject: str, data: Mapping[str, Any]
    ) -> None:
        cursor.execute(
            "INSERT INTO fleet_events (at_ms, type, subject, data_json) VALUES (%s, %s, %s, %s)",
            (now, kind, subject, json.dumps(dict(data), sort_keys=True)),
        )
        if kind in _ROUTING_EVENTS:
            # Delivered at commit to every host that listens (:meth:`wait_for_change`): its
            # routing table follows a placement change at once, not at its next heartbeat.
            cursor.execute("SELECT pg_notify(%s, %s)", (FLEET_CHANNEL, kind))

    record_event = _event
    """Record a fleet event (and notify listeners of a routing change) in a transaction."""

    def wait_for_change(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a change that moves routing (a placement made,
        ready, stopping or gone, a node state or flag moved, a new desired revision) on a
        ``LISTEN`` connection of its own; whether one came. Run it on a worker thread.

        Raises:
            JournalUnavailable: ``journal_unavailable`` (the connection is dropped; the next
                call listens again).
        """
        with self._listen_lock:
            try:
                if self._listener is None or self._listener.closed:
                    self._listener = DeadlineConnection.connect(
                        self.target.conninfo,
                        autocommit=True,
                        connect_timeout=CONNECT_TIMEOUT_S,
                        **_KEEPALIVES,
                    )
                    # The LISTEN itself is bounded too (notifies waits its own timeout).
                    self._listener.deadline_s = self.statement_deadline_s
                    self._listener.execute(f"LISTEN {FLEET_CHANNEL}")
                for _ in self._listener.notifies(timeout=timeout_s, stop_after=1):
                    return True
                return False
            except psycopg.Error as exc:
                listener, self._listener = self._listener, None
                if listener is not None:
                    with suppress(psycopg.Error):
                        listener.close()
                raise self.target.unavailable(exc) from None

    @staticmethod
    def _job(
        cursor: psycopg.Cursor[Any],
        now: int,
        *,
        kind: str,
        subject: str,
        node: str,
        body: Mapping[str, Any],
    ) -> str:
        """Record a finished fleet job (a decision taken in this transaction); its id."""
        job_id = str(ULID())
        text = json.dumps(dict(body), sort_keys=True)
        cursor.execute(
            "INSERT INTO jobs (id, kind, workflow_version, subject, input_json, status, attempt,"
            " lease_owner, output_json, created_at_ms, updated_at_ms, started_at_ms,"
            " ended_at_ms, node) VALUES (%s, %s, 1, %s, %s, 'succeeded', 1, %s, %s, %s, %s,"
            " %s, %s, %s)",
            (job_id, kind, subject, text, node, text, now, now, now, now, node),
        )
        cursor.execute(
            "INSERT INTO job_events (job_id, at_ms, type, data_json) VALUES (%s, %s, 'status', %s)",
            (job_id, now, json.dumps({"status": "succeeded", "by": node})),
        )
        return job_id

    record_job = _job
    """Record a finished fleet job in a transaction; its id."""

    # -- membership --------------------------------------------------------------------

    def join(
        self,
        node_id: str,
        *,
        advertise_url: str | None,
        labels: Mapping[str, str],
        engines: Sequence[str],
        devices: Sequence[Mapping[str, Any]],
        artifacts: Sequence[str],
        artifact_facts: Mapping[str, Mapping[str, Any]] | None = None,
        inventory: Mapping[str, Mapping[str, Any]] | None = None,
        instance: str = "",
        live_within_ms: int | None = None,
        take_over_renewed_at_ms: int | None = None,
        credential_sha256: str | None = None,
        join_token: tuple[str, str] | None = None,
        shared_admits: bool = True,
    ) -> int:
        """Join (or rejoin) as ``node_id`` under process ``instance``; database now (ms).

        Admission (docs/cluster.md, "Admitting nodes"), checked in this one transaction with
        the member's row locked: a node presenting ``credential_sha256`` (the hash of its own
        node credential) joins when it is the hash recorded for it; else it redeems
        ``join_token`` (``(id, secret hash)``, :func:`~sbproxy.store.admission.redeem`), or,
        when ``shared_admits`` (the deprecated shared fleet credential still admits), joins
        as before. Either way ``credential_sha256`` becomes the member's recorded hash. A
        revoked member joins only by a token, after ``sbproxy nodes admit``. Without
        ``credential_sha256`` (a caller that predates admission) nothing of it is checked.

        ``devices``: ``[{index, capacity_bytes, accelerator, compute_capability?}]``, one per
        device (each GPU, or each share of the CPU);
        ``artifact_facts``: ``{digest: GGUF facts}`` of its verified artifacts;
        ``inventory``: ``{digest: {"bytes", "verified"}}`` of the artifacts its cache holds.

        A known node keeps its operator flags (a restart does not uncordon it) and its
        recorded state; a graceful leave's mark is cleared.

        Args:
            instance: This process's token (made at each start).
            live_within_ms: Refuse while another instance holds the id and renewed within
                this long (``lost_after_ms``); ``None``: never refuse.
            take_over_renewed_at_ms: Take the id over from another instance whose last
                renewal is still exactly this (the caller watched it stand still for
                longer than a heartbeat: that process is dead or frozen).

        Raises:
            NodeIdInUse: ``node_id_in_use`` -- another live instance holds the id.
            NodeRemoved: ``node_removed`` -- the node was removed (``sbproxy nodes admit``).
            JoinRefused: ``node_revoked``, ``join_token_required``, ``join_token_invalid``,
                ``join_token_expired``, ``join_token_used_up``, ``node_credential_invalid``.
        """
        info = (
            advertise_url,
            json.dumps(dict(labels), sort_keys=True),
            json.dumps(list(engines)),
            json.dumps([dict(d) for d in devices]),
            json.dumps(sorted(artifacts)),
            _facts_json(artifact_facts),
            _inventory_json(inventory) or "{}",
        )
        with self._transaction(membership=True) as cursor:
            now = self._now(cursor)
            held = cursor.execute(
                "SELECT instance, renewed_at_ms, left_fleet, revoked_at_ms, credential_sha256"
                " FROM fleet_nodes WHERE id = %s FOR UPDATE",
                (node_id,),
            ).fetchone()
            if held is not None and bool(held[2]) and held[3] is not None:
                raise JoinRefused(
                    f"node {node_id} was revoked (sbproxy nodes revoke): it does not join again",
                    code="node_revoked",
                    remediation=f"If it may join again: `sbproxy nodes admit {node_id}`, then "
                    "start it with a fresh join token (sbproxy nodes token create).",
                    details={"node_id": node_id},
                )
            if credential_sha256 is not None:
                admit(
                    cursor,
                    now,
                    node_id=node_id,
                    row=held,
                    credential_sha256=credential_sha256,
                    join_token=join_token,
                    shared_admits=shared_admits,
                )
            if held is not None:
                other, renewed_at, left = str(held[0]), int(held[1]), bool(held[2])
                if left:
                    raise NodeRemoved(
                        f"node {node_id} was removed from the fleet (sbproxy nodes remove); "
                        "it does not join again by itself",
                        remediation=f"Admit it again with `sbproxy nodes admit {node_id}`, "
                        "then start it; or give this host another node id.",
                        details={"node_id": node_id},
                    )
                live = live_within_ms is not None and now - renewed_at < live_within_ms
                if other not in ("", instance) and live and take_over_renewed_at_ms != renewed_at:
                    raise NodeIdInUse(
                        f"node id {node_id} is held by another live sbproxy process (it "
                        f"renewed {now - renewed_at} ms ago): a copied cache or a cloned "
                        "machine, or node.id set alike on two hosts",
                        remediation="Give this host its own id (proxy.model_host.node.id, or "
                        "delete <cache>/node-id of a copied cache for a fresh one), or stop "
                        "the other process first.",
                        details={
                            "node_id": node_id,
                            "renewed_at_ms": renewed_at,
                            "ms_ago": now - renewed_at,
                        },
                    )
            cursor.execute(
                "INSERT INTO fleet_nodes (id, advertise_url, labels_json, engines_json,"
                " devices_json, artifacts_json, artifact_facts_json, artifact_inventory_json,"
                " replicas_json, state, joined_at_ms, renewed_at_ms, instance)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, '{}', 'ready', %s, %s, %s)"
                " ON CONFLICT (id) DO UPDATE SET advertise_url = EXCLUDED.advertise_url,"
                " labels_json = EXCLUDED.labels_json, engines_json = EXCLUDED.engines_json,"
                " devices_json = EXCLUDED.devices_json, artifacts_json = EXCLUDED.artifacts_json,"
                " artifact_facts_json = EXCLUDED.artifact_facts_json,"
                " artifact_inventory_json = EXCLUDED.artifact_inventory_json,"
                " renewed_at_ms = EXCLUDED.renewed_at_ms, instance = EXCLUDED.instance,"
                # A new process runs no replica yet: what the last one reported (ready
                # engines, now gone) must not route requests to it before it renews.
                " replicas_json = '{}', leaving_at_ms = NULL",
                (node_id, *info, now, now, instance),
            )
            if credential_sha256 is not None:
                # Admitted above: this node's credential is the one peers check from now on.
                cursor.execute(
                    "UPDATE fleet_nodes SET credential_sha256 = %s, revoked_at_ms = NULL,"
                    " revoked_reason = NULL WHERE id = %s",
                    (credential_sha256, node_id),
                )
            self._event(cursor, now, "node_joined", node_id, {"advertise_url": advertise_url})
        return now

    def renew(
        self,
        node_id: str,
        *,
        replicas: Mapping[str, Mapping[str, Any]],
        artifacts: Sequence[str] | None = None,
        artifact_facts: Mapping[str, Mapping[str, Any]] | None = None,
        inventory: Mapping[str, Mapping[str, Any]] | None = None,
        instance: str = "",
    ) -> Renewal | None:
        """Renew ``node_id``'s membership on database time, with its replicas' counts (and,
        when given, its cached artifacts with their GGUF facts, and its artifact
        ``inventory`` -- ``None`` keeps the recorded one), as process ``instance``.

        A removed node is not renewed (``left``), nor a revoked one (``revoked``), nor one
        another instance holds now (``held_elsewhere``); the statement itself checks all
        three, so a node that ignores its own client logic cannot renew either.

        Returns:
            The :class:`Renewal`; ``None`` when the node has no row (it must join again).
        """
        params = {
            "replicas": json.dumps(dict(replicas), sort_keys=True),
            "artifacts": None if artifacts is None else json.dumps(sorted(artifacts)),
            "facts": None if artifact_facts is None else _facts_json(artifact_facts),
            "inventory": _inventory_json(inventory),
            "id": node_id,
            "instance": instance,
        }
        with self._transaction(membership=True) as cursor:
            row = cursor.execute(
                f"UPDATE fleet_nodes SET renewed_at_ms = {_NOW}, replicas_json = %(replicas)s,"  # noqa: S608
                " artifacts_json = COALESCE(%(artifacts)s, artifacts_json),"
                " artifact_facts_json = COALESCE(%(facts)s, artifact_facts_json),"
                " artifact_inventory_json = COALESCE(%(inventory)s, artifact_inventory_json),"
                " leaving_at_ms = NULL"
                " WHERE id = %(id)s AND left_fleet = 0 AND revoked_at_ms IS NULL"
                " AND instance = %(instance)s"
                " RETURNING renewed_at_ms, state",
                params,
            ).fetchone()
            if row is not None:
                return Renewal(now_ms=int(row[0]), state=str(row[1]))
            found = cursor.execute(
                "SELECT left_fleet, revoked_at_ms FROM fleet_nodes WHERE id = %s", (node_id,)
            ).fetchone()
        if found is None:
            return None
        if bool(found[0]) or found[1] is not None:
            return Renewal(now_ms=None, left=bool(found[0]), revoked=found[1] is not None)
        return Renewal(now_ms=None, held_elsewhere=True)

    def leave(self, node_id: str, *, instance: str) -> bool:
        """A graceful stop: mark ``node_id`` leaving on database time (out of rotation at
        once; its replicas are re-placed after ``rejoin_grace_ms`` unless it is back),
        release the id (a restart takes it at once) and, when this instance holds the
        controller lease, end it now (another member takes it at its next beat, rather
        than after ``fence_after_ms``, and counts the grace from then); ``False`` when
        another instance holds the id or there is no row."""
        # The mark is taken under the row's lock, never before the node's last renewal: a
        # renewal that committed between a clock read and this update would otherwise sit
        # after the mark, and the node would count as running until lost_after_ms.
        with self._transaction() as cursor:
            row = cursor.execute(
                f"UPDATE fleet_nodes SET leaving_at_ms = GREATEST({_NOW}, renewed_at_ms),"  # noqa: S608
                " instance = ''"
                " WHERE id = %s AND instance = %s AND left_fleet = 0"
                " RETURNING leaving_at_ms",
                (node_id, instance),
            ).fetchone()
            if row is not None:
                self._event(cursor, int(row[0]), "node_leaving", node_id, {})
                released = cursor.execute(
                    f"UPDATE fleet_controller SET expires_at_ms = {_NOW}"  # noqa: S608
                    " WHERE id = 1 AND holder = %s AND holder_instance = %s"
                    f" AND expires_at_ms > {_NOW} RETURNING epoch, expires_at_ms",
                    (node_id, instance),
                ).fetchone()
                if released is not None:
                    epoch, at = int(released[0]), int(released[1])
                    self._event(cursor, at, "controller_released", node_id, {"epoch": epoch})
        return row is not None

    def snapshot(self, *, events: int = 0) -> FleetSnapshot:
        """Members, placements, the controller lease and the newest desired revision, in one
        read (the last ``events`` fleet events too, newest first)."""
        with self._transaction() as cursor:
            now = self._now(cursor)
            nodes = tuple(
                _node(r)
                for r in cursor.execute(
                    f"SELECT {_NODE_COLUMNS} FROM fleet_nodes ORDER BY id"  # noqa: S608
                ).fetchall()
            )
            placements = tuple(
                _placement(r)
                for r in cursor.execute(
                    f"SELECT {_PLACEMENT_COLUMNS} FROM fleet_placements"  # noqa: S608
                    " ORDER BY deployment, replica, id"
                ).fetchall()
            )
            lease = cursor.execute(
                "SELECT holder, epoch, acquired_at_ms, expires_at_ms FROM fleet_controller"
                " WHERE id = 1"
            ).fetchone()
            desired = cursor.execute(
                "SELECT revision, document FROM desired_revisions ORDER BY revision DESC LIMIT 1"
            ).fetchone()
            avoids = tuple(
                AvoidRow(str(r[0]), str(r[1]), int(r[2]), str(r[3]), str(r[4]))
                for r in cursor.execute(
                    "SELECT deployment, node, until_ms, reason, placement FROM fleet_avoid"
                    " WHERE until_ms > %s ORDER BY deployment, node",
                    (now,),
                ).fetchall()
            )
            scales = tuple(
                ScaleRow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4]), str(r[5]))
                for r in cursor.execute(
                    "SELECT deployment, replicas, decided_at_ms, reason, epoch, job_id"
                    " FROM fleet_scale ORDER BY deployment"
                ).fetchall()
            )
            demands = tuple(
                DemandRow(str(r[0]), int(r[1]), str(r[2]))
                for r in cursor.execute(
                    "SELECT deployment, at_ms, node FROM fleet_demand ORDER BY deployment"
                ).fetchall()
            )
            recent: list[dict[str, Any]] = []
            if events:
                recent = [
                    {"seq": int(r[0]), "at_ms": int(r[1]), "type": r[2], "subject": r[3]}
                    | {"data": json.loads(r[4])}
                    for r in cursor.execute(
                        "SELECT seq, at_ms, type, subject, data_json FROM fleet_events"
                        " ORDER BY seq DESC LIMIT %s",
                        (events,),
                    ).fetchall()
                ]
        controller = (
            None
            if lease is None
            else ControllerLease(str(lease[0]), int(lease[1]), int(lease[2]), int(lease[3]), now)
        )
        return FleetSnapshot(
            now_ms=now,
            nodes=nodes,
            placements=placements,
            controller=controller,
            desired_revision=None if desired is None else int(desired[0]),
            desired_document=None if desired is None else str(desired[1]),
            events=tuple(recent),
            avoids=avoids,
            scales=scales,
            demands=demands,
        )

    def set_flags(
        self,
        node_id: str,
        *,
        by: str,
        cordoned: bool | None = None,
        draining: bool | None = None,
        left: bool | None = None,
    ) -> str | None:
        """An operator's flag change on ``node_id``, recorded as a ``fleet.node`` job; the
        job id, or ``None`` when there is no such node. ``left=False`` admits a removed
        node again (its other flags cleared; recorded ``lost`` until it renews)."""
        changes = {
            name: value
            for name, value in (("cordoned", cordoned), ("draining", draining), ("left", left))
            if value is not None
        }
        columns = {"cordoned": "cordoned", "draining": "draining", "left": "left_fleet"}
        sets = ", ".join(f"{columns[name]} = %({name})s" for name in changes)
        if changes.get("left") is False:
            # Admitted again: it joins as a node with no flags, recorded lost (gone) until
            # the controller sees it renew -- ``left`` itself is terminal in the table.
            sets += (
                ", cordoned = CASE WHEN left_fleet = 1 THEN 0 ELSE cordoned END"
                ", draining = CASE WHEN left_fleet = 1 THEN 0 ELSE draining END"
                ", state = CASE WHEN left_fleet = 1 THEN 'lost' ELSE state END"
            )
        params: dict[str, Any] = {name: int(value) for name, value in changes.items()}
        with self._transaction() as cursor:
            now = self._now(cursor)
            found = cursor.execute(
                f"UPDATE fleet_nodes SET {sets} WHERE id = %(id)s RETURNING id",  # noqa: S608
                {**params, "id": node_id},
            ).fetchone()
            if found is None:
                return None
            self._event(cursor, now, "node_flags", node_id, changes)
            return self._job(
                cursor,
                now,
                kind="fleet.node",
                subject=f"node:{node_id}",
                node=by,
                body={"node": node_id, **changes},
            )

    # -- the controller lease ----------------------------------------------------------

    def hold_controller(
        self, holder: str, *, lease_ms: int, instance: str = ""
    ) -> ControllerLease | None:
        """Renew the controller lease if ``holder`` (as process ``instance``) holds it
        unexpired, else take it when it is free or lapsed (a new epoch); ``None`` when
        another host holds it. A removed member, or one whose id another instance holds
        now, takes nothing (the statement checks)."""
        with self._transaction() as cursor:
            now = self._now(cursor)
            params = {"exp": now + lease_ms, "me": holder, "now": now, "inst": instance}
            row = cursor.execute(
                "UPDATE fleet_controller SET expires_at_ms = %(exp)s WHERE id = 1"
                " AND holder = %(me)s AND holder_instance = %(inst)s"
                " AND expires_at_ms > %(now)s"
                " AND NOT EXISTS (SELECT 1 FROM fleet_nodes WHERE id = %(me)s"
                "   AND (left_fleet = 1 OR revoked_at_ms IS NOT NULL OR instance <> %(inst)s))"
                " RETURNING holder, epoch, acquired_at_ms, expires_at_ms",
                params,
            ).fetchone()
            if row is not None:
                return ControllerLease(
                    str(row[0]), int(row[1]), int(row[2]), int(row[3]), now, instance=instance
                )
            eligible = cursor.execute(
                "SELECT NOT EXISTS (SELECT 1 FROM fleet_nodes WHERE id = %(me)s"
                " AND (left_fleet = 1 OR revoked_at_ms IS NOT NULL OR instance <> %(inst)s))",
                params,
            ).fetchone()
            if eligible is None or not eligible[0]:
                return None
            row = cursor.execute(
                "INSERT INTO fleet_controller (id, holder, epoch, acquired_at_ms, expires_at_ms,"
                " holder_instance) VALUES (1, %(me)s, 1, %(now)s, %(exp)s, %(inst)s)"
                " ON CONFLICT (id) DO UPDATE SET"
                " holder = EXCLUDED.holder, epoch = fleet_controller.epoch + 1,"
                " acquired_at_ms = EXCLUDED.acquired_at_ms,"
                " expires_at_ms = EXCLUDED.expires_at_ms,"
                " holder_instance = EXCLUDED.holder_instance"
                " WHERE fleet_controller.expires_at_ms <= %(now)s"
                " RETURNING holder, epoch, acquired_at_ms, expires_at_ms",
                params,
            ).fetchone()
            if row is None:
                return None
            self._event(cursor, now, "controller_elected", holder, {"epoch": int(row[1])})
        return ControllerLease(
            str(row[0]), int(row[1]), int(row[2]), int(row[3]), now, True, instance=instance
        )

    def _fence(self, cursor: psycopg.Cursor[Any], lease: ControllerLease) -> int:
        """Lock the lease row; database now when ``lease`` still holds it, else Deposed."""
        now = self._now(cursor)
        row = cursor.execute(
            "SELECT epoch FROM fleet_controller WHERE id = 1 AND holder = %s AND epoch = %s"
            " AND holder_instance = %s AND expires_at_ms > %s FOR SHARE",
            (lease.holder, lease.epoch, lease.instance, now),
        ).fetchone()
        if row is None:
            raise Deposed(
                f"{lease.holder} no longer holds the controller lease at epoch {lease.epoch}",
                details={"holder": lease.holder, "epoch": lease.epoch},
            )
        return now

    def move_node(self, lease: ControllerLease, node_id: str, *, from_state: str, to: str) -> bool:
        """Record a checked node state change (compare-and-set on ``from_state``), with an
        event; ``False`` when the row moved meanwhile.

        Raises:
            Deposed: the lease is no longer this controller's.
        """
        with self._transaction() as cursor:
            now = self._fence(cursor, lease)
            moved = cursor.execute(
                "UPDATE fleet_nodes SET state = %s WHERE id = %s AND state = %s",
                (to, node_id, from_state),
            ).rowcount
            if moved:
                self._event(
                    cursor,
                    now,
                    "node_state",
                    node_id,
                    {"from": from_state, "to": to, "epoch": lease.epoch},
                )
            if moved and to in _GONE:
                # Lost means over (ARCHITECTURE.md "Several hosts"): the node's placements
                # end with the move, so a node that comes back gets none of them again --
                # it stops what it held, and a ready replacement is never stopped for it.
                ended = cursor.execute(
                    "UPDATE fleet_placements SET state = 'stopping', epoch = %s,"
                    " updated_at_ms = %s WHERE node = %s AND state <> 'stopping' RETURNING id",
                    (lease.epoch, now, node_id),
                ).fetchall()
                for (placement,) in ended:
                    self._event(
                        cursor,
                        now,
                        "stopping",
                        str(placement),
                        {"cause": f"node_{to}", "epoch": lease.epoch},
                    )
        return bool(moved)

    def place(
        self,
        lease: ControllerLease,
        decision: Mapping[str, Any],
        *,
        definition: Mapping[str, Any],
        reserved_state: str = "pending",
        avoid_ms: int | None = None,
    ) -> tuple[str, str]:
        """Record a start or replace decision as a placement and a ``fleet.place`` job;
        ``(placement_id, job_id)``. ``definition`` is the deployment's definition (the JSON
        of its ``DeploymentConfig``) the node runs for this placement; the decision's
        ``variant`` and ``estimate_basis`` are kept beside it.

        A replace whose ``cause`` is not ``node_gone`` (a stuck or failed placement moved
        off its node) also records, in the same transaction, that the deployment avoids
        ``from_node`` for ``avoid_ms`` (database time), with a ``stuck_replaced`` event,
        and marks the stuck placement ``stopping``: the move is one transaction.

        Raises:
            Deposed: the lease is no longer this controller's.
        """
        placement_id = str(ULID())
        with self._transaction() as cursor:
            now = self._fence(cursor, lease)
            job_id = self._job(
                cursor,
                now,
                kind="fleet.place",
                subject=f"deployment:{decision['deployment']}",
                node=lease.holder,
                body={**decision, "placement": placement_id, "epoch": lease.epoch},
            )
            cursor.execute(
                f"INSERT INTO fleet_placements ({_PLACEMENT_COLUMNS}, created_at_ms)"  # noqa: S608
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
                " %s)",
                (
                    placement_id,
                    decision["deployment"],
                    decision["replica"],
                    decision["revision"],
                    decision["node"],
                    json.dumps(list(decision["devices"])),
                    decision["engine"],
                    decision["reserved_bytes"],
                    reserved_state,
                    decision.get("replaces"),
                    json.dumps(dict(definition), sort_keys=True),
                    lease.epoch,
                    job_id,
                    now,
                    decision.get("variant"),
                    decision.get("estimate_basis"),
                    _workers_json(decision.get("workers")),
                    now,
                ),
            )
            cause = decision.get("cause")
            if decision.get("replaces") and cause not in (None, "node_gone"):
                self._avoid(cursor, now, lease, decision, avoid_ms or 0)
                # The move is one fenced transaction: the replacement and the stop of the
                # stuck one commit together, so a failed stop never leaves both current
                # (the next pass would stop the healthy replacement as a duplicate).
                stopped = cursor.execute(
                    "UPDATE fleet_placements SET state = 'stopping', epoch = %s,"
                    " updated_at_ms = %s WHERE id = %s AND state <> 'stopping'",
                    (lease.epoch, now, decision["replaces"]),
                ).rowcount
                if stopped:
                    self._event(
                        cursor,
                        now,
                        "stopping",
                        str(decision["replaces"]),
                        {"cause": "stuck", "epoch": lease.epoch},
                    )
            self._event(
                cursor,
                now,
                "replaced" if decision.get("replaces") else "placed",
                decision["deployment"],
                {"placement": placement_id, "node": decision["node"], "job_id": job_id},
            )
        return placement_id, job_id

    def _avoid(
        self,
        cursor: psycopg.Cursor[Any],
        now: int,
        lease: ControllerLease,
        decision: Mapping[str, Any],
        avoid_ms: int,
    ) -> None:
        deployment, node = decision["deployment"], decision["from_node"]
        cursor.execute("DELETE FROM fleet_avoid WHERE until_ms <= %s", (now,))
        cursor.execute(
            "INSERT INTO fleet_avoid (deployment, node, until_ms, reason, placement)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (deployment, node) DO UPDATE SET"
            " until_ms = EXCLUDED.until_ms, reason = EXCLUDED.reason,"
            " placement = EXCLUDED.placement",
            (deployment, node, now + avoid_ms, decision["cause"], decision["replaces"]),
        )
        self._event(
            cursor,
            now,
            "stuck_replaced",
            decision["replaces"],
            {
                "deployment": deployment,
                "node": node,
                "reason": decision["cause"],
                "avoid_until_ms": now + avoid_ms,
                "epoch": lease.epoch,
            },
        )

    def stop_placement(self, lease: ControllerLease, placement_id: str, *, cause: str) -> bool:
        """Mark a placement ``stopping`` (its node stops the engine and removes the row).

        Raises:
            Deposed: the lease is no longer this controller's.
        """
        with self._transaction() as cursor:
            now = self._fence(cursor, lease)
            moved = cursor.execute(
                "UPDATE fleet_placements SET state = 'stopping', epoch = %s, updated_at_ms = %s"
                " WHERE id = %s AND state <> 'stopping'",
                (lease.epoch, now, placement_id),
            ).rowcount
            if moved:
                self._event(
                    cursor, now, "stopping", placement_id, {"cause": cause, "epoch": lease.epoch}
                )
        return bool(moved)

    def prune_events(self, lease: ControllerLease, *, keep_ms: int, keep: int) -> int:
        """Delete fleet events older than ``keep_ms`` (database time) beyond the newest
        ``keep``; how many went. The controller's chore, fenced like its other writes.

        Raises:
            Deposed: the lease is no longer this controller's.
        """
        with self._transaction() as cursor:
            now = self._fence(cursor, lease)
            return int(
                cursor.execute(
                    "DELETE FROM fleet_events WHERE at_ms < %s AND seq < COALESCE("
                    " (SELECT seq FROM fleet_events ORDER BY seq DESC OFFSET %s LIMIT 1), 0)",
                    (now - keep_ms, max(0, keep - 1)),
                ).rowcount
            )

    def forget_placement(self, lease: ControllerLease, placement_id: str, *, why: str) -> bool:
        """Delete a placement of a gone node whose replica runs elsewhere now.

        Raises:
            Deposed: the lease is no longer this controller's.
        """
        with self._transaction() as cursor:
            now = self._fence(cursor, lease)
            gone = cursor.execute(
                "DELETE FROM fleet_placements WHERE id = %s", (placement_id,)
            ).rowcount
            if gone:
                self._event(cursor, now, "forgotten", placement_id, {"why": why})
        return bool(gone)

    # -- the node's own placements -----------------------------------------------------

    def placement_ready(self, node_id: str, placement_id: str) -> bool:
        """The node ``node_id`` reports its placement serving (``pending`` -> ``ready``)."""
        with self._transaction() as cursor:
            now = self._now(cursor)
            moved = cursor.execute(
                "UPDATE fleet_placements SET state = 'ready', updated_at_ms = %s"
                " WHERE id = %s AND node = %s AND state IN ('pending', 'starting')",
                (now, placement_id, node_id),
            ).rowcount
            if moved:
                self._event(cursor, now, "ready", placement_id, {"node": node_id})
        return bool(moved)

    def placement_stopped(self, node_id: str, placement_id: str) -> bool:
        """The node ``node_id`` stopped a ``stopping`` placement's engine: the row goes."""
        with self._transaction() as cursor:
            now = self._now(cursor)
            gone = cursor.execute(
                "DELETE FROM fleet_placements WHERE id = %s AND node = %s AND state = 'stopping'",
                (placement_id, node_id),
            ).rowcount
            if gone:
                self._event(cursor, now, "stopped", placement_id, {"node": node_id})
        return bool(gone)
