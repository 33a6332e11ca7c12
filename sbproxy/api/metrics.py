"""Prometheus metrics of the model host, read from the runtime manager at scrape time.

Names and labels follow reference section 9:

* ``sbproxy_model_host_active_requests{deployment}`` and ``_queued_requests{deployment}``
  (gauges, from the admission gates);
* ``sbproxy_model_host_deployment_state{deployment,engine,state}`` (one-hot gauge: 1 for
  the current state, 0 for every other state);
* ``sbproxy_model_host_admission_rejections_total{deployment,priority,reason}`` (counter,
  counted by the gateway where it meets a refusal);
* ``sbproxy_model_host_resident_models`` (gauge: deployments with a ready engine);
* ``sbproxy_model_host_deployment_transitions_total{deployment,from,to}`` (counter: every
  checked state change the runtime made) and ``sbproxy_model_host_swap_wait_seconds``
  (histogram: how long launches waited for a busy resident generation to go idle);
* GPU gauges ``sbproxy_model_host_gpu_vram_bytes{device,kind}`` (``total``/``free``),
  ``_gpu_memory_occupancy{device}`` (used/total) and ``_gpu_utilization{device}`` (compute
  activity, 0..1) -- only for devices NVML reports; utilization is absent when the driver
  does not report it, never zero, and is never derived from memory occupancy.

Gateway and job metrics (this project's own names, outside the reference's table):

* ``sbproxy_gateway_tokens_total{key,kind}`` (counter): tokens of answered gateway requests
  by key name (``(keyless)`` without keys) and ``kind`` (``prompt``/``completion``), since
  the process started, read from the usage ledger;
* ``sbproxy_gateway_client_disconnects_total{deployment}`` (counter): gateway requests whose
  client went away before its answer ended -- while queued for admission, while the engine
  worked on a plain answer, or in the middle of a stream (counted by the gateway);
* ``sbproxy_gateway_peer_requests_total{deployment,node,outcome}`` (counter): each try this
  gateway made at a peer host's replica (peer dispatch, :mod:`sbproxy.api.peers`), by how it
  ended: ``answered``, ``refused`` (429/502/503, the next replica tried), ``unauthorized``
  (it refused the fleet credential; out of rotation, the next replica tried),
  ``unreachable`` (no connection opened, nothing sent; out of rotation, the next replica
  tried), ``lost`` (the connection failed after the request was sent, before a whole
  answer; out of rotation, never sent again), ``cut`` (its stream failed after the first
  byte), ``timed_out``, ``client_gone``;
  ``sbproxy_gateway_peer_spills_total{deployment,reason}`` (counter): requests this host's
  own replica refused before any byte reached the client (``reason``: the refusal's code,
  e.g. ``queue_full``, ``upstream_unavailable``) and that went to a peer's replica instead
  (spill-over; the tries themselves count above); and
  ``sbproxy_gateway_peers_out_of_rotation`` (gauge): peers this gateway keeps out of its
  rotation now; ``sbproxy_gateway_prefix_routes_total{deployment,outcome}`` (counter):
  client requests of ``routing: prefix`` deployments by how their replica was found
  (:mod:`sbproxy.api.prefix_route`: ``first_choice`` -- a hit --, ``load_bound`` and
  ``no_prefix`` -- the fall-backs) -- all only on a host with a fleet;
* ``sbproxy_jobs_total{workflow,status}`` (counter): jobs this process brought to a terminal
  status (``succeeded``, ``failed``, ``cancelled``);
* ``sbproxy_job_duration_seconds{workflow}`` (histogram): seconds from a job's first start
  to its end, for jobs that ran;
* ``sbproxy_journal_write_wait_seconds`` (histogram): how long each journal write of this
  process waited before its transaction began -- behind this process's other writes, then
  for another process's write lock -- and ``sbproxy_journal_commit_seconds`` (each
  ``COMMIT``, the fsync: the disk's share) with ``sbproxy_journal_write_group_size`` (writes
  per commit). A wait that grows while commits stay short is a busy journal (another
  process, a burst of jobs); commits that grow are a slow disk.

Job tallies are kept by the job store as each terminal write commits
(:class:`~sbproxy.store.JobOutcomes`), so a scrape reads memory, never the journal.

Each app gets its own :class:`~prometheus_client.CollectorRegistry`, so several apps (tests)
never collide in the process-global registry.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sbproxy.api.peers import PeerDispatch
from sbproxy.api.usage import UsageLedger
from sbproxy.errors import SbproxyError
from sbproxy.fleet.agent import FleetAgent
from sbproxy.fleet.membership import NodeState
from sbproxy.model_host.runtime import DeviceInfo, probe_devices
from sbproxy.model_host.runtime.manager import RuntimeManager
from sbproxy.model_host.runtime.state import DeploymentState
from sbproxy.model_host.service import ModelHostService

__all__ = ["Disconnects", "Rejections", "build_registry"]

logger = logging.getLogger(__name__)

PREFIX = "sbproxy_model_host"


class Rejections:
    """Admission refusals seen by the gateway, by (deployment, priority, reason)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()

    def record(self, *, deployment: str, priority: str, reason: str) -> None:
        """Count one refusal."""
        self.counts[(deployment, priority, reason)] += 1


