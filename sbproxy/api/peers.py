"""Peer dispatch: a gateway serves every deployment of the fleet, through a peer host when it
has no ready replica of its own (issue 20, "Peer dispatch"; ARCHITECTURE.md "Several hosts").

Where a request goes (:meth:`PeerDispatch.serves_here`), from the fleet's routing table
(:class:`~sbproxy.fleet.routing.RoutingTable`, a snapshot the directory keeps):

1. the replica placed on this node, when the table lists it ready (ready, or idle and
   loadable) or its engine runs here now: served here, as a single host serves it;
2. else the ready replica of a peer with the fewest outstanding requests -- the ``active`` and
   ``queued`` counts the replica last reported plus this gateway's own requests in flight to
   it, so that several gateways do not all pile onto one replica between two reports; ties
   take turns; a replica holding a request unanswered past the first-token limit last;
3. else 503 ``no_ready_replica`` (retryable). The gateway never starts a replica the table
   lists as not ready (its node may have fenced itself); the fleet starts placements.

A deployment the table does not list is not the fleet's: the host serves it as a single
host does.

Between hosts: the request goes to the peer's gateway with the same path, the client's own
body (the peer completes it for its engine, as for its own clients) and ``Host``, plus
``Authorization: Bearer <this node's own node credential>`` (or, before it has one and while
accepted, the deprecated shared ``proxy.model_host.fleet.credential``; never the admin
password, never logged; docs/cluster.md, "Admitting nodes"), ``X-Sbproxy-Peer-Hop: <this
node id>`` and ``X-Sbproxy-Peer-Priority: <the caller's class>``. A host receiving a hop
checks the
credential (401 ``peer_unauthorized`` otherwise), serves it only locally (never a second
hop; 503 ``no_ready_replica`` when rule 1 does not hold here), checks no key and no budget
and counts no usage: usage and budgets are counted once, on the host the client called, from
the answer the peer relays (a stream always carries its ``usage`` event between hosts; the
calling gateway drops it when its client had not asked for it). The client's bytes are the
peer's bytes: the answer's status, body and stream are relayed unchanged.

Retries: another replica is tried only while nothing has reached the client, and only for a
try that provably never reached an engine -- a hop is never sent twice, to one peer or to
two, since the peer's engine may be running it already (docs/cluster.md, "Retried only
before the first byte"):

* no connection opened (:data:`~sbproxy.api.engine_client.NOT_SENT`: refused, unreachable,
  the connect timeout): out of rotation (for ``peer_cooldown_ms`` on an injected monotonic
  clock, before membership notices), the next replica tried;
* the peer refused the fleet credential (401/403): out of rotation, the next replica tried;
  both sides log a warning naming the other node;
* the peer answered 429 or 503 (its queue is full, its replica cannot serve now), or 502
  with ``X-Sbproxy-Engine-Reached: no`` (its engine's port refused the connection: nothing
  ran): the next replica tried, when one is left; any other 502 (its engine may have run
  the request) is the client's answer;
* the connection failed after the request was sent (closed or reset before the answer's
  headers, a plain answer's body broken off): out of rotation, 502 ``upstream_unavailable``
  to the client, no other peer asked;
* no answer's headers within the hop's first-byte deadline -- the deployment's first-token
  limit for a stream (a peer sends a stream's headers with its first event), its request
  limit for a plain answer, each plus :data:`_MARGIN_S` so that the peer's own supervision,
  which knows the engine, speaks first: the peer is hung, out of rotation, and the request
  gets 504 ``engine_timeout`` (not sent elsewhere: it reached the peer).

Once a stream's headers went out, a peer that fails ends the stream with an
``upstream_unavailable`` error event, as an engine failing mid-stream does
(:mod:`sbproxy.api.relay`).

A hung replica is picked last (:meth:`PeerDispatch.pick`): one whose oldest request from this
gateway has had no answer's headers for longer than the deployment's first-token limit ranks
after every other candidate, whatever its count.

Spill-over (:meth:`sbproxy.api.gateway.Gateway.forward_to_peer`): a client's request that
this host's own replica refuses before any byte reached the client -- any admission refusal
(``queue_full``, ``queue_timeout``, ``crash_loop``, ``engine_unhealthy``, ``draining``,
``insufficient_capacity``) or an engine that failed before its answer
(``upstream_unavailable``) -- goes to the best ready peer replica by the rules above; with
none, the host's own refusal is the answer. A hop never spills (it is served here or
refused), so a request crosses at most one hop.

Idle replicas: a replica the table lists ``ready`` but not ``loaded`` (keep-alive stopped
its engine) is picked only when no loaded one is ready; its node loads it for the hop, as
for a request of its own client.

Trace context (:func:`trace_context`): a hop carries the W3C ``traceparent`` and
``tracestate`` of the calling host's request span (OpenTelemetry's propagator writes them),
so the peer's server span is a child of it in the same trace.

Metrics (:func:`sbproxy.api.metrics.build_registry`):
``sbproxy_gateway_peer_requests_total{deployment,node,outcome}`` -- each try at a peer, by
:class:`PeerOutcome` --, ``sbproxy_gateway_peer_spills_total{deployment,reason}`` and
``sbproxy_gateway_peers_out_of_rotation`` (gauge). Each answer a peer served names its node
(``x-sbproxy-peer-node``, and ``x-sbproxy-spilled: <code>`` after a spill-over), as do the
access-log line and the request span (``sbproxy.peer.node``, ``sbproxy.peer.spilled``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import aiohttp
from litestar.types import Receive, Scope
from opentelemetry import propagate, trace
from yarl import URL

from sbproxy.api import engine_client
from sbproxy.api.errors import ENGINE_REACHED_HEADER, ApiError
from sbproxy.api.keys import Caller
from sbproxy.api.relay import UpstreamUnavailable
from sbproxy.api.supervision import ExchangeBound, Limit, engine_timeout
from sbproxy.api.wake import ColdWake
from sbproxy.config import DeploymentConfig, PriorityClass
from sbproxy.fleet.admission import PeerAdmission, PeerCheck
from sbproxy.fleet.routing import FleetDirectory, PeerReplica, RoutingTable
from sbproxy.telemetry import ATTR_DEPLOYMENT, ATTR_PEER_NODE, enabled, tracer

__all__ = [
    "PEER_HOP",
    "PEER_PRIORITY",
    "LoneDirectory",
    "NoReadyReplica",
    "PeerAnswer",
    "PeerDispatch",
    "PeerOutcome",
    "PeerTicket",
    "PeerUnauthorized",
    "peer_headers",
    "trace_context",
]

logger = logging.getLogger(__name__)

PEER_HOP: Final = "X-Sbproxy-Peer-Hop"
PEER_PRIORITY: Final = "X-Sbproxy-Peer-Priority"
_HOP: Final = PEER_HOP.lower().encode()
_PRIORITY: Final = PEER_PRIORITY.lower().encode()
# Peer answers that leave the client untouched and are worth another replica: 429 is a full
# queue there (a hop is checked against no key, budget or rate), 503 a replica that cannot
# serve now; a 502 only when it says its engine was not reached (``_refused``).
_REFUSALS: Final = frozenset({429, 503})
# A peer that refuses this host's fleet credential (its 401 peer_unauthorized; 403 from
# anything in front of it) refused before any engine saw the request: the next replica is
# tried, and the client never sees the fleet's own credential problem.
_CREDENTIAL_REFUSALS: Final = frozenset({401, 403})
# The calling gateway's limits on a peer exceed the deployment's own by this much, so that
# the peer's supervision (which knows the engine) speaks first.
_MARGIN_S: Final = 1.0
_DEFAULTS: Final = (300.0, 120.0, 30.0)
_PRIORITIES: Final = {p.value: p for p in PriorityClass}
_TRACE_HEADERS: Final = frozenset({b"traceparent", b"tracestate"})


class PeerUnauthorized(ApiError):
    """A peer hop without the fleet's credential (``peer_unauthorized``, HTTP 401)."""

    default_code = "peer_unauthorized"


