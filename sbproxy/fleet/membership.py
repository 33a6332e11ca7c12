"""Fleet membership as data: node states, their transition table, and the pure rules that
derive a node's state from its lease and decide when a node fences itself.

Nothing here reads a clock or a database. Callers pass times in milliseconds:

* **database time** (``clock_timestamp()`` of the shared PostgreSQL, as epoch milliseconds)
  for a node's last renewal and for "now" when another host judges it -- every host reads
  the same clock, so no host's own clock drift can make a healthy node look lost
  (ARCHITECTURE.md "Several hosts");
* **the node's own monotonic clock** for self-fencing, because a node that cannot reach the
  database cannot read database time either.

States (issue 20, "Membership"):

* ``ready`` -- renewing on time, takes new replicas;
* ``suspect`` -- a renewal is late (more than 1.5 heartbeat periods since the last one);
  keeps its replicas, takes no new ones;
* ``lost`` -- no renewal for ``lost_after_ms``; its replicas are re-placed elsewhere;
* ``leaving`` -- it stopped gracefully and said so: out of rotation at once, keeps its
  placements for ``rejoin_grace_ms`` (a restart), then ``lost``;
* ``cordoned`` -- an operator said "no new replicas here"; keeps the ones it has;
* ``draining`` -- cordoned, and its replicas are moved elsewhere (start there first);
* ``left`` -- removed from the fleet; terminal (a host that comes back joins afresh).

Precedence when several apply: ``left`` > ``lost`` > ``leaving`` > ``suspect`` > ``draining`` >
``cordoned`` > ``ready``. Liveness beats an operator flag: a cordoned or draining node that
stops renewing is ``suspect`` (its replicas unreachable) and then ``lost``, whatever its
flags, which stay recorded on its row (issue 30, item 6).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from sbproxy.config import FleetConfig, fence_bound_ms, peer_ask_timeout_ms
from sbproxy.errors import SbproxyError

__all__ = [
    "IDLE",
    "LIVE_STATES",
    "NODE_TRANSITIONS",
    "SUSPECT_AFTER_HEARTBEATS",
    "TERMINAL_NODE_STATES",
    "UNREACHABLE",
    "FenceVerdict",
    "FleetTiming",
    "IllegalNodeTransition",
    "NodeState",
    "NodeTransition",
    "PeerAnswer",
    "derive_state",
    "fence_verdict",
    "idle_loadable",
    "move",
    "replica_state",
]


class NodeState(StrEnum):
    """Where one member of the fleet is (see the module docstring)."""

    READY = "ready"
    SUSPECT = "suspect"
    LOST = "lost"
    LEAVING = "leaving"
    CORDONED = "cordoned"
    DRAINING = "draining"
    LEFT = "left"


_S = NodeState
TERMINAL_NODE_STATES: Final = frozenset({_S.LEFT})
LIVE_STATES: Final = frozenset({_S.READY, _S.SUSPECT, _S.CORDONED, _S.DRAINING})
"""Members that still serve their cache to peers (a cordoned or draining node keeps serving
it; a suspect one may be slow): where an artifact counts as cached, and whom a pull asks."""
"""States no move leaves."""

UNREACHABLE: Final = "unreachable"
"""A replica's shown state when its node is suspect, lost or has left: what the node last
reported is history, and no gateway routes to that replica now."""


IDLE: Final = "idle"
"""A replica's shown state when keep-alive stopped its engine: not running, and loaded again
by the first request for it (its own client's, or a peer's hop) -- not ``ready``, not
``unreachable``."""

_KEEP_ALIVE: Final = "keep_alive"
_UNREACHABLE_STATES: Final = frozenset(
    {
        *(_S.SUSPECT, _S.LEAVING, _S.LOST, _S.LEFT),
        *(x.value for x in (_S.SUSPECT, _S.LEAVING, _S.LOST, _S.LEFT)),
    }
)


def idle_loadable(reported: Mapping[str, object]) -> bool:
    """Whether a node's report of one replica (``{state, reason_code, ...}`` as it renews)
    says keep-alive stopped it: a request loads it again, as on a single host."""
    return reported.get("state") == "stopped" and reported.get("reason_code") == _KEEP_ALIVE


def replica_state(
    node_state: NodeState | str | None,
    reported: str | None,
    *,
    reason_code: str | None = None,
) -> str | None:
    """The state to show for a replica whose node is in ``node_state`` and last reported
    ``reported`` (``None``: nothing yet) with ``reason_code``: :data:`UNREACHABLE` on a
    suspect, lost or departed node (no gateway routes there), :data:`IDLE` for one
    keep-alive stopped (:func:`idle_loadable`), else the report."""
    if node_state in _UNREACHABLE_STATES:
        return UNREACHABLE
    if idle_loadable({"state": reported, "reason_code": reason_code}):
        return IDLE
    return reported


_ALIVE = frozenset({_S.READY, _S.SUSPECT, _S.CORDONED, _S.DRAINING})
NODE_TRANSITIONS: Final[Mapping[NodeState, frozenset[NodeState]]] = MappingProxyType(
    {
        # Observations are sparse (one per controller pass), so a live node may be seen
        # to skip ``suspect`` and go straight to ``lost``; any live node may say it leaves.
        _S.READY: frozenset({_S.SUSPECT, _S.LOST, _S.LEAVING, _S.CORDONED, _S.DRAINING, _S.LEFT}),
        _S.SUSPECT: frozenset({_S.READY, _S.LOST, _S.LEAVING, _S.CORDONED, _S.DRAINING, _S.LEFT}),
        _S.CORDONED: frozenset({_S.READY, _S.SUSPECT, _S.LOST, _S.LEAVING, _S.DRAINING, _S.LEFT}),
        # A finished drain leaves the node cordoned (no replicas, takes none).
        _S.DRAINING: frozenset({_S.READY, _S.SUSPECT, _S.LOST, _S.LEAVING, _S.CORDONED, _S.LEFT}),
        # A leaving node restarted within its grace is live again; else it is lost.
        _S.LEAVING: _ALIVE | {_S.LOST, _S.LEFT},
        # A lost node rejoins by renewing: ready, or its operator flags; a single renewal
        # followed by silence again is seen as suspect.
        _S.LOST: frozenset({_S.READY, _S.SUSPECT, _S.LEAVING, _S.CORDONED, _S.DRAINING, _S.LEFT}),
        _S.LEFT: frozenset(),
    }
)
"""Allowed moves: ``NODE_TRANSITIONS[from]`` is the set of states ``from`` may move to.

