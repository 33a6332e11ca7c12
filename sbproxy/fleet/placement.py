"""The fleet's placement planner: ``plan(nodes, deployments, placements) -> decisions``.

Pure: no clock, no I/O, no randomness. The controller builds the three inputs from the
journal (nodes with their derived :class:`~sbproxy.fleet.membership.NodeState`, the desired
deployments of the current revision, the placements recorded so far), calls :func:`plan`,
and turns each decision into a durable job. It calls again after every change; each call
plans only the next safe step, so a plan is never "in progress" in here.

Filter, then score (issue 20 "Placement"):

1. **node state** -- only ``ready`` nodes take new replicas. ``suspect`` and ``cordoned``
   nodes keep theirs; ``draining`` nodes keep theirs until a replacement elsewhere is
   ready; replicas on ``lost`` or ``left`` nodes (or on nodes not in ``nodes``) are
   re-placed (decision ``replace``) before any other replica takes memory, at most
   ``max_replacements_in_flight`` not yet ready at once;
2. **labels** -- every ``required_labels`` key with the same value;
3. **engine and hardware** -- the node offers one of the deployment's engines (first
   listed wins) and has a device the variant runs on: its kind among the variant's
   ``accelerators`` and, on CUDA, its compute capability at least the variant's
   ``min_compute_capability`` (a variant the node resolves itself runs anywhere);
4. **memory fit** -- ``tensor_parallel`` distinct devices the variant runs on, each with
   ``estimate.total_bytes`` free (the GGUF estimate with the safety margin,
   :mod:`~sbproxy.model_host.runtime.memory`) after every placement already on the device,
   stopping ones included, and every placement this plan adds; two replicas of one
   deployment never share a device, so a node takes a second replica only when it has
   devices for both (and, with ``max_replicas_per_node``, only that many distinct replicas
   of one deployment at all).

A deployment may offer several **variant choices** (``heterogeneous_variants`` with no pinned
variant): filters 3 and 4 take, per node, the first choice whose engine the node offers, that
runs on its devices and whose estimate fits; the decision names that variant and its
reservation. Nodes in a spec's ``avoid_nodes`` (a stuck placement of it was moved off them)
take none of its replicas.

**Stuck placements**: a placement the caller marks ``stuck`` (a ``pending``/``starting`` one:
``placement_timeout``, ``crash_loop``, ``load_failed``; a ``ready`` one: ``crash_loop``) is
re-placed like a replica on a gone
node (decision ``replace`` with that ``cause``, the same in-flight cap) on another node, and
stopped (cause ``stuck``) in the same plan; when no other node fits it stays where it is and
the replica is reported ``unplaced`` with the reason of the filter that refused.

A replica no node passes gets ``unplaced`` with the reason of the first filter that left
no candidate: ``no_matching_node`` (state or labels), ``engine_unavailable`` (engine or
hardware), ``insufficient_capacity`` (memory or devices).

Score, in this order (issue 33, "Artifact-aware placement"):

1. **fit** -- only nodes that pass the four filters above are scored at all;
2. **replica spreading** -- fewer replicas of the deployment in the node's ``spread_by``
   label domains, and under ``spread`` fewer on the node itself: availability, which
   locality never trades away (a node holding the artifact is, after a scale-up, the node
   that already runs a replica; on a node with eight GPUs, locality first would stack every
   replica there);
3. **locality** -- a node that reported the choice's artifact verified in its cache
   (``cached_artifacts``) before every node that would have to fetch it: the replica starts
   sooner and nothing is downloaded for it;
4. **strategy** -- ``spread`` (default) the most free memory left (as a share of the node's
   capacity); ``binpack`` the least.

Ties go to the smaller node id, and devices to the smaller index, so a plan is
deterministic. Every start and replace decision carries a ``reason`` sentence naming why
its node won: the artifact it holds (``node-b holds sha256:1f2e3d4c5b6a... (1.0 GiB)``),
that a holder was passed over to spread the replicas, or that no fitting node holds it;
then how many nodes fit and the strategy.

Rollouts: a placement of an older revision, or on a draining node, is *retiring*. Rolling
starts the new placement first and stops the retiring one only once the new one is
``ready`` (decisions list starts before stops). When the new one cannot fit beside the old
one, or the rollout is ``recreate``, the old one is stopped first (cause ``make_room``) --
but only while every other replica is serving, so at least ``replicas - 1`` serve
throughout (the others are ``deferred``, ``rollout_paced``); the start follows in a later
plan once its memory is free (``deferred``, ``awaiting_stop``, until then).

Out of scope here: eviction; deciding that a placement is stuck (the caller's, on database
time: :func:`~sbproxy.fleet.control.stuck_placements`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sbproxy.config import DeploymentConfig, FleetConfig, PlacementStrategy, Rollout, SplitMode
from sbproxy.fleet.membership import NodeState
from sbproxy.model_host.runtime.memory import MemoryEstimate

__all__ = [
    "Decision",
    "DeferReason",
    "DeferredReplica",
    "DeploymentSpec",
    "DeviceCapacity",
    "EstimateBasis",
    "NodeView",
    "PlacementPlan",
    "PlacementPolicy",
    "PlacementReason",
    "PlacementState",
    "PlacementView",
    "ReplaceReplica",
    "SplitWorker",
    "StartReplica",
    "StopReplica",
    "StuckReason",
    "UnplacedReplica",
    "VariantChoice",
    "plan",
]

_GONE_STATES = frozenset({NodeState.LOST, NodeState.LEFT})


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlacementReason(StrEnum):
    """Why a replica could not be placed (stable reason codes)."""

    NO_MATCHING_NODE = "no_matching_node"
    """No ready node carries the deployment's ``required_labels``."""
    ENGINE_UNAVAILABLE = "engine_unavailable"
    """Matching ready nodes exist, but none offers one of the deployment's engines."""
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    """Matching nodes with the engine exist, but none has free devices enough."""


class DeferReason(StrEnum):
    """Why a replica that could be placed waits for a later plan (stable reason codes)."""

    REPLACEMENTS_CAPPED = "replacements_capped"
    """``max_replacements_in_flight`` re-placements are already started and not ready."""
    AWAITING_STOP = "awaiting_stop"
    """Its memory is held by a placement that is stopping; it is placed once that is gone."""
    ROLLOUT_PACED = "rollout_paced"
    """Its old placement must stop first (recreate, or no room), but another replica is
    already down: it waits so that at least ``replicas - 1`` keep serving."""