class NoReadyReplica(ApiError):
    """No replica of the deployment can take the request anywhere in the fleet
    (``no_ready_replica``, HTTP 503, retryable)."""

    default_code = "no_ready_replica"
    default_retryable = True


class PeerOutcome(StrEnum):
    """How one try at a peer ended (the ``outcome`` label of
    ``sbproxy_gateway_peer_requests_total``)."""

    ANSWERED = "answered"  # its answer (any status) or its whole stream went to the client
    REFUSED = "refused"  # 429/502/503 before any byte reached the client; the next one tried
    UNAUTHORIZED = "unauthorized"  # refused the fleet credential (401/403); out of rotation
    UNREACHABLE = "unreachable"  # no connection opened: nothing sent; out of rotation
    LOST = "lost"  # the request sent, no whole answer (never sent again); out of rotation
    CUT = "cut"  # its stream failed after the first byte reached the client
    TIMED_OUT = "timed_out"  # a limit ran out waiting for it (before its answer: out of rotation)
    CLIENT_GONE = "client_gone"  # the client went away first


class LoneDirectory:
    """The routing table of a host that takes peer hops but knows no peer (a fleet credential
    and no fleet directory): every deployment is served here, as on a single host."""

    def __init__(self, node_id: str) -> None:
        self._table = RoutingTable(local_node_id=node_id, replicas={}, taken_at=time.monotonic())

    def routing(self) -> RoutingTable:
        """The empty table."""
        return self._table