A move to the same state is not a move (nothing to record); :func:`move` refuses it.
"""

SUSPECT_AFTER_HEARTBEATS: Final = 1.5
"""A node is ``suspect`` once this many heartbeat periods passed since its last renewal.

Half a period of slack keeps scheduling and network delay of a healthy node from making
it flap; past it, the renewal that was due has been missed.
"""


class IllegalNodeTransition(SbproxyError):
    """A node state change the table forbids (code ``illegal_transition``).

    A bug in the caller (or a stale read), never an operator error. ``details`` carries
    ``from_state`` and ``to_state``.
    """

    default_code = "illegal_transition"


@dataclass(frozen=True, slots=True)
class NodeTransition:
    """One checked move of a node's state, made only by :func:`move`.

    Attributes:
        from_state: The state the caller expected the node to be in (a compare-and-set
            write uses it in its ``WHERE state = ?``).
        to_state: The new state.
    """

    from_state: NodeState
    to_state: NodeState

    def to_dict(self) -> dict[str, str]:
        """``{"from", "to"}`` for an event or a log line."""
        return {"from": self.from_state.value, "to": self.to_state.value}


def move(expected: NodeState, to: NodeState) -> NodeTransition:
    """Check a node state change against :data:`NODE_TRANSITIONS`.

    Args:
        expected: The state the node is in now, as the caller read it.
        to: The state it should move to.

    Returns:
        The :class:`NodeTransition` to persist (compare-and-set on ``expected``).

    Raises:
        IllegalNodeTransition: ``illegal_transition`` -- ``to`` equals ``expected``, or the
            table does not list the move (every move out of ``left``).
    """
    if to == expected or to not in NODE_TRANSITIONS[expected]:
        allowed = ", ".join(sorted(state.value for state in NODE_TRANSITIONS[expected]))
        raise IllegalNodeTransition(
            f"a node cannot move from {expected.value} to {to.value} "
            f"(allowed from {expected.value}: {allowed or 'none, it is terminal'})",
            details={"from_state": expected.value, "to_state": to.value},
        )
    return NodeTransition(from_state=expected, to_state=to)


@dataclass(frozen=True, slots=True)
class FleetTiming:
    """The fleet's lease timing, in milliseconds.

    Attributes:
        heartbeat_ms: How often each node renews its membership lease (> 0).
        fence_after_ms: A node that has not renewed for this long stops taking traffic and
            stops its engines itself (> ``heartbeat_ms``).
        lost_after_ms: The fleet declares a node lost after this long without a renewal
            and re-places its replicas (at least :attr:`fence_bound_ms` plus a heartbeat, so
            that a node cut off has fenced itself before its replicas start elsewhere).
        placement_timeout_ms: A placement still ``pending``/``starting`` this long after it
            was made is stuck: the controller moves it to another node (> ``lost_after_ms``:
            a node's silence is judged before its slowness). Also how long the deployment
            then avoids the node it was stuck on.

    Raises:
        ValueError: the order ``0 < heartbeat_ms < fence_after_ms < lost_after_ms`` is
            broken, or ``lost_after_ms`` is shorter than :attr:`fence_bound_ms` plus a
            heartbeat (``proxy.model_host.fleet`` is validated the same way at load time).
    """

    heartbeat_ms: int
    fence_after_ms: int
    lost_after_ms: int
    placement_timeout_ms: int = 600_000
    rejoin_grace_ms: int | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_ms <= 0:
            raise ValueError(f"heartbeat_ms must be > 0, got {self.heartbeat_ms}")
        if self.fence_after_ms <= self.heartbeat_ms:
            raise ValueError(
                f"fence_after_ms ({self.fence_after_ms}) must be greater than heartbeat_ms "
                f"({self.heartbeat_ms})"
            )
        if self.lost_after_ms <= self.fence_after_ms:
            raise ValueError(
                f"fence_after_ms ({self.fence_after_ms}) must be less than lost_after_ms "
                f"({self.lost_after_ms}): a node must stop its engines before the fleet "
                "starts its replicas elsewhere"
            )
        if self.fence_bound_ms + self.heartbeat_ms > self.lost_after_ms:
            raise ValueError(
                f"lost_after_ms ({self.lost_after_ms}) must be at least the fence bound "
                f"({self.fence_bound_ms}) plus a heartbeat ({self.heartbeat_ms})"
            )
        if self.placement_timeout_ms <= self.lost_after_ms:
            raise ValueError(
                f"placement_timeout_ms ({self.placement_timeout_ms}) must be greater than "
                f"lost_after_ms ({self.lost_after_ms})"
            )

    @classmethod
    def from_config(cls, config: FleetConfig) -> FleetTiming:
        """The timing of ``proxy.model_host.fleet`` (already validated by the loader)."""
        return cls(
            heartbeat_ms=config.heartbeat_ms,
            fence_after_ms=config.fence_after_ms,
            lost_after_ms=config.lost_after_ms,
            placement_timeout_ms=config.placement_timeout_ms,
            rejoin_grace_ms=config.rejoin_grace_ms,
        )

    @property
    def leaving_grace_ms(self) -> int:
        """How long a ``leaving`` node keeps its placements, in ms."""
        if self.rejoin_grace_ms is not None:
            return self.rejoin_grace_ms
        return self.lost_after_ms // 2

    @property
    def peer_ask_timeout_ms(self) -> int:
        """How long one fence ask waits for a peer's answer, in ms
        (:func:`~sbproxy.config.peer_ask_timeout_ms`)."""
        return peer_ask_timeout_ms(self.heartbeat_ms)

    @property
    def fence_bound_ms(self) -> int:
        """The longest a node cut off from the database keeps its engines after its last
        successful renewal, in ms (:func:`~sbproxy.config.fence_bound_ms`)."""
        return fence_bound_ms(heartbeat_ms=self.heartbeat_ms, fence_after_ms=self.fence_after_ms)

    @property
    def store_deadline_ms(self) -> int:
        """How long one round trip to the fleet's database may take before the call fails,
        in ms: half of what ``fence_after_ms`` leaves after two heartbeats, 250 ms to 2 s.
        A renewal that does not answer within it counts as lost from its start plus this
        (the fence question compares peers' renewals with that moment), so peers that
        renew on time are seen as later well before the fence deadline."""
        return max(250, min(2_000, (self.fence_after_ms - 2 * self.heartbeat_ms) // 2))

    @property
    def suspect_after_ms(self) -> int:
        """Milliseconds without a renewal after which a node is ``suspect`` (1.5 periods)."""
        return int(self.heartbeat_ms * SUSPECT_AFTER_HEARTBEATS)


def derive_state(
    *,
    last_renewal_ms: int,
    now_ms: int,
    timing: FleetTiming,
    cordoned: bool = False,
    draining: bool = False,
    left: bool = False,
    unconfirmed: bool = False,
    leaving_since_ms: int | None = None,
) -> NodeState:
    """A node's state from its lease and its operator flags.

    Args:
        last_renewal_ms: The node's last lease renewal, on database time (epoch ms).
        now_ms: Now, on database time (epoch ms). A ``now_ms`` before the renewal (read
            in an earlier transaction than the renewal committed) counts as 0 elapsed.
        timing: The fleet's timing.
        cordoned: The operator cordoned the node.
        draining: The operator is draining the node (implies cordoned).
        left: The node was removed from the fleet.
        unconfirmed: The judge (a controller that just took over) has not seen a renewal
            of the node since it started watching: the node is at best ``suspect`` -- it
            keeps its replicas but takes no new one until a renewal is seen (issue 30,
            item 4).
        leaving_since_ms: Database time from which a node that stopped gracefully (and
            has not renewed since) is counted as leaving; ``None`` while it runs.

    Returns:
        ``left`` if ``left``; else ``lost`` when ``now - last >= lost_after_ms``, or when it
        has been leaving for ``timing.leaving_grace_ms``; else ``leaving`` while it is;
        else ``suspect`` when ``now - last > timing.suspect_after_ms`` or ``unconfirmed``;
        else ``draining``, ``cordoned`` by flag; else ``ready``.
    """
    elapsed = max(0, now_ms - last_renewal_ms)
    leaving = leaving_since_ms is not None
    over = leaving and now_ms - (leaving_since_ms or 0) >= timing.leaving_grace_ms
    # First that applies wins (the precedence of the module docstring).
    ordered = (
        (left, NodeState.LEFT),
        (elapsed >= timing.lost_after_ms or over, NodeState.LOST),
        (leaving, NodeState.LEAVING),
        (unconfirmed or elapsed > timing.suspect_after_ms, NodeState.SUSPECT),
        (draining, NodeState.DRAINING),
        (cordoned, NodeState.CORDONED),
    )
    return next((state for applies, state in ordered if applies), NodeState.READY)


class FenceVerdict(StrEnum):
    """What a node does about its own lease (see :func:`fence_verdict`)."""

    SERVE = "serve"
    """The lease is fresh enough: keep serving and taking work."""
    FENCE = "fence"
    """This node is the one cut off: stop taking traffic and stop every engine now."""
    HOLD = "hold"
    """Nobody can renew (the database is down for all): keep serving what runs, refuse
    mutations with ``journal_unavailable``; nobody can re-place anything either."""


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    """What asking one other member (fleet credential) returned.

    Attributes:
        node_id: The peer asked.
        reached: The peer answered, as itself: an answer that names another node (a
            loopback advertise URL that reaches the asking host's own gateway, a stale
            address now used by someone else) is not ``reached``.
        renewed_at_ms: The peer's own last successful renewal on database time (epoch ms),
            as it reports it; ``None`` when it never renewed or was not reached.
        streak_since_ms: When the peer's current run of successful renewals began (its
            first success after its last failure, or its join), database time; ``None``
            when it does not say (then ``renewed_at_ms`` stands for it).
    """

    node_id: str
    reached: bool
    renewed_at_ms: int | None = None
    streak_since_ms: int | None = None

    def renewed_during(self, first_ms: int, last_ms: int) -> bool:
        """Whether this peer's unbroken run of renewals overlaps this node's failing ones
        (from ``first_ms`` to ``last_ms``, database time): the database answered it while it
        did not answer this node."""
        if not self.reached or self.renewed_at_ms is None:
            return False
        since = self.renewed_at_ms if self.streak_since_ms is None else self.streak_since_ms
        return since <= last_ms and self.renewed_at_ms >= first_ms


def fence_verdict(
    *,
    since_own_renewal_ms: int,
    cut_off_at_ms: int,
    timing: FleetTiming,
    peers_known: int,
    answers: Sequence[PeerAnswer],
    failing_until_ms: int | None = None,
) -> FenceVerdict:
    """Decide whether this node must fence itself (ARCHITECTURE.md "Several hosts").

    The question is not whether a peer renewed *recently* -- in an outage for everyone the
    peers' last renewals are as old as this node's, and the first host to reach its deadline
    would always see fresh-looking peers and fence (issue 30, item 0) -- but whether a peer
    renewed, without a break, while this node's renewals were failing. Then the database
    answered the peer and not this node, which is the odd one out. A peer whose renewals
    began again only after this node's last failure was down too (the end of an outage for
    everyone: this node's next renewal will succeed).

    Args:
        since_own_renewal_ms: Milliseconds since this node's last successful renewal, on
            its own monotonic clock (it may not be able to read database time).
        cut_off_at_ms: Database time of this node's first failed renewal since its last
            success (its start; a renewal still blocked past one round trip's deadline
            counts as failed).
        failing_until_ms: Database time of its latest failed renewal's start (default
            ``cut_off_at_ms``).
        timing: The fleet's timing.
        peers_known: Other members that were alive (renewed within ``lost_after_ms``) at
            this node's last successful renewal, not ``left`` (issue 30, item 19: a member
            dead for long is no partition peer).
        answers: Answers of those peers, asked once the renewal was overdue; may be empty
            when none was asked yet.

    Returns:
        ``serve`` while ``since_own_renewal_ms < fence_after_ms``. Past it: ``fence`` when
        a reached peer renewed while this node failed (:meth:`PeerAnswer.renewed_during`),
        or when peers are known but none was reached (a minority partition); ``hold`` when
        there are no other live members, or no reached peer renewed across this node's
        failure (the database is, or was, down for all).
    """
    if since_own_renewal_ms < timing.fence_after_ms:
        return FenceVerdict.SERVE
    reached = [answer for answer in answers if answer.reached]
    last = cut_off_at_ms if failing_until_ms is None else failing_until_ms
    if any(answer.renewed_during(cut_off_at_ms, last) for answer in reached):
        return FenceVerdict.FENCE
    if peers_known > 0 and not reached:
        return FenceVerdict.FENCE
    return FenceVerdict.HOLD