class EstimateBasis(StrEnum):
    """What a replica's memory estimate was computed from."""

    GGUF_HEADER = "gguf_header"
    """The model's shape from a GGUF header a node read from its verified artifact."""
    FILE_SIZE = "file_size"
    """The artifact's file sizes only (no node holds it yet): KV sized as a share of them."""


class StuckReason(StrEnum):
    """Why a placement that never became ready is moved elsewhere (stable reason codes)."""

    PLACEMENT_TIMEOUT = "placement_timeout"
    """It stayed ``pending``/``starting`` longer than ``placement_timeout_ms``."""
    CRASH_LOOP = "crash_loop"
    """Its node reports the engine held in a crash loop."""
    LOAD_FAILED = "load_failed"
    """Its node reports that preparing it (pull, resolve, admit, launch) failed."""
    WORKER_FAILED = "worker_failed"
    """A split's RPC worker is gone: its node is lost or left, or its ``ggml-rpc-server``
    exited or could not start (the whole split is placed again)."""


class PlacementState(StrEnum):
    """Where a recorded placement is; every state holds its reservation."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


class DeviceCapacity(_Frozen):
    """One device of a node: ``index``, the bytes it offers to models (>= 0), its kind
    (``cpu``, ``cuda``, ``metal``) and, for a CUDA device, its compute capability
    (``None``: unknown)."""

    index: int = Field(ge=0)
    capacity_bytes: int = Field(ge=0)
    accelerator: str = "cpu"
    compute_capability: tuple[int, int] | None = None


class NodeView(_Frozen):
    """One member as the planner sees it.

    Attributes:
        id: Node id (``proxy.model_host.node.id``).
        state: Derived by :func:`~sbproxy.fleet.membership.derive_state`.
        labels: The node's labels.
        engines: Engine kinds the node can run now (``llama_cpp``, ``vllm``).
        devices: Its devices with the bytes each offers to models in total (not the free
            bytes of a probe: the planner subtracts the placements itself).
        cached_artifacts: Artifact digests already verified in the node's cache.
        cached_bytes: The size of each of them in bytes, where the node reported it (for
            the decision's reason only).
        draining: The operator's drain flag, whatever the state shows: a draining node that
            misses a renewal is ``suspect``, and its replicas still move (a move started
            there first is not undone by a late heartbeat).
    """

    id: str = Field(min_length=1)
    state: NodeState
    draining: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    engines: frozenset[str] = frozenset()
    devices: tuple[DeviceCapacity, ...] = ()
    cached_artifacts: frozenset[str] = frozenset()
    cached_bytes: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _distinct_devices(self) -> NodeView:
        indexes = [device.index for device in self.devices]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"node {self.id}: device indexes must be distinct, got {indexes}")
        return self


class VariantChoice(_Frozen):
    """One way to run a replica: a catalog variant with its engines and estimate.

    Attributes:
        variant: Catalog variant id; ``None`` lets the node resolve it.
        engines: Acceptable engine kinds, preferred first (non-empty).
        estimate: Bytes one replica reserves on each of its devices.
        artifact_digest: The variant's artifact, for cache locality; ``None`` if unknown.
        estimate_basis: What ``estimate`` was computed from.
    """

    variant: str | None = None
    engines: tuple[str, ...] = Field(min_length=1)
    estimate: MemoryEstimate
    artifact_digest: str | None = None
    estimate_basis: EstimateBasis = EstimateBasis.FILE_SIZE
    accelerators: frozenset[str] = frozenset()
    min_compute_capability: tuple[int, int] | None = None

    def runs_on(self, device: DeviceCapacity) -> bool:
        """Whether this variant can run on ``device``: its kind is one of ``accelerators``
        (any when empty) and, on CUDA, its compute capability is known and at least
        ``min_compute_capability`` (when set)."""
        if self.accelerators and device.accelerator not in self.accelerators:
            return False
        minimum = self.min_compute_capability
        if minimum is None or device.accelerator != "cuda":
            return True
        return device.compute_capability is not None and device.compute_capability >= minimum

    def describe_hardware(self) -> str:
        """The hardware it needs, in words (``cuda with compute capability 8.0 or newer``)."""
        kinds = " or ".join(sorted(self.accelerators)) or "any device"
        if self.min_compute_capability is None:
            return kinds
        major, minor = self.min_compute_capability
        return f"{kinds} with compute capability {major}.{minor} or newer"


class DeploymentSpec(_Frozen):
    """One desired deployment at one revision.

    Attributes:
        id: Deployment id.
        revision: Desired-state revision (>= 1); placements of a smaller one are retiring.
        replicas: Replicas wanted (0 stops them all).
        required_labels: Labels a node must carry.
        spread_by: Label keys whose values replicas are spread across.
        engines: Acceptable engine kinds, preferred first (non-empty).
        estimate: Bytes one replica reserves on each of its devices (GGUF estimate with the
            safety margin: :func:`~sbproxy.model_host.runtime.memory.estimate_memory`).
        tensor_parallel: Devices per replica (>= 1).
        rollout: ``rolling`` or ``recreate``.
        artifact_digest: The pinned artifact, for cache locality; ``None`` if unknown.
        variant: The catalog variant of ``engines``/``estimate``; ``None``: the node resolves.
        estimate_basis: What ``estimate`` was computed from.
        alternatives: Further :class:`VariantChoice` s, tried in order per node after the
            first (``heterogeneous_variants``).
        avoid_nodes: Nodes none of its replicas is placed on now.
        accelerators: Device kinds ``variant`` runs on (any when empty: the node resolves).
        min_compute_capability: The lowest CUDA compute capability ``variant`` accepts.
        split: Whether a replica may be split over several nodes' llama.cpp RPC workers
            (:class:`~sbproxy.config.SplitMode`; ``none`` unless the definition says).
    """

    id: str = Field(min_length=1)
    revision: int = Field(ge=1)
    replicas: int = Field(ge=0)
    required_labels: dict[str, str] = Field(default_factory=dict)
    spread_by: tuple[str, ...] = ()
    engines: tuple[str, ...] = Field(min_length=1)
    estimate: MemoryEstimate
    tensor_parallel: int = Field(default=1, ge=1)
    rollout: Rollout = Rollout.ROLLING
    artifact_digest: str | None = None
    variant: str | None = None
    estimate_basis: EstimateBasis = EstimateBasis.FILE_SIZE
    alternatives: tuple[VariantChoice, ...] = ()
    avoid_nodes: frozenset[str] = frozenset()
    accelerators: frozenset[str] = frozenset()
    min_compute_capability: tuple[int, int] | None = None
    split: SplitMode = SplitMode.NONE

    def choices(self) -> tuple[VariantChoice, ...]:
        """The first choice (this spec's own variant, engines and estimate), then the
        alternatives."""
        first = VariantChoice(
            variant=self.variant,
            engines=self.engines,
            estimate=self.estimate,
            artifact_digest=self.artifact_digest,
            estimate_basis=self.estimate_basis,
            accelerators=self.accelerators,
            min_compute_capability=self.min_compute_capability,
        )
        return (first, *self.alternatives)

    @classmethod
    def from_config(
        cls,
        deployment_id: str,
        config: DeploymentConfig,
        *,
        revision: int,
        estimate: MemoryEstimate,
        engines: Sequence[str],
        artifact_digest: str | None = None,
        variant: str | None = None,
        estimate_basis: EstimateBasis = EstimateBasis.FILE_SIZE,
        alternatives: Sequence[VariantChoice] = (),
        avoid_nodes: Iterable[str] = (),
        accelerators: Iterable[str] = (),
        min_compute_capability: tuple[int, int] | None = None,
        replicas: int | None = None,
    ) -> DeploymentSpec:
        """The spec of a configured deployment; ``engines`` come from its resolved variant;
        ``replicas``: the count an autoscaling decision set (default: the configured count,
        or the range's initial one)."""
        return cls(
            id=deployment_id,
            revision=revision,
            replicas=config.replica_count if replicas is None else replicas,
            required_labels=dict(config.required_labels),
            spread_by=tuple(config.spread_by),
            engines=tuple(engines),
            estimate=estimate,
            tensor_parallel=config.tensor_parallel or 1,
            rollout=config.rollout,
            artifact_digest=artifact_digest,
            variant=variant,
            estimate_basis=estimate_basis,
            alternatives=tuple(alternatives),
            avoid_nodes=frozenset(avoid_nodes),
            accelerators=frozenset(accelerators),
            min_compute_capability=min_compute_capability,
            split=config.split,
        )


class SplitWorker(_Frozen):
    """One node's part of a replica split over several nodes (llama.cpp RPC): the device
    its ``ggml-rpc-server`` offers and the bytes it reserves there. The first worker of a
    split is on the leader's node, and its reservation includes the leader's own compute
    buffer."""

    node: str = Field(min_length=1)
    devices: tuple[int, ...]
    reserved_bytes: int = Field(ge=0)


class PlacementView(_Frozen):
    """One recorded placement of a replica on a node.

    Attributes:
        id: Placement id (the journal's).
        deployment: Deployment id.
        replica: Replica index, ``0 .. replicas-1``.
        revision: Revision it runs.
        node: Node id.
        devices: Device indexes it holds.
        reserved_bytes: Bytes it holds on each of its devices.
        state: Its :class:`PlacementState`.
        replaces: The placement it re-placed from a lost node, if any (counts against
            ``max_replacements_in_flight`` until ``ready``).
        stuck: Set by the caller on a placement to move elsewhere (a ``pending``/``starting``
            one, or a ``ready`` one whose engine is held in a crash loop).
        workers: A split replica's RPC workers, the leader's node first (its ``node``,
            ``devices`` and ``reserved_bytes`` are the first worker's); empty for a replica
            on one node.
        stuck_node: The node a stuck split failed on (a worker's); ``None``: ``node``.
    """

    id: str = Field(min_length=1)
    deployment: str
    replica: int = Field(ge=0)
    revision: int = Field(ge=1)
    node: str
    devices: tuple[int, ...]
    reserved_bytes: int = Field(ge=0)
    state: PlacementState
    replaces: str | None = None
    stuck: StuckReason | None = None
    workers: tuple[SplitWorker, ...] = ()
    stuck_node: str | None = None

    def holdings(self) -> tuple[tuple[str, tuple[int, ...], int], ...]:
        """``(node, devices, bytes)`` of every reservation it holds: one, or one per worker
        of a split."""
        if self.workers:
            return tuple((w.node, w.devices, w.reserved_bytes) for w in self.workers)
        return ((self.node, self.devices, self.reserved_bytes),)


class PlacementPolicy(_Frozen):
    """Fleet-wide knobs: node scoring, the re-placement cap, and how many distinct replicas
    of one deployment a node may hold (``None``: as many as it has devices for)."""

    strategy: PlacementStrategy = PlacementStrategy.SPREAD
    max_replacements_in_flight: int = Field(default=2, ge=1)
    max_replicas_per_node: int | None = Field(default=None, ge=1)

    @classmethod
    def from_config(cls, config: FleetConfig) -> PlacementPolicy:
        """The policy of ``proxy.model_host.fleet``: a node takes as many replicas of one
        deployment as it has devices for (each replica on devices no other replica of it
        holds; its runtime runs each under its own id,
        :func:`~sbproxy.fleet.routing.replica_deployment_id`)."""
        return cls(
            strategy=config.placement,
            max_replacements_in_flight=config.max_replacements_in_flight,
        )


StartCause = Literal["missing", "rollout", "drain"]
ReplaceCause = Literal[
    "node_gone", "placement_timeout", "crash_loop", "load_failed", "worker_failed"
]
StopCause = Literal["rollout", "drain", "make_room", "scale_down", "duplicate", "removed", "stuck"]


class StartReplica(_Frozen):
    """Start replica ``replica`` of ``deployment`` at ``revision`` on ``node``.

    ``cause``: ``missing`` (no placement serves the replica), ``rollout`` (a newer
    revision), ``drain`` (moving off a draining node).
    """

    kind: Literal["start"] = "start"
    deployment: str
    replica: int
    revision: int
    node: str
    devices: tuple[int, ...]
    engine: str
    reserved_bytes: int
    cause: StartCause
    variant: str | None = None
    estimate_basis: EstimateBasis = EstimateBasis.FILE_SIZE
    reason: str = ""
    """Why this node: locality (the artifact it holds), then the strategy."""
    workers: tuple[SplitWorker, ...] = ()
    """A split replica's RPC workers, the leader's node first; empty on one node."""


class ReplaceReplica(_Frozen):
    """Start replica ``replica`` on ``node`` in place of ``replaces`` on ``from_node``:
    ``cause`` ``node_gone`` (lost or left), else the :class:`StuckReason` of a placement
    that never became ready (the plan stops it too). For a split whose worker failed,
    ``from_node`` is that worker's node (the one the deployment then avoids)."""

    kind: Literal["replace"] = "replace"
    deployment: str
    replica: int
    revision: int
    node: str
    devices: tuple[int, ...]
    engine: str
    reserved_bytes: int
    replaces: str
    from_node: str
    cause: ReplaceCause = "node_gone"
    variant: str | None = None
    estimate_basis: EstimateBasis = EstimateBasis.FILE_SIZE
    reason: str = ""
    """Why this node: locality (the artifact it holds), then the strategy."""
    workers: tuple[SplitWorker, ...] = ()
    """A split replica's RPC workers, the leader's node first; empty on one node."""


class StopReplica(_Frozen):
    """Stop placement ``placement`` (drain, then stop the engine) on ``node``."""

    kind: Literal["stop"] = "stop"
    placement: str
    deployment: str
    replica: int
    revision: int
    node: str
    cause: StopCause


class UnplacedReplica(_Frozen):
    """A replica no node can take now, with the reason code and a sentence saying why."""

    kind: Literal["unplaced"] = "unplaced"
    deployment: str
    replica: int
    revision: int
    reason: PlacementReason
    message: str


class DeferredReplica(_Frozen):
    """A replica left for a later plan (see :class:`DeferReason`)."""

    kind: Literal["deferred"] = "deferred"
    deployment: str
    replica: int
    revision: int
    reason: DeferReason
    message: str


Decision = Annotated[
    StartReplica | ReplaceReplica | StopReplica | UnplacedReplica | DeferredReplica,
    Field(discriminator="kind"),
]


class PlacementPlan(_Frozen):
    """The decisions of one :func:`plan` call, in the order they should be carried out:
    starts and replaces first, then stops, then the replicas left unplaced or deferred.

    Its JSON form (``model_dump_json()``) is stable: fields in declaration order, decisions
    in plan order, a ``kind`` on each.
    """

    decisions: tuple[Decision, ...] = ()

    def of_kind(self, kind: str) -> tuple[Decision, ...]:
        """The decisions whose ``kind`` is ``kind``."""
        return tuple(decision for decision in self.decisions if decision.kind == kind)


# -- working state ---------------------------------------------------------------------


@dataclass
class _Ledger:
    """Bytes used per (node, device), and devices each deployment holds per node."""

    used: Counter[tuple[str, int]] = field(default_factory=Counter)
    holders: defaultdict[tuple[str, str], set[int]] = field(
        default_factory=lambda: defaultdict(set)
    )
    # replicas of a deployment per node, for spreading
    per_node: Counter[tuple[str, str]] = field(default_factory=Counter)
    # which replica indexes of a deployment a node holds (max_replicas_per_node)
    indexes: defaultdict[tuple[str, str], Counter[int]] = field(
        default_factory=lambda: defaultdict(Counter)
    )

    def add(
        self, deployment: str, node: str, devices: Iterable[int], size: int, replica: int
    ) -> None:
        devices = tuple(devices)
        for index in devices:
            self.used[(node, index)] += size
            self.holders[(deployment, node)].add(index)
        self.per_node[(deployment, node)] += 1
        self.indexes[(deployment, node)][replica] += 1

    def remove(
        self, deployment: str, node: str, devices: Iterable[int], size: int, replica: int
    ) -> None:
        devices = tuple(devices)
        for index in devices:
            self.used[(node, index)] -= size
            self.holders[(deployment, node)].discard(index)
        self.per_node[(deployment, node)] -= 1
        self.indexes[(deployment, node)][replica] -= 1

    def other_replicas(self, deployment: str, node: str, replica: int) -> int:
        """Distinct replica indexes of ``deployment`` on ``node`` other than ``replica``."""
        held = self.indexes[(deployment, node)]
        return sum(1 for index, count in held.items() if count > 0 and index != replica)


@dataclass(frozen=True)
class _Missing:
    """A replica with no current placement, still to be started (or made room for)."""

    spec: DeploymentSpec
    replica: int
    retiring: list[PlacementView]
    stopping: list[PlacementView]


@dataclass(frozen=True)
class _Fit:
    node: NodeView
    devices: tuple[int, ...]
    engine: str
    choice: VariantChoice
    reason: str = ""
    workers: tuple[SplitWorker, ...] = ()

    @property
    def reserved_bytes(self) -> int:
        """What it reserves on each of its (leader's) devices."""
        return self.workers[0].reserved_bytes if self.workers else self.choice.estimate.total_bytes

    def holdings(self) -> tuple[tuple[str, tuple[int, ...], int], ...]:
        """``(node, devices, bytes)`` of every reservation it makes."""
        if self.workers:
            return tuple((w.node, w.devices, w.reserved_bytes) for w in self.workers)
        return ((self.node.id, self.devices, self.choice.estimate.total_bytes),)


@dataclass(frozen=True)
class _SplitCandidate:
    key: tuple[object, ...]
    node: NodeView
    device: int
    free: int
    holds: bool


@dataclass(frozen=True)
class _Refusal:
    reason: PlacementReason
    message: str


def _capacity(node: NodeView) -> int:
    return sum(device.capacity_bytes for device in node.devices)


def _free_share(node: NodeView, ledger: _Ledger) -> Fraction:
    total = _capacity(node)
    if total == 0:
        return Fraction(0)
    used = sum(ledger.used[(node.id, device.index)] for device in node.devices)
    return Fraction(max(0, total - used), total)


class _Planner:
    def __init__(
        self,
        nodes: Sequence[NodeView],
        deployments: Sequence[DeploymentSpec],
        placements: Sequence[PlacementView],
        policy: PlacementPolicy,
        frozen: frozenset[str] = frozenset(),
    ) -> None:
        _require_distinct("node", [node.id for node in nodes])
        self.frozen = frozen - {spec.id for spec in deployments}
        _require_distinct("deployment", [spec.id for spec in deployments])
        _require_distinct("placement", [placement.id for placement in placements])
        self.nodes = {node.id: node for node in sorted(nodes, key=lambda n: n.id)}
        self.deployments = sorted(deployments, key=lambda d: d.id)
        self.placements = sorted(placements, key=lambda p: (p.deployment, p.replica, p.id))
        self.policy = policy
        self.ledger = _Ledger()
        for placement in self.placements:
            if placement.workers and self._gone(placement):
                # A split whose leader is gone holds nothing: its workers stop as soon as
                # their nodes see the leader gone (fleet/split.py).
                continue
            for where, devices, size in placement.holdings():
                node = self.nodes.get(where)
                if node is not None and node.state not in _GONE_STATES:
                    self.ledger.add(placement.deployment, where, devices, size, placement.replica)
        self.replacement_budget = policy.max_replacements_in_flight - sum(
            1
            for p in self.placements
            if p.replaces is not None
            and p.state in (PlacementState.PENDING, PlacementState.STARTING)
            and not self._gone(p)
        )
        self.starts: list[StartReplica | ReplaceReplica] = []
        self.stops: list[StopReplica] = []
        self.notes: list[UnplacedReplica | DeferredReplica] = []

    # -- facts -------------------------------------------------------------------------

    def _gone(self, placement: PlacementView) -> bool:
        node = self.nodes.get(placement.node)
        return node is None or node.state in _GONE_STATES

    def _stuck(self, placement: PlacementView) -> tuple[StuckReason, str] | None:
        """Why ``placement`` must move, and the node it failed on: the caller's mark, or a
        split one of whose workers' nodes is gone or leaving (a worker that stops loses the
        weights it held: the split cannot wait for it to come back)."""
        # A gone worker comes first: the leader's engine fails for want of it (a crash loop
        # there is its consequence, and moving the split off the leader would not help).
        for worker in placement.workers:
            node = self.nodes.get(worker.node)
            if node is None or node.state in _GONE_STATES:
                return StuckReason.WORKER_FAILED, worker.node
            if node.state is NodeState.LEAVING and worker.node != placement.node:
                return StuckReason.WORKER_FAILED, worker.node
        if placement.stuck is not None:
            return placement.stuck, placement.stuck_node or placement.node
        return None

    def _hold(self, placement: PlacementView, *, release: bool = False) -> None:
        for where, devices, size in placement.holdings():
            change = self.ledger.remove if release else self.ledger.add
            change(placement.deployment, where, devices, size, placement.replica)

    def _stoppable(self, placement: PlacementView) -> bool:
        return not self._gone(placement) and placement.state is not PlacementState.STOPPING

    def _draining(self, placement: PlacementView) -> bool:
        node = self.nodes.get(placement.node)
        return node is not None and (node.state is NodeState.DRAINING or node.draining)

    # -- the plan ----------------------------------------------------------------------

    def run(self) -> PlacementPlan:
        wanted = {spec.id for spec in self.deployments}
        for placement in self.placements:
            if placement.deployment in self.frozen:
                continue
            if placement.deployment not in wanted and self._stoppable(placement):
                self._stop(placement, "removed")
        pending_replacements: list[tuple[DeploymentSpec, int, PlacementView]] = []
        missing: list[_Missing] = []
        for spec in self.deployments:
            replacements, unserved = self._deployment(spec)
            pending_replacements.extend(replacements)
            missing.extend(unserved)
        # Replicas lost with their node are placed before anything else takes memory:
        # restoring capacity comes before a rollout's surge or a scale-up.
        # The capped re-placements go to the deployments with the fewest serving replicas
        # first (a deployment with none left comes before one that lost one of three).
        pending_replacements.sort(key=lambda item: (self._serving(item[0]), item[0].id, item[1]))
        for spec, replica, lost in pending_replacements:
            if self.replacement_budget <= 0:
                stuck = self._stuck(lost)
                where = (
                    f"on gone node {lost.node}"
                    if self._gone(lost) or stuck is None
                    else f"stuck on {stuck[1]} ({stuck[0]})"
                )
                self.notes.append(
                    DeferredReplica(
                        deployment=spec.id,
                        replica=replica,
                        revision=spec.revision,
                        reason=DeferReason.REPLACEMENTS_CAPPED,
                        message=(
                            f"replica {replica} of {spec.id} {where} waits: "
                            f"{self.policy.max_replacements_in_flight} re-placements are in "
                            "flight (max_replacements_in_flight)"
                        ),
                    )
                )
                continue
            if self._place(spec, replica, replaces=lost):
                self.replacement_budget -= 1
        for item in missing:
            self._replica(item.spec, item.replica, item.retiring, item.stopping)
        self.notes.sort(key=lambda n: (n.deployment, n.replica))
        return PlacementPlan(decisions=(*self.starts, *self.stops, *self.notes))

    def _of(self, spec: DeploymentSpec) -> list[PlacementView]:
        return [p for p in self.placements if p.deployment == spec.id]

    def _serving(self, spec: DeploymentSpec) -> int:
        stopped = {stop.placement for stop in self.stops}
        return len(
            {
                p.replica
                for p in self._of(spec)
                if p.state is PlacementState.READY
                and not self._gone(p)
                and p.id not in stopped
                and p.replica < spec.replicas
            }
        )

    def _deployment(
        self, spec: DeploymentSpec
    ) -> tuple[list[tuple[DeploymentSpec, int, PlacementView]], list[_Missing]]:
        """Stop what one deployment no longer needs; return the replicas to re-place from
        gone nodes (capped by the caller) and the ones with no current placement."""
        mine = self._of(spec)
        replacements: list[tuple[DeploymentSpec, int, PlacementView]] = []
        missing: list[_Missing] = []
        for placement in mine:
            if placement.replica >= spec.replicas and self._stoppable(placement):
                self._stop(placement, "scale_down")
        for replica in range(spec.replicas):
            ofs = [p for p in mine if p.replica == replica]
            live = [p for p in ofs if not self._gone(p) and p.state is not PlacementState.STOPPING]
            lost = [p for p in ofs if self._gone(p)]
            stopping = [p for p in ofs if not self._gone(p) and p.state is PlacementState.STOPPING]
            current = [p for p in live if p.revision == spec.revision and not self._draining(p)]
            retiring = [p for p in live if p not in current]
            if current:
                order = {PlacementState.READY: 0, PlacementState.STARTING: 1}
                current.sort(key=lambda p: (order.get(p.state, 2), p.id))
                keep, extra = current[0], current[1:]
                for placement in extra:
                    self._stop(placement, "duplicate")
                if keep.state is PlacementState.READY:
                    for placement in retiring:
                        self._stop(placement, "drain" if self._draining(placement) else "rollout")
                if self._stuck(keep) is not None:
                    replacements.append((spec, replica, keep))
                continue
            if not retiring and lost:
                replacements.append((spec, replica, lost[0]))
                continue
            missing.append(_Missing(spec, replica, retiring, stopping))
        return replacements, missing

    def _replica(
        self,
        spec: DeploymentSpec,
        replica: int,
        retiring: list[PlacementView],
        stopping: list[PlacementView],
    ) -> None:
        """Replica ``replica`` has no current placement: start one, or make room first."""
        old_revision = [p for p in retiring if not self._draining(p)]
        cause: StartCause = "missing"
        if retiring:
            cause = "rollout" if old_revision else "drain"
        if spec.rollout is Rollout.RECREATE and old_revision:
            self._make_room(spec, replica, old_revision[0])
            return
        found = self._find(spec, replica)
        if isinstance(found, _Fit):
            self._start(spec, replica, found, cause)
            return
        for old in retiring:
            # Would the new one fit where the old one is, once it is gone?
            self._hold(old, release=True)
            fits = self._find(spec, replica)
            self._hold(old)
            if isinstance(fits, _Fit):
                self._make_room(spec, replica, old)
                return
        if stopping:
            self.notes.append(
                DeferredReplica(
                    deployment=spec.id,
                    replica=replica,
                    revision=spec.revision,
                    reason=DeferReason.AWAITING_STOP,
                    message=(
                        f"replica {replica} of {spec.id} is placed once placement "
                        f"{stopping[0].id} on {stopping[0].node} has stopped"
                    ),
                )
            )
            return
        self.notes.append(
            UnplacedReplica(
                deployment=spec.id,
                replica=replica,
                revision=spec.revision,
                reason=found.reason,
                message=found.message,
            )
        )

    def _make_room(self, spec: DeploymentSpec, replica: int, old: PlacementView) -> None:
        # Stop first only while every other replica serves: at least replicas - 1 stay up.
        others = self._serving(spec) - (1 if old.state is PlacementState.READY else 0)
        if old.state is not PlacementState.READY or others >= spec.replicas - 1:
            self._stop(old, "make_room")
            return
        self.notes.append(
            DeferredReplica(
                deployment=spec.id,
                replica=replica,
                revision=spec.revision,
                reason=DeferReason.ROLLOUT_PACED,
                message=(
                    f"replica {replica} of {spec.id} keeps revision {old.revision} on "
                    f"{old.node} for now: stopping it first would leave fewer than "
                    f"{spec.replicas - 1} of {spec.replicas} replicas serving"
                ),
            )
        )

    # -- effects on the working state ----------------------------------------------------

    def _start(self, spec: DeploymentSpec, replica: int, fit: _Fit, cause: StartCause) -> None:
        for where, devices, size in fit.holdings():
            self.ledger.add(spec.id, where, devices, size, replica)
        self.starts.append(
            StartReplica(
                deployment=spec.id,
                replica=replica,
                revision=spec.revision,
                node=fit.node.id,
                devices=fit.devices,
                engine=fit.engine,
                reserved_bytes=fit.reserved_bytes,
                cause=cause,
                variant=fit.choice.variant,
                estimate_basis=fit.choice.estimate_basis,
                reason=fit.reason,
                workers=fit.workers,
            )
        )

    def _place(self, spec: DeploymentSpec, replica: int, *, replaces: PlacementView) -> bool:
        """Re-place ``replaces`` (on a gone node, or stuck) elsewhere; ``False`` if refused."""
        marked = None if self._gone(replaces) else self._stuck(replaces)
        stuck = None if marked is None else marked[0]
        from_node = replaces.node if marked is None else marked[1]
        exclude = frozenset() if stuck is None else frozenset({from_node})
        if stuck is StuckReason.WORKER_FAILED:
            # A split without one of its workers serves nothing (its leader drops it): its
            # memory is the new split's, which stops it in the same transaction.
            self._hold(replaces, release=True)
        found = self._find(spec, replica, exclude)
        if not isinstance(found, _Fit):
            where = (
                f"re-placing from gone node {replaces.node}"
                if stuck is None
                else f"placement {replaces.id} is stuck on {from_node} ({stuck}) and "
                "stays there, no other node takes it"
            )
            if stuck is StuckReason.WORKER_FAILED:
                # A split without one of its workers cannot serve: it stops all the same.
                where = (
                    f"placement {replaces.id} lost its RPC worker on {from_node} and stops; "
                    "no other split fits"
                )
                self._stop(replaces, "stuck")
            self.notes.append(
                UnplacedReplica(
                    deployment=spec.id,
                    replica=replica,
                    revision=spec.revision,
                    reason=found.reason,
                    message=f"{where}: {found.message}",
                )
            )
            return False
        for where, devices, size in found.holdings():
            self.ledger.add(spec.id, where, devices, size, replica)
        self.starts.append(
            ReplaceReplica(
                deployment=spec.id,
                replica=replica,
                revision=spec.revision,
                node=found.node.id,
                devices=found.devices,
                engine=found.engine,
                reserved_bytes=found.reserved_bytes,
                replaces=replaces.id,
                from_node=from_node,
                cause="node_gone" if stuck is None else stuck.value,
                variant=found.choice.variant,
                estimate_basis=found.choice.estimate_basis,
                reason=found.reason,
                workers=found.workers,
            )
        )
        if stuck is not None:
            self._stop(replaces, "stuck")
        return True

    def _stop(self, placement: PlacementView, cause: StopCause) -> None:
        self.stops.append(
            StopReplica(
                placement=placement.id,
                deployment=placement.deployment,
                replica=placement.replica,
                revision=placement.revision,
                node=placement.node,
                cause=cause,
            )
        )

    # -- filter and score ----------------------------------------------------------------

    def _find(
        self, spec: DeploymentSpec, replica: int, exclude: frozenset[str] = frozenset()
    ) -> _Fit | _Refusal:
        if spec.split is SplitMode.RPC:
            return self._find_split(spec, replica, exclude, why="split: rpc")
        found = self._find_whole(spec, replica, exclude)
        if (
            spec.split is SplitMode.AUTO
            and spec.tensor_parallel == 1
            and isinstance(found, _Refusal)
            and found.reason is PlacementReason.INSUFFICIENT_CAPACITY
        ):
            split = self._find_split(spec, replica, exclude, why=f"{found.message}; split: auto")
            if isinstance(split, _Fit):
                return split
            return _Refusal(found.reason, f"{found.message}; no split either: {split.message}")
        return found

    def _find_split(
        self, spec: DeploymentSpec, replica: int, exclude: frozenset[str], *, why: str
    ) -> _Fit | _Refusal:
        """The fewest nodes (two or more) whose devices hold one replica split with
        llama.cpp's RPC backend: each worker reserves its share of the weights, KV cache and
        margin plus a compute buffer; the leader (the node holding the artifact, when one
        does) a second compute buffer for its own ``llama-server``."""
        choice = next((c for c in spec.choices() if SPLIT_ENGINE in c.engines), None)
        if choice is None:
            return _Refusal(
                PlacementReason.ENGINE_UNAVAILABLE,
                f"{spec.id} cannot be split: only llama.cpp splits a model over nodes (RPC)",
            )
        avoided = spec.avoid_nodes | exclude
        nodes = [
            n
            for n in self.nodes.values()
            if n.id not in avoided
            and n.state is NodeState.READY
            and _has_labels(n, spec.required_labels)
            and SPLIT_ENGINE in n.engines
        ]
        if len(nodes) < 2:
            return _Refusal(
                PlacementReason.INSUFFICIENT_CAPACITY,
                f"a split of {spec.id} needs two or more ready nodes with llama.cpp"
                f"{' and its labels' if spec.required_labels else ''}; {len(nodes)} found",
            )
        estimate = choice.estimate
        overhead = estimate.runtime_overhead_bytes
        for count in range(2, len(nodes) + 1):
            share = split_share(estimate, count)
            fits: list[_SplitCandidate] = []
            for node in nodes:
                device = self._split_device(spec, node, choice, share)
                if device is not None:
                    index, free = device
                    order = -free if self.policy.strategy is PlacementStrategy.SPREAD else free
                    holds = choice.artifact_digest in node.cached_artifacts
                    fits.append(
                        _SplitCandidate(
                            (self.ledger.per_node[(spec.id, node.id)], not holds, order, node.id),
                            node,
                            index,
                            free,
                            holds,
                        )
                    )
            if len(fits) < count:
                continue
            fits.sort(key=lambda item: item.key)
            chosen = fits[:count]
            # The leader reads the GGUF and sends the weights: a node holding it, if any.
            leaders = sorted(
                (item for item in chosen if item.free >= share + overhead),
                key=lambda item: (not item.holds, item.key),
            )
            if not leaders:
                continue
            leader = leaders[0]
            ordered = [leader, *(item for item in chosen if item is not leader)]
            workers = tuple(
                SplitWorker(
                    node=item.node.id,
                    devices=(item.device,),
                    reserved_bytes=share + (overhead if item is leader else 0),
                )
                for item in ordered
            )
            names = ", ".join(w.node for w in workers[1:])
            reason = (
                f"{why}: split over {count} nodes with llama.cpp RPC, leader {leader.node.id}"
                f"{' (holds the artifact)' if leader.holds else ''} and {names}, "
                f"{_size(share)} each"
            )
            return _Fit(
                leader.node, (leader.device,), SPLIT_ENGINE, choice, reason=reason, workers=workers
            )
        return _Refusal(
            PlacementReason.INSUFFICIENT_CAPACITY,
            f"{spec.id} does not fit split over all {len(nodes)} ready node(s) with llama.cpp "
            f"either ({_size(split_share(estimate, len(nodes)))} each)",
        )

    def _split_device(
        self, spec: DeploymentSpec, node: NodeView, choice: VariantChoice, size: int
    ) -> tuple[int, int] | None:
        """``(device, bytes free)`` of ``node``'s device with the most room (``binpack``:
        the least) for ``size``, not held by another replica of ``spec``."""
        held = self.ledger.holders[(spec.id, node.id)]
        free = [
            (device.capacity_bytes - self.ledger.used[(node.id, device.index)], device.index)
            for device in node.devices
            if device.index not in held and choice.runs_on(device)
        ]
        room = [(left, index) for left, index in free if left >= size]
        if not room:
            return None
        if self.policy.strategy is PlacementStrategy.BINPACK:
            left, index = min(room)
        else:
            left, index = min(room, key=lambda item: (-item[0], item[1]))
        return index, left

    def _find_whole(
        self, spec: DeploymentSpec, replica: int, exclude: frozenset[str] = frozenset()
    ) -> _Fit | _Refusal:
        avoided = spec.avoid_nodes | exclude
        nodes = [n for n in self.nodes.values() if n.id not in avoided]
        skipped = len(self.nodes) - len(nodes)
        aside = f" ({skipped} set aside after a stuck placement of it)" if skipped else ""
        ready = [n for n in nodes if n.state is NodeState.READY]
        labelled = [n for n in ready if _has_labels(n, spec.required_labels)]
        if not labelled:
            wanted = ", ".join(f"{k}={v}" for k, v in sorted(spec.required_labels.items()))
            return _Refusal(
                PlacementReason.NO_MATCHING_NODE,
                f"no ready node for {spec.id}: {len(nodes)} node(s){aside}, {len(ready)} "
                f"ready, none of them labelled {wanted}"
                if wanted
                else f"no ready node for {spec.id}: {len(nodes)} node(s){aside}, none ready",
            )
        choices = spec.choices()
        engined = [
            (n, choice, engine)
            for n in labelled
            for choice in choices
            if (engine := next((e for e in choice.engines if e in n.engines), None)) is not None
        ]
        if not engined:
            offered = sorted({e for choice in choices for e in choice.engines})
            return _Refusal(
                PlacementReason.ENGINE_UNAVAILABLE,
                f"{len(labelled)} ready node(s) match {spec.id}{aside}, but none offers "
                f"{' or '.join(offered)}",
            )
        suited = [
            (n, choice, engine)
            for n, choice, engine in engined
            if any(choice.runs_on(device) for device in n.devices)
        ]
        if not suited:
            needs = "; ".join(sorted({choice.describe_hardware() for _, choice, _ in engined}))
            return _Refusal(
                PlacementReason.ENGINE_UNAVAILABLE,
                f"{len({n.id for n, _, _ in engined})} ready node(s) match {spec.id} with its "
                f"engine{aside}, but none has a device its variant runs on ({needs})",
            )
        fits: dict[str, _Fit] = {}
        for node, choice, engine in suited:
            if node.id in fits:  # the first choice that fits this node wins
                continue
            devices = self._devices(spec, replica, node, choice)
            if devices is not None:
                fits[node.id] = _Fit(node, devices, engine, choice)
        if not fits:
            sizes = sorted({choice.estimate.total_bytes for _, choice, _ in suited})
            per_node = self.policy.max_replicas_per_node
            return _Refusal(
                PlacementReason.INSUFFICIENT_CAPACITY,
                f"{len({n.id for n, _, _ in suited})} ready node(s) match {spec.id} with its "
                f"engine{aside}, but none has {spec.tensor_parallel} device(s) with "
                f"{' or '.join(str(size) for size in sizes)} bytes free that no other "
                "replica of it holds"
                + (
                    f" (and fewer than {per_node} other replica(s) of it on the node)"
                    if per_node is not None
                    else ""
                ),
            )
        best = min(fits.values(), key=lambda fit: self._score(spec, fit))
        return replace(best, reason=_why(best, fits.values(), self.policy.strategy))

    def _devices(
        self, spec: DeploymentSpec, replica: int, node: NodeView, choice: VariantChoice
    ) -> tuple[int, ...] | None:
        limit = self.policy.max_replicas_per_node
        if limit is not None and self.ledger.other_replicas(spec.id, node.id, replica) >= limit:
            return None
        size = choice.estimate.total_bytes
        held = self.ledger.holders[(spec.id, node.id)]
        free = [
            (device.capacity_bytes - self.ledger.used[(node.id, device.index)], device.index)
            for device in node.devices
            if device.index not in held
            and choice.runs_on(device)
            and device.capacity_bytes - self.ledger.used[(node.id, device.index)] >= size
        ]
        if len(free) < spec.tensor_parallel:
            return None
        if self.policy.strategy is PlacementStrategy.BINPACK:
            free.sort(key=lambda item: (item[0], item[1]))
        else:
            free.sort(key=lambda item: (-item[0], item[1]))
        return tuple(sorted(index for _, index in free[: spec.tensor_parallel]))

    def _score(self, spec: DeploymentSpec, fit: _Fit) -> tuple[object, ...]:
        node = fit.node
        domains = tuple(self._domain_count(spec, key, node) for key in spec.spread_by)
        size = fit.choice.estimate.total_bytes * len(fit.devices)
        total = _capacity(node)
        used = sum(self.ledger.used[(node.id, d.index)] for d in node.devices) + size
        left = Fraction(max(0, total - used), total) if total else Fraction(0)
        cold = not _holds(fit)
        if self.policy.strategy is PlacementStrategy.BINPACK:
            return (domains, cold, left, node.id)
        return (domains, self.ledger.per_node[(spec.id, node.id)], cold, -left, node.id)

    def _domain_count(self, spec: DeploymentSpec, key: str, node: NodeView) -> int:
        value = node.labels.get(key)
        if value is None:
            return 0
        return sum(
            count
            for (deployment, node_id), count in self.ledger.per_node.items()
            if deployment == spec.id
            and node_id in self.nodes
            and self.nodes[node_id].labels.get(key) == value
        )


SPLIT_ENGINE = "llama_cpp"
"""The engine that splits one model over several nodes (its RPC backend)."""


def split_share(estimate: MemoryEstimate, count: int) -> int:
    """Bytes each of ``count`` workers of a split reserves: an even share of the weights,
    KV cache and safety margin, plus its own compute buffer (llama.cpp splits the layers
    over the RPC devices in proportion to their free memory; on equal devices, evenly)."""
    spread = estimate.weight_bytes + estimate.kv_bytes + estimate.safety_margin_bytes
    return -(-spread // count) + estimate.runtime_overhead_bytes


def _holds(fit: _Fit) -> bool:
    digest = fit.choice.artifact_digest
    return digest is not None and digest in fit.node.cached_artifacts


def _size(count: int) -> str:
    """``count`` bytes in words: ``1.0 GiB``, ``512.0 MiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop returns at GiB


def _why(best: _Fit, fits: Iterable[_Fit], strategy: PlacementStrategy) -> str:
    """The sentence of a start or replace decision: locality first, then the strategy."""
    digest = best.choice.artifact_digest
    fits = list(fits)
    fitting = f"{len(fits)} node(s) fit"
    holders = sorted(fit.node.id for fit in fits if _holds(fit))
    if digest is None:
        where = "the artifact is resolved on the node"
    elif _holds(best):
        size = best.node.cached_bytes.get(digest)
        held = f" ({_size(size)})" if size is not None else ""
        where = f"{best.node.id} holds sha256:{digest[:12]}...{held}"
    elif holders:
        where = (
            f"{', '.join(holders)} hold(s) sha256:{digest[:12]}... but run more replicas of "
            f"it (spreading first); {best.node.id} fetches it"
        )
    else:
        where = f"no fitting node holds sha256:{digest[:12]}..., it is fetched"
    return f"{where}; {fitting}, then {strategy.value} picked {best.node.id}"


def _has_labels(node: NodeView, required: Mapping[str, str]) -> bool:
    return all(node.labels.get(key) == value for key, value in required.items())


def _require_distinct(what: str, ids: list[str]) -> None:
    duplicates = sorted({x for x in ids if ids.count(x) > 1})
    if duplicates:
        raise ValueError(f"{what} ids must be distinct; repeated: {', '.join(duplicates)}")


def plan(
    nodes: Sequence[NodeView],
    deployments: Sequence[DeploymentSpec],
    placements: Sequence[PlacementView],
    *,
    policy: PlacementPolicy | None = None,
    frozen: frozenset[str] = frozenset(),
) -> PlacementPlan:
    """Plan the fleet's next safe step (see the module docstring for the rules).

    Args:
        nodes: Every member, with its derived state.
        deployments: The desired deployments (one spec each, at the desired revision).
        placements: Every recorded placement not yet removed.
        policy: Scoring and the re-placement cap; default ``spread``, 2 in flight.
        frozen: Desired deployments the caller could not build a spec for (a catalog
            older than the desired document, a definition it cannot read): their placements
            keep their memory in the plan and get no decision at all -- never stopped as
            ``removed`` (issue 30, item 16).

    Returns:
        A :class:`PlacementPlan`: ``start``/``replace`` decisions, then ``stop``, then
        ``unplaced`` (reason ``no_matching_node``, ``engine_unavailable`` or
        ``insufficient_capacity``) and ``deferred`` (``replacements_capped``,
        ``awaiting_stop``, ``rollout_paced``). Equal inputs give equal plans, whatever their order.

    Raises:
        ValueError: two nodes, deployments or placements share an id (a caller bug).
    """
    return _Planner(nodes, deployments, placements, policy or PlacementPolicy(), frozen).run()