def peer_headers(scope: Scope) -> tuple[str | None, str | None]:
    """The ``X-Sbproxy-Peer-Hop`` and ``X-Sbproxy-Peer-Priority`` values of a request (read
    only when a fleet is configured: a single host never looks)."""
    hop: str | None = None
    priority: str | None = None
    for name, value in scope["headers"]:
        if name == _HOP:
            hop = value.decode("latin-1")
        elif name == _PRIORITY:
            priority = value.decode("latin-1")
    return hop, priority


def trace_context(scope: Scope) -> dict[str, str]:
    """The W3C trace-context headers (``traceparent``, ``tracestate``) a hop carries, written
    by OpenTelemetry's configured propagator: the calling host's current span when it traces
    (the peer's server span is then its child); else the client's own trace context passed
    on, so that a peer that traces still joins the client's trace; empty when there is
    neither."""
    carrier: dict[str, str] = {}
    if enabled():
        propagate.inject(carrier)
        return carrier
    incoming = {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name in _TRACE_HEADERS
    }
    if incoming:
        propagate.inject(carrier, context=propagate.extract(incoming))
    return carrier


@dataclass(slots=True)
class _Flight:
    """When each of this gateway's requests to one replica that has no answer headers yet
    was sent (the dispatch clock's seconds, by ticket serial), and the deployment's own
    first-token limit (seconds) -- what :meth:`PeerDispatch.pick` reads to rank last a
    replica whose oldest unanswered request has waited past that limit."""

    sent: dict[int, float] = field(default_factory=dict)
    first_token_s: float = _DEFAULTS[1]

    def overdue(self, now: float) -> bool:
        """Whether the oldest unanswered request was sent more than ``first_token_s`` ago."""
        return bool(self.sent) and now - min(self.sent.values()) > self.first_token_s


@dataclass(slots=True)
class PeerTicket:
    """One request in flight to a peer replica: counted in this gateway's outstanding count of
    that replica until :meth:`release`; the limits the relay applies to it (seconds)."""

    deployment: str
    node_id: str
    request_timeout_s: float
    first_token_timeout_s: float
    stall_timeout_s: float
    _in_flight: Counter[tuple[str, str]] = field(repr=False)
    _flight: _Flight = field(repr=False, default_factory=_Flight)
    _serial: int = 0
    _released: bool = False

    def report(self, *, timed_out: bool) -> None:
        """Nothing to tell: the peer's own runtime counts its engine's outcomes."""

    def answered(self) -> None:
        """The peer's answer headers arrived (for a stream: with its first event): no longer
        a request that may be hung, though still in flight while its stream lasts."""
        self._flight.sent.pop(self._serial, None)

    def release(self) -> None:
        """No longer in flight (idempotent)."""
        if not self._released:
            self._released = True
            self._in_flight[(self.node_id, self.deployment)] -= 1
            self._flight.sent.pop(self._serial, None)


@dataclass(slots=True)
class PeerAnswer:
    """A peer's answer: whole (``data``), or a stream to relay (``data`` is ``None``)."""

    replica: PeerReplica
    ticket: PeerTicket
    response: aiohttp.ClientResponse
    started: float
    data: bytes | None