class Disconnects:
    """Gateway requests whose client went away before the answer ended, by deployment."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def record(self, deployment: str) -> None:
        """Count one request abandoned by its client."""
        self.counts[deployment] += 1


class _HostCollector(Collector):
    def __init__(
        self,
        manager: RuntimeManager,
        rejections: Rejections,
        devices: Callable[[], Sequence[DeviceInfo]],
    ) -> None:
        self.manager = manager
        self.rejections = rejections
        self.devices = devices

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            f"{PREFIX}_active_requests",
            "Requests holding an admission permit.",
            labels=["deployment"],
        )
        queued = GaugeMetricFamily(
            f"{PREFIX}_queued_requests", "Requests waiting for admission.", labels=["deployment"]
        )
        state = GaugeMetricFamily(
            f"{PREFIX}_deployment_state",
            "Lifecycle state of each deployment (one-hot).",
            labels=["deployment", "engine", "state"],
        )
        resident = 0
        for status in self.manager.status():
            active.add_metric([status.deployment], status.active_requests)
            queued.add_metric([status.deployment], status.queued_requests)
            engine = status.engine or status.configured_engine
            for candidate in DeploymentState:
                state.add_metric(
                    [status.deployment, engine, candidate.value],
                    1.0 if candidate == status.state else 0.0,
                )
            resident += status.state == DeploymentState.READY
        yield active
        yield queued
        yield state
        yield GaugeMetricFamily(
            f"{PREFIX}_resident_models", "Deployments with a ready engine.", value=resident
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_admission_rejections",
            "Requests refused admission, by reason.",
            labels=["deployment", "priority", "reason"],
        )
        for (deployment, priority, reason), count in sorted(self.rejections.counts.items()):
            rejected.add_metric([deployment, priority, reason], count)
        yield rejected
        yield from self._gpus()

    def _gpus(self) -> Iterator[Metric]:
        try:
            devices = list(self.devices())
        except SbproxyError as exc:
            logger.warning("GPU probe failed: %s", exc)
            return
        if not devices:
            return
        vram = GaugeMetricFamily(
            f"{PREFIX}_gpu_vram_bytes", "GPU memory in bytes.", labels=["device", "kind"]
        )
        occupancy = GaugeMetricFamily(
            f"{PREFIX}_gpu_memory_occupancy",
            "Used GPU memory as a fraction of total (not compute activity).",
            labels=["device"],
        )
        utilization = GaugeMetricFamily(
            f"{PREFIX}_gpu_utilization",
            "GPU compute utilization, 0..1, as the driver reports it.",
            labels=["device"],
        )
        reported = False
        for device in devices:
            index = str(device.index)
            vram.add_metric([index, "total"], device.total_bytes)
            vram.add_metric([index, "free"], device.free_bytes)
            occupancy.add_metric([index], device.memory_occupancy)
            if device.utilization_percent is not None:
                utilization.add_metric([index], device.utilization_percent / 100)
                reported = True
        yield vram
        yield occupancy
        if reported:
            yield utilization


class _UsageCollector(Collector):
    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "sbproxy_gateway_tokens",
            "Tokens of answered gateway requests, by key name and kind (prompt, completion).",
            labels=["key", "kind"],
        )
        for (key, kind), count in sorted(self.ledger.tokens_since_start().items()):
            tokens.add_metric([key, kind], count)
        yield tokens


class _RuntimeCollector(Collector):
    def __init__(self, manager: RuntimeManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        tallies = self.manager.tallies_snapshot()
        transitions = CounterMetricFamily(
            f"{PREFIX}_deployment_transitions",
            "Deployment state changes the runtime made, by deployment and states.",
            labels=["deployment", "from", "to"],
        )
        for (deployment, before, after), count in sorted(tallies.transitions.items()):
            transitions.add_metric([deployment, before, after], count)
        yield transitions
        waits = HistogramMetricFamily(
            f"{PREFIX}_swap_wait_seconds",
            "Seconds a launch waited for a busy resident generation to go idle.",
        )
        histogram = tallies.swap_waits
        waits.add_metric([], buckets=histogram.cumulative(), sum_value=histogram.total_s)
        yield waits


class _DisconnectCollector(Collector):
    def __init__(self, disconnects: Disconnects) -> None:
        self.disconnects = disconnects

    def collect(self) -> Iterator[Metric]:
        counted = CounterMetricFamily(
            "sbproxy_gateway_client_disconnects",
            "Gateway requests whose client went away before the answer ended, by deployment.",
            labels=["deployment"],
        )
        for deployment, count in sorted(self.disconnects.counts.items()):
            counted.add_metric([deployment], count)
        yield counted


class _PeerCollector(Collector):
    def __init__(self, peers: PeerDispatch) -> None:
        self.peers = peers

    def collect(self) -> Iterator[Metric]:
        tries = CounterMetricFamily(
            "sbproxy_gateway_peer_requests",
            "Tries at peer hosts' replicas (peer dispatch), by deployment, node and outcome.",
            labels=["deployment", "node", "outcome"],
        )
        for (deployment, node, outcome), count in sorted(self.peers.tries.items()):
            tries.add_metric([deployment, node, outcome], count)
        yield tries
        spills = CounterMetricFamily(
            "sbproxy_gateway_peer_spills",
            "Requests this host's own replica refused before any byte reached the client and "
            "that went to a peer's replica instead (spill-over), by deployment and refusal.",
            labels=["deployment", "reason"],
        )
        for (deployment, reason), count in sorted(self.peers.spills.items()):
            spills.add_metric([deployment, reason], count)
        yield spills
        prefix = CounterMetricFamily(
            "sbproxy_gateway_prefix_routes",
            "Client requests of routing: prefix deployments, by deployment and outcome: "
            "first_choice (the replica most likely holding the prefix), load_bound (it was at "
            "its load bound: the next in rendezvous order), no_prefix (nothing to key on: "
            "least outstanding).",
            labels=["deployment", "outcome"],
        )
        for (deployment, outcome), count in sorted(self.peers.prefix_routes.items()):
            prefix.add_metric([deployment, outcome], count)
        yield prefix
        yield GaugeMetricFamily(
            "sbproxy_gateway_peers_out_of_rotation",
            "Peer hosts this gateway keeps out of its rotation now (they failed a request "
            "before answering).",
            value=len(self.peers.out_now()),
        )


class _JobCollector(Collector):
    def __init__(self, service: ModelHostService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        counts, histograms = self.service.job_outcomes()
        jobs = CounterMetricFamily(
            "sbproxy_jobs",
            "Jobs brought to a terminal status by this process, by workflow and status.",
            labels=["workflow", "status"],
        )
        for (workflow, status), count in sorted(counts.items()):
            jobs.add_metric([workflow, status], count)
        yield jobs
        durations = HistogramMetricFamily(
            "sbproxy_job_duration_seconds",
            "Seconds from a job's first start to its end, by workflow.",
            labels=["workflow"],
        )
        for workflow, histogram in sorted(histograms.items()):
            durations.add_metric(
                [workflow], buckets=histogram.cumulative(), sum_value=histogram.total_s
            )
        yield durations


class _JournalCollector(Collector):
    """The journal writer's contention: a busy host shows in the wait, a slow disk in the
    commit, and how many writes shared each commit in the group size."""

    def __init__(self, service: ModelHostService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        waits, commits, groups = self.service.journal_writes()
        for name, text, histogram in (
            (
                "sbproxy_journal_write_wait_seconds",
                "Seconds a journal write waited before its transaction began (queued behind "
                "this process's other writes, then for another process's lock).",
                waits,
            ),
            (
                "sbproxy_journal_commit_seconds",
                "Seconds each journal COMMIT took (the fsync under synchronous=FULL).",
                commits,
            ),
            (
                "sbproxy_journal_write_group_size",
                "Journal writes made durable by one COMMIT (group commit).",
                groups,
            ),
        ):
            family = HistogramMetricFamily(name, text)
            family.add_metric([], buckets=histogram.cumulative(), sum_value=histogram.total_s)
            yield family


class _FleetCollector(Collector):
    """The fleet as this host saw it at its last heartbeat (no database read at scrape)."""

    def __init__(self, agent: FleetAgent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        nodes = GaugeMetricFamily(
            "sbproxy_fleet_nodes", "Fleet members by state (database time).", labels=["state"]
        )
        by_state = Counter(view.state.value for view in agent.views)
        for state in NodeState:
            nodes.add_metric([state.value], by_state.get(state.value, 0))
        yield nodes
        desired = GaugeMetricFamily(
            "sbproxy_fleet_replicas_desired",
            "Replicas wanted, by deployment.",
            labels=["deployment"],
        )
        ready = GaugeMetricFamily(
            "sbproxy_fleet_replicas_ready",
            "Replicas placed, ready and on a live node, with their engine running, by deployment.",
            labels=["deployment"],
        )
        idle = GaugeMetricFamily(
            "sbproxy_fleet_replicas_idle",
            "Replicas placed and ready on a live node whose engine keep-alive stopped (the "
            "next request loads it), by deployment.",
            labels=["deployment"],
        )
        for deployment, (want, have, resting) in sorted(agent.replica_counts().items()):
            desired.add_metric([deployment], want)
            ready.add_metric([deployment], have)
            idle.add_metric([deployment], resting)
        yield desired
        yield ready
        yield idle
        moves = CounterMetricFamily(
            "sbproxy_fleet_node_transitions",
            "Node state changes this host recorded as the controller.",
            labels=["from_state", "to_state"],
        )
        for (old, new), count in sorted(agent.node_transitions.items()):
            moves.add_metric([old, new], count)
        yield moves
        yield CounterMetricFamily(
            "sbproxy_fleet_replacements",
            "Replicas this host re-placed from gone nodes as the controller.",
            value=agent.replacements,
        )
        stuck = CounterMetricFamily(
            "sbproxy_fleet_stuck_replacements",
            "Placements this host moved off their node as the controller because they were "
            "stuck or failed there, by reason (placement_timeout, crash_loop, load_failed).",
            labels=["reason"],
        )
        for reason, count in sorted(agent.stuck_replacements.items()):
            stuck.add_metric([reason], count)
        yield stuck
        yield GaugeMetricFamily(
            "sbproxy_fleet_stuck_staying",
            "Stuck placements no other node takes, at this controller's last pass.",
            value=len(agent.stuck_staying),
        )
        yield CounterMetricFamily(
            "sbproxy_fleet_placements",
            "Placements this host recorded as the controller (re-placements included).",
            value=agent.placements_made,
        )
        yield from _autoscale_metrics(agent)
        yield GaugeMetricFamily(
            "sbproxy_fleet_controller",
            "1 while this host holds the controller lease.",
            value=1 if agent.holding is not None else 0,
        )
        yield GaugeMetricFamily(
            "sbproxy_fleet_fenced",
            "1 while this host has fenced itself.",
            value=1 if agent.fenced else 0,
        )


def _autoscale_metrics(agent: FleetAgent) -> Iterator[Metric]:
    """The autoscaled deployments: desired and current replicas (every host, at its last
    heartbeat), the load per replica and the decisions (the controller's own)."""
    desired = GaugeMetricFamily(
        "sbproxy_fleet_autoscale_replicas_desired",
        "Replicas the last scaling decision set, by autoscaled deployment.",
        labels=["deployment"],
    )
    current = GaugeMetricFamily(
        "sbproxy_fleet_autoscale_replicas_current",
        "Replicas placed and not being stopped on live nodes, by autoscaled deployment.",
        labels=["deployment"],
    )
    for deployment, (want, have) in sorted(agent.autoscale_counts().items()):
        desired.add_metric([deployment], want)
        current.add_metric([deployment], have)
    yield desired
    yield current
    load = GaugeMetricFamily(
        "sbproxy_fleet_autoscale_load",
        "Mean requests in flight (running and queued) per replica over the stable or the "
        "panic window, as this host's controller last sampled them.",
        labels=["deployment", "window"],
    )
    for deployment, figures in sorted(agent.scaler.figures.items()):
        for window, value in (
            ("stable", figures.stable_per_replica),
            ("panic", figures.panic_per_replica),
        ):
            if value is not None:
                load.add_metric([deployment, window], value)
    yield load
    decisions = CounterMetricFamily(
        "sbproxy_fleet_scale_decisions",
        "Scaling decisions this host recorded as the controller (fleet.scale jobs), by "
        "deployment, direction (up, down) and reason.",
        labels=["deployment", "direction", "reason"],
    )
    for (deployment, direction, reason), count in sorted(agent.scaler.decisions.items()):
        decisions.add_metric([deployment, direction, reason], count)
    yield decisions


def build_registry(
    manager: RuntimeManager,
    rejections: Rejections,
    *,
    usage: UsageLedger | None = None,
    disconnects: Disconnects | None = None,
    peers: PeerDispatch | None = None,
    devices: Callable[[], Sequence[DeviceInfo]] = probe_devices,
    fleet: FleetAgent | None = None,
) -> CollectorRegistry:
    """A registry whose collectors read ``manager`` (and NVML), the job store's tallies, and
    the gateway's usage ledger, client disconnects and peer dispatch (when given) at each
    scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_HostCollector(manager, rejections, devices))
    # Only the journal's tallies are read there, which a reload does not change.
    journal = ModelHostService.serving(manager)
    registry.register(_JobCollector(journal))
    registry.register(_JournalCollector(journal))
    registry.register(_RuntimeCollector(manager))
    if usage is not None:
        registry.register(_UsageCollector(usage))
    if disconnects is not None:
        registry.register(_DisconnectCollector(disconnects))
    if peers is not None:
        registry.register(_PeerCollector(peers))
    if fleet is not None:
        registry.register(_FleetCollector(fleet))
    return registry
