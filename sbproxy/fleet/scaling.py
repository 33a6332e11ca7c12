"""The controller's autoscaler: the load samples it keeps per deployment and the decisions
it takes from them at each pass (:func:`sbproxy.fleet.autoscale.decide`), over a fleet
snapshot. No I/O: :class:`~sbproxy.fleet.agent.FleetAgent` records each decision
(:func:`~sbproxy.store.fleet_scale.record_scale`) and counts it here when it committed.

One instance per host; only the host that holds the controller lease feeds it. Its samples
are its own: a host that takes the lease over starts with none, and decides nothing on a
window it did not watch (:mod:`sbproxy.fleet.autoscale`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any

from sbproxy.config import DeploymentConfig, ReplicaRange
from sbproxy.fleet.autoscale import LoadFigures, LoadSample, LoadWindow, ScaleDecision, decide
from sbproxy.fleet.routing import replica_deployment_id

__all__ = ["Autoscaled", "Autoscaler", "autoscaled", "in_flight", "scaled_counts"]

_GONE = frozenset({"lost", "left"})


@dataclass(frozen=True)
class Autoscaled:
    """One deployment of the desired state whose ``replicas`` is a range."""

    bounds: ReplicaRange
    target: float
    queue_timeout_ms: int


def autoscaled(document: str | None) -> Mapping[str, Autoscaled]:
    """The autoscaled deployments of a desired-state document (JSON), by id; a definition
    that does not validate is left out (the controller logs it when it plans). Read-only:
    the answer for a document is kept (every heartbeat, scrape and routing rebuild asks)."""
    if document is None:
        return MappingProxyType({})
    return _autoscaled(document)


@lru_cache(maxsize=4)
def _autoscaled(document: str) -> Mapping[str, Autoscaled]:
    found: dict[str, Autoscaled] = {}
    for deployment, body in json.loads(document).get("deployments", {}).items():
        try:
            config = DeploymentConfig.model_validate(body)
        except ValueError:
            continue
        bounds = config.replica_range
        if bounds is not None:
            found[deployment] = Autoscaled(bounds, config.scale_target, config.queue_timeout_ms)
    return MappingProxyType(found)


def scaled_counts(snapshot: Any, scaled: Mapping[str, Autoscaled]) -> dict[str, int]:
    """``{deployment: replicas}`` the fleet is set to run for each autoscaled deployment:
    its last decision's count, else its range's initial count."""
    recorded = {row.deployment: row.replicas for row in snapshot.scales}
    return {d: recorded.get(d, a.bounds.initial()) for d, a in scaled.items()}


def in_flight(snapshot: Any, deployment: str, *, gone: Iterable[str] = ()) -> tuple[int, int, int]:
    """``(requests in flight, replicas placed, replicas ready)`` of ``deployment``: running
    plus queued, as each live node reported its replicas at its last renewal, over its
    placements not being stopped on nodes not in ``gone``."""
    away = set(gone)
    reports = {node.id: node.replicas for node in snapshot.nodes}
    total = placed = ready = 0
    for placement in snapshot.placements:
        if (
            placement.deployment != deployment
            or placement.state == "stopping"
            or placement.node in away
        ):
            continue
        placed += 1
        ready += placement.state == "ready"
        local = replica_deployment_id(placement.deployment, placement.replica)
        report = reports.get(placement.node, {}).get(local) or {}
        total += int(report.get("active") or 0) + int(report.get("queued") or 0)
    return total, placed, ready


class Autoscaler:
    """The samples and tallies of one host's controller (module docstring)."""

    def __init__(self) -> None:
        self._windows: dict[str, LoadWindow] = {}
        self.figures: dict[str, LoadFigures] = {}
        """The figures of each autoscaled deployment at this controller's last pass."""
        self.placed: dict[str, int] = {}
        """Replicas placed (not stopping, on live nodes) at the last pass."""
        self._settled: dict[str, int] = {}
        # {deployment: database time since which every placed replica was ready}
        self.decisions: Counter[tuple[str, str, str]] = Counter()
        """Decisions this host recorded, by ``(deployment, direction, reason)``."""

    def forget(self) -> None:
        """Drop every sample (this host lost the controller lease)."""
        self._windows.clear()
        self.figures.clear()
        self.placed.clear()
        self._settled.clear()

    def decide(
        self, snapshot: Any, scaled: Mapping[str, Autoscaled], *, gone: Iterable[str]
    ) -> list[ScaleDecision]:
        """Sample each autoscaled deployment's load in ``snapshot`` and decide; the
        decisions to record (at most one per deployment).

        Args:
            snapshot: A ``FleetSnapshot`` (database now, nodes, placements, scales,
                demands).
            scaled: :func:`autoscaled` of its desired document.
            gone: Nodes lost or left (their reports do not count).
        """
        gone = frozenset(gone)
        for deployment in set(self._windows) - set(scaled):
            del self._windows[deployment]
            self.figures.pop(deployment, None)
            self.placed.pop(deployment, None)
            self._settled.pop(deployment, None)
        counts = scaled_counts(snapshot, scaled)
        last = {row.deployment: row.decided_at_ms for row in snapshot.scales}
        wanted = {row.deployment for row in snapshot.demands}
        decisions = []
        for deployment, spec in sorted(scaled.items()):
            bounds = spec.bounds
            window = self._windows.get(deployment)
            horizon = max(bounds.window_ms, bounds.scale_down_delay_ms)
            if window is None or window.horizon_ms != horizon:
                window = self._windows[deployment] = LoadWindow(horizon)
            load, placed, ready = in_flight(snapshot, deployment, gone=gone)
            window.add(LoadSample(snapshot.now_ms, load))
            self.placed[deployment] = placed
            # An unplaceable replica does not hold the deployment unsettled: nothing starts.
            if placed == ready:
                self._settled.setdefault(deployment, snapshot.now_ms)
            else:
                self._settled.pop(deployment, None)
            verdict = decide(
                deployment,
                bounds=bounds,
                target=spec.target,
                replicas=counts[deployment],
                samples=window.samples(),
                now_ms=snapshot.now_ms,
                watched_since_ms=window.since_ms,
                last_decision_ms=last.get(deployment),
                demand=deployment in wanted,
                settled_since_ms=self._settled.get(deployment),
            )
            self.figures[deployment] = verdict.figures
            if verdict.decision is not None:
                decisions.append(verdict.decision)
        return decisions

    def recorded(self, decision: ScaleDecision) -> None:
        """Count a decision that committed."""
        key = (decision.deployment, decision.direction.value, decision.reason.value)
        self.decisions[key] += 1