class PeerDispatch:
    """This gateway's side of peer dispatch (see the module docstring).

    One instance per gateway, used on its event loop only: the in-flight counts, the
    rotation and the tallies are its own state.

    Args:
        directory: The fleet's routing table.
        credential: The shared fleet credential (deprecated); ``None``: only node credentials.
        cooldown_s: How long a failed peer stays out of rotation.
        clock: Monotonic seconds (injected by tests).
        admission: The fleet's node credentials (the agent): hops are sent with this node's
            own credential and checked against the calling node's; a revoked or removed
            member is refused whatever it presents. ``None``: the shared credential only.
        accept_shared: Whether the shared credential is still accepted and sent (the
            migration path, ``proxy.model_host.fleet.accept_shared_credential``).
    """

    def __init__(
        self,
        directory: FleetDirectory,
        *,
        credential: str | None,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        admission: PeerAdmission | None = None,
        accept_shared: bool = True,
    ) -> None:
        self.directory = directory
        self.clock = clock
        self.admission = admission
        self.configure(credential=credential, cooldown_s=cooldown_s, accept_shared=accept_shared)
        self._in_flight: Counter[tuple[str, str]] = Counter()
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._serial = 0
        self._out: dict[str, float] = {}
        self._turn = 0
        self.tries: Counter[tuple[str, str, str]] = Counter()
        """Tries at peers by ``(deployment, node, outcome)``."""
        self.cold: ColdWake | None = None
        """Scale from zero (:mod:`sbproxy.api.wake`), on a host of a fleet."""
        self.spills: Counter[tuple[str, str]] = Counter()
        """Requests this host's own replica refused before any byte reached the client and
        that went to a peer instead (spill-over), by ``(deployment, refusal code)``."""
        self.prefix_routes: Counter[tuple[str, str]] = Counter()
        """Client requests of ``routing: prefix`` deployments, by ``(deployment, outcome)``
        (:mod:`sbproxy.api.prefix_route`)."""

    def configure(
        self, *, credential: str | None, cooldown_s: float, accept_shared: bool = True
    ) -> None:
        """Take a (reloaded) shared credential, its switch and cool-down; rotation and counts
        stay."""
        self.cooldown_s = cooldown_s
        shared = credential if accept_shared else None
        self._digest = hashlib.sha256(shared.encode()).digest() if shared is not None else None
        self._shared = f"Bearer {shared}" if shared is not None else None

    @property
    def _authorization(self) -> str | None:
        """What this host presents to a peer: its own node credential once it has one, else
        the shared credential (while accepted)."""
        own = self.admission.node_secret() if self.admission is not None else None
        return f"Bearer {own}" if own is not None else self._shared

    def _peer_admitted(self, scheme: str, token: str, node: str) -> bool:
        """Whether a hop's bearer ``token`` admits calling ``node``: its own node credential,
        else -- unless the node is revoked or removed -- the shared credential."""
        if scheme.lower() != "bearer" or not token:
            return False
        check = (
            self.admission.check_peer(node, token)
            if self.admission is not None
            else PeerCheck.UNKNOWN
        )
        if check is not PeerCheck.UNKNOWN:
            return check is PeerCheck.VALID
        presented = hashlib.sha256(token.encode()).digest()
        return self._digest is not None and hmac.compare_digest(presented, self._digest)

    # -- the receiving side ------------------------------------------------------------------

    def admit_hop(
        self, authorization: str | None, priority: str | None, *, node: str = "?"
    ) -> Caller:
        """The caller of a peer hop carrying this ``Authorization`` header: nameless (no key,
        no budget, no usage here), with the class the calling gateway gave; ``node``: the
        calling node, as its ``X-Sbproxy-Peer-Hop`` names it (a refusal's warning names it:
        one of the two hosts has the wrong credential, and the caller names this one in its
        own warning; the credential itself is never logged).

        Raises:
            PeerUnauthorized: ``peer_unauthorized`` -- neither the calling node's own node
                credential (checked against the fleet's record; a revoked or removed member
                is refused whatever it presents) nor the shared fleet credential while it is
                accepted.
        """
        scheme, _, token = (authorization or "").partition(" ")
        if not self._peer_admitted(scheme, token.strip(), node):
            logger.warning(
                "refused a peer hop from node %r: %s",
                node,
                "it is not a member this host admits (revoked, removed, or unknown yet), and "
                "this host takes no shared fleet credential"
                if self._digest is None
                else "it carries neither its own node credential nor this host's shared fleet "
                "credential (proxy.model_host.fleet.credential)",
            )
            raise PeerUnauthorized(
                "a peer hop needs the fleet credential (proxy.model_host.fleet.credential) "
                "as Authorization: Bearer",
                remediation="Give every host of the fleet the same fleet credential.",
            )
        return Caller(name=None, priority=_PRIORITIES.get(priority or "", PriorityClass.STANDARD))

    # -- the calling side --------------------------------------------------------------------

    def serves_here(self, deployment: str, *, known: bool, running: Callable[[], bool]) -> bool:
        """Whether this node serves a request for ``deployment`` itself (rule 1 of the
        module docstring).

        A deployment the table does not list is not the fleet's: this host serves it as a
        single host would, when its runtime has it (``known``). One the table lists is
        served here only from the replicas placed here (listed under this node), when the
        table says one is ready or an engine of one runs here now (``running``: the table
        lags a load by up to a heartbeat). Never otherwise: a replica the table lists as not
        ready may be on a node that fenced itself, whose engines must stay stopped.
        """
        table = self.directory.routing()
        replicas = table.for_deployment(deployment)
        if not replicas:
            return known
        local = [r for r in replicas if r.node_id == table.local_node_id]
        return bool(local) and known and (any(r.ready for r in local) or running())

    def local_replicas(self, deployment: str) -> tuple[str, ...]:
        """The runtime ids of this node's replicas of ``deployment`` the table lists
        (``chat``, ``chat.r1``: :func:`~sbproxy.fleet.routing.replica_deployment_id`), in
        replica order; empty when it lists none here."""
        table = self.directory.routing()
        local = table.local_node_id
        return tuple(
            sorted(
                {r.runtime_id for r in table.for_deployment(deployment) if r.node_id == local},
                key=lambda i: (len(i), i),
            )
        )

    def availability(
        self, deployment: str, *, local: dict[str, object] | None
    ) -> dict[str, object]:
        """What ``/v1/models`` says of ``deployment`` on a host of a fleet:
        ``{state: ready|cold|unavailable, ready_replicas, desired_replicas}`` over the
        replicas the table lists: ``ready`` when a loaded one can take requests (here, or a
        peer's in this gateway's rotation), else ``cold`` when an idle one can be loaded by a
        request (as a single host's idle deployment shows); ``ready_replicas`` counts the
        loaded ones. ``local`` (this host's own availability, ``None`` when it lacks the
        deployment) for one the table does not list."""
        table = self.directory.routing()
        replicas = table.for_deployment(deployment)
        if not replicas:
            return local or {"state": "unavailable", "ready_replicas": 0, "desired_replicas": 0}
        now = self.clock()
        usable = [
            r
            for r in replicas
            if r.ready and (r.node_id == table.local_node_id or self._in_rotation(r.node_id, now))
        ]
        ready = sum(r.loaded for r in usable)
        state = "ready" if ready else ("cold" if usable else "unavailable")
        return {"state": state, "ready_replicas": ready, "desired_replicas": len(replicas)}

    def pick(self, deployment: str, tried: set[str]) -> PeerReplica | None:
        """The ready peer replica of ``deployment`` with the fewest outstanding requests,
        among those in rotation and not in ``tried`` (node ids) -- a loaded one before any
        idle one (which its node has to load first), and after every other one a replica
        whose oldest request from this gateway has had no answer's headers for longer than
        the deployment's first-token limit (probably hung); ``None`` when none is left."""
        table = self.directory.routing()
        local = table.local_node_id
        now = self.clock()
        best: list[PeerReplica] = []
        fewest = (0, 0, 0)
        for replica in table.for_deployment(deployment):
            node = replica.node_id
            if node == local or not replica.ready or not replica.base_url or node in tried:
                continue  # a node that advertises no URL cannot be reached
            if not self._in_rotation(node, now):
                continue
            outstanding = replica.active + replica.queued + self._in_flight[(node, deployment)]
            flight = self._flights.get((node, deployment))
            # A replica that has left one of this gateway's requests unanswered past the
            # first-token limit is probably hung: every other candidate goes first, however
            # busy (its low count is what drew requests to it).
            overdue = flight is not None and flight.overdue(now)
            rank = (1 if overdue else 0, 0 if replica.loaded else 1, outstanding)
            if not best or rank < fewest:
                best, fewest = [replica], rank
            elif rank == fewest:
                best.append(replica)
        if not best:
            return None
        self._turn += 1
        return best[self._turn % len(best)]

    def outstanding(self, replica: PeerReplica) -> int | None:
        """A peer's replica's requests in flight and queued as it last reported them, plus
        this gateway's own in flight to it; ``None`` when it cannot take a request from
        here (not ready, no URL, out of rotation)."""
        node = replica.node_id
        if not replica.ready or not replica.base_url or not self._in_rotation(node, self.clock()):
            return None
        return replica.active + replica.queued + self._in_flight[(node, replica.deployment)]

    def _in_rotation(self, node_id: str, now: float) -> bool:
        until = self._out.get(node_id)
        if until is None:
            return True
        if now >= until:
            del self._out[node_id]
            logger.info("peer %s is back in rotation", node_id)
            return True
        return False

    def out_of_rotation(self, replica: PeerReplica, why: str) -> None:
        """Take ``replica``'s node out of this gateway's rotation for ``cooldown_s``."""
        self._out[replica.node_id] = self.clock() + self.cooldown_s
        logger.warning(
            "peer %s (%s) failed before its answer (%s): out of rotation for %g s",
            replica.node_id,
            replica.base_url,
            why,
            self.cooldown_s,
        )

    def out_now(self) -> list[str]:
        """The node ids out of rotation now, sorted."""
        now = self.clock()
        return sorted(node for node in list(self._out) if not self._in_rotation(node, now))

    def in_flight(self, node_id: str, deployment: str) -> int:
        """This gateway's requests in flight to ``deployment`` on ``node_id``."""
        return self._in_flight[(node_id, deployment)]

    def record(self, replica: PeerReplica, outcome: PeerOutcome) -> None:
        """Count one try at ``replica``."""
        self.tries[(replica.deployment, replica.node_id, outcome.value)] += 1

    def _ticket(self, replica: PeerReplica, config: DeploymentConfig | None) -> PeerTicket:
        if config is None:
            request_s, first_s, stall_s = _DEFAULTS
        else:
            request_s = config.request_timeout_ms / 1000
            first_s = config.first_token_timeout_ms / 1000
            stall_s = config.stall_timeout_ms / 1000
        key = (replica.node_id, replica.deployment)
        self._in_flight[key] += 1
        flight = self._flights.setdefault(key, _Flight())
        flight.first_token_s = first_s
        self._serial += 1
        flight.sent[self._serial] = self.clock()
        return PeerTicket(
            deployment=replica.deployment,
            node_id=replica.node_id,
            request_timeout_s=request_s + _MARGIN_S,
            first_token_timeout_s=first_s + _MARGIN_S,
            stall_timeout_s=stall_s + _MARGIN_S,
            _in_flight=self._in_flight,
            _flight=flight,
            _serial=self._serial,
        )

    def _headers(self, caller: Caller, host: str | None) -> dict[str, str]:
        assert self._authorization is not None  # noqa: S101 - checked by dispatch
        headers = {
            "Authorization": self._authorization,
            PEER_HOP: self.directory.routing().local_node_id,
            PEER_PRIORITY: caller.priority.value,
        }
        if host is not None:
            headers["Host"] = host
        return headers

    async def dispatch(
        self,
        session: aiohttp.ClientSession,
        receive: Receive,
        *,
        deployment: str,
        config: DeploymentConfig | None,
        caller: Caller,
        host: str | None,
        path: str,
        body: bytes,
        streamed: bool,
        carrier: Mapping[str, str] | None = None,
        prefer: PeerReplica | None = None,
    ) -> PeerAnswer | None:
        """Send one request to the best peer replica of ``deployment``, and to the next while
        nothing has reached the client (see the module docstring); ``carrier``: the trace
        context headers to send along (:func:`trace_context`); ``prefer``: the replica to try
        first (prefix routing's choice), the others after it by least outstanding.

        A plain answer comes back read whole (its ticket released); a stream with its
        headers read, for the relay to finish (it releases the ticket).

        Returns:
            The answer; ``None`` when the client went away first (everything is freed).

        Raises:
            NoReadyReplica: ``no_ready_replica`` -- no peer replica to try (or no fleet
                credential to reach one with).
            UpstreamUnavailable: ``upstream_unavailable`` -- every replica tried failed, or
                one failed after the request was sent (it is not sent to another).
            EngineTimeout: ``engine_timeout`` -- the deployment's limit ran out first.
        """
        if self._authorization is None:
            raise NoReadyReplica(
                f"deployment {deployment!r} has no replica on this node, and this host has no "
                "fleet credential to reach a peer's",
                remediation="Set proxy.model_host.fleet.credential on every host.",
                details={"deployment": deployment},
            )
        headers = self._headers(caller, host)
        if carrier:
            headers.update(carrier)
        bound = ExchangeBound(receive)
        tried: set[str] = set()
        failed = False
        answer: PeerAnswer | None = None
        current: PeerReplica | None = None
        limit, limit_s = Limit.REQUEST, 0.0
        with bound:
            replica = prefer if prefer is not None else self.pick(deployment, tried)
            while replica is not None:
                tried.add(replica.node_id)
                ticket = self._ticket(replica, config)
                if len(tried) == 1:  # one deadline for every try
                    limit, limit_s = _first_limit(ticket, streamed=streamed)
                    bound.set_deadline(asyncio.get_running_loop().time() + limit_s)
                current = replica
                answer = await self._try(session, replica, ticket, headers, path, body, streamed)
                current = None
                if answer is not None and _unauthorized(answer):
                    self._credential_refused(answer)
                    answer = None
                if answer is None:
                    failed = True
                    replica = self.pick(deployment, tried)
                    continue
                replica = self.pick(deployment, tried) if _refused(answer) else None
                if replica is not None:
                    self.record(answer.replica, PeerOutcome.REFUSED)
                    answer.ticket.release()
                    answer = None
        if bound.cancelled_caught:
            self._cut_short(answer, current, bound, deployment, limit, limit_s)
            return None
        if answer is not None:
            if answer.data is not None:
                self.record(answer.replica, PeerOutcome.ANSWERED)
                answer.ticket.release()
            return answer
        if not failed:
            raise NoReadyReplica(
                f"no replica of deployment {deployment!r} is ready in the fleet",
                remediation="Check the fleet's placements: `sbproxy models ps --fleet`.",
                details={"deployment": deployment, "retry_after_ms": 1000},
            )
        raise UpstreamUnavailable(
            f"no replica of deployment {deployment!r} answered (tried {len(tried)} peer(s))",
            details={"deployment": deployment},
        )

    def _credential_refused(self, answer: PeerAnswer) -> None:
        """A peer refused this host's fleet credential (401/403) before anything reached an
        engine: out of rotation, named in a warning (one of the two hosts has the wrong
        credential; the peer names this node in its own), and the next replica tried."""
        replica, status = answer.replica, answer.response.status
        self.record(replica, PeerOutcome.UNAUTHORIZED)
        answer.ticket.release()
        self._out[replica.node_id] = self.clock() + self.cooldown_s
        logger.warning(
            "peer %s (%s) refused this host's fleet credential (HTTP %d): out of rotation for "
            "%g s; this node may be revoked or not yet known there, or the hosts' shared "
            "proxy.model_host.fleet.credential differ",
            replica.node_id,
            replica.base_url,
            status,
            self.cooldown_s,
        )

    def _cut_short(
        self,
        answer: PeerAnswer | None,
        current: PeerReplica | None,
        bound: ExchangeBound,
        deployment: str,
        limit: Limit,
        limit_s: float,
    ) -> None:
        """End a dispatch its client left, or whose limit ran out, before the answer was
        handed on (``current``: the replica being tried then). A peer that let the limit
        run out -- longer than its own supervision allows the engine -- is hung: out of
        rotation.

        Raises:
            EngineTimeout: ``engine_timeout`` when the limit ran out.
        """
        if answer is not None:
            answer.response.close()
            answer.ticket.release()
        if bound.disconnected:
            if current is not None:
                self.record(current, PeerOutcome.CLIENT_GONE)
            return
        if current is not None:
            self.record(current, PeerOutcome.TIMED_OUT)
            self.out_of_rotation(current, f"no answer within {limit.value}")
        raise engine_timeout(deployment, limit, limit_s)

    async def _try(
        self,
        session: aiohttp.ClientSession,
        replica: PeerReplica,
        ticket: PeerTicket,
        headers: dict[str, str],
        path: str,
        body: bytes,
        streamed: bool,
    ) -> PeerAnswer | None:
        """One try at ``replica``; ``None`` (the peer out of rotation) when it failed before
        its answer was in hand. When this host traces, the try is a client span
        (:func:`_hop_span`) and the hop carries that span's context, so the peer's server
        span is its child."""
        response: aiohttp.ClientResponse | None = None
        started = asyncio.get_running_loop().time()
        url = URL(replica.base_url.rstrip("/") + path)
        with _hop_span(replica, path) as span:
            if span is not None:
                headers = dict(headers)
                propagate.inject(headers)
            try:
                # Sent once (resend=False): a hop that failed after its bytes left may be
                # running at the peer's engine already.
                response = await engine_client.post(
                    session, url, body, headers=headers, resend=False
                )
                ticket.answered()
                data: bytes | None = None
                if not (streamed and response.content_type == "text/event-stream"):
                    data = await response.read()
                    response.release()
            except aiohttp.ClientError as exc:
                if response is not None:
                    response.close()
                ticket.release()
                why = type(exc).__name__
                if span is not None:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, why))
                if isinstance(exc, engine_client.NOT_SENT):
                    self.out_of_rotation(replica, why)
                    self.record(replica, PeerOutcome.UNREACHABLE)
                    return None
                self.out_of_rotation(replica, f"{why} after the request was sent")
                self.record(replica, PeerOutcome.LOST)
                raise _lost(replica, why, answered=response is not None) from None
            except BaseException:  # a cancellation: the deadline or the client (the caller knows)
                if response is not None:
                    response.close()
                ticket.release()
                raise
            if span is not None:
                span.set_attribute("http.response.status_code", response.status)
        return PeerAnswer(
            replica=replica, ticket=ticket, response=response, started=started, data=data
        )


@contextmanager
def _hop_span(replica: PeerReplica, path: str) -> Iterator[trace.Span | None]:
    """A client span ``peer hop`` around one try at ``replica`` (its node, the deployment;
    the caller adds the answer's status, or an error status when the peer was unreachable)
    from the send until the answer -- a stream's headers -- is in hand; ``None`` when this
    host does not trace."""
    if not enabled():
        yield None
        return
    attributes = {
        ATTR_PEER_NODE: replica.node_id,
        ATTR_DEPLOYMENT: replica.deployment,
        "http.request.method": "POST",
        "url.path": path,
    }
    with tracer().start_as_current_span(
        "peer hop", kind=trace.SpanKind.CLIENT, attributes=attributes
    ) as span:
        yield span


def _lost(replica: PeerReplica, why: str, *, answered: bool) -> UpstreamUnavailable:
    """The error for a hop that failed after its request was sent (``answered``: after the
    answer's headers): it is not sent to another peer, whose engine would run it a second
    time if this one's did."""
    when = "while its answer was read" if answered else "before its answer's headers"
    return UpstreamUnavailable(
        f"peer {replica.node_id} of deployment {replica.deployment!r} failed {when} ({why}); "
        "the request had reached it, so it was not sent to another replica (its engine may "
        "have run it)",
        remediation="Retry the request; check the peer's log and `sbproxy fleet nodes`.",
        details={"deployment": replica.deployment, "peer_node": replica.node_id},
    )


def _unauthorized(answer: PeerAnswer) -> bool:
    return answer.data is not None and answer.response.status in _CREDENTIAL_REFUSALS


def _refused(answer: PeerAnswer) -> bool:
    """A peer's answer that is worth another replica: 429 or 503 (refused before its
    engine), or a 502 that says its engine was not reached (issue 30, item 25); any other
    502 may have run the generation there, and is the client's answer."""
    if answer.data is None:
        return False
    status = answer.response.status
    if status == 502:
        return answer.response.headers.get(ENGINE_REACHED_HEADER, "").lower() == "no"
    return status in _REFUSALS


def _first_limit(ticket: PeerTicket, *, streamed: bool) -> tuple[Limit, float]:
    if streamed and ticket.first_token_timeout_s < ticket.request_timeout_s:
        return Limit.FIRST_TOKEN, ticket.first_token_timeout_s
    return Limit.REQUEST, ticket.request_timeout_s
