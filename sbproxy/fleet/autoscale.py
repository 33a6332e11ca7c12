"""How many replicas an autoscaled deployment needs, as a pure function of the load seen.

The controller samples, at each of its passes, the requests in flight (running and queued)
over every replica of a deployment whose ``replicas`` is a range
(:class:`~sbproxy.config.ReplicaRange`), as the nodes reported them with their heartbeats;
:class:`LoadWindow` keeps those samples and :func:`decide` turns them into at most one
decision. Nothing here does I/O or reads a clock: database time comes in (``now_ms``), so
a table test drives it tick by tick.

The rules (after Knative's KPA, which KServe uses; ``target`` is requests in flight per
replica, every average is fleet-wide and divided by the replicas the fleet is set to run):

* **Bounds.** A count outside ``[min, max]`` (the range was changed by ``apply``) is
  brought inside at once (``bounds``).
* **Demand from zero.** At zero replicas, a request that a gateway recorded as demand
  scales to one (``demand``).
* **Panic.** When the average over ``panic_window_ms`` reaches ``panic_threshold`` times
  the target per replica, the count goes at once to what that average needs (``panic``).
* **Scale up.** When the average over ``window_ms`` exceeds the target per replica, the
  count goes to ``ceil(average / target)`` (``above_target``), at most ``max``.
* **Scale down, one at a time.** When every sample of the last ``scale_down_delay_ms`` fits
  in one replica fewer at the target, the last decision is at least that old, and every
  replica has been ready at least that long, one replica goes (``below_target``), never
  below ``min``; the last one (``min: 0``) only after that long with no request in flight at
  all (``idle``).

Nothing is decided on a window this controller has not watched: a panic or a scale-up
needs ``panic_window_ms`` of samples, a scale-down ``scale_down_delay_ms`` of them (a
controller that just took over starts with none). A steady load at the target never
scales: up needs the average *above* the target, down needs the load to fit one replica
fewer -- the gap between the two is the hysteresis that keeps the count still.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from sbproxy.config import ReplicaRange

__all__ = [
    "LoadFigures",
    "LoadSample",
    "LoadWindow",
    "ScaleDecision",
    "ScaleDirection",
    "ScaleReason",
    "ScaleVerdict",
    "decide",
]


class ScaleReason(StrEnum):
    """Why the replica count of a deployment changed (the ``reason`` of a ``fleet.scale``
    job and of ``sbproxy_fleet_scale_decisions_total``)."""

    BOUNDS = "bounds"
    DEMAND = "demand"
    PANIC = "panic"
    ABOVE_TARGET = "above_target"
    BELOW_TARGET = "below_target"
    IDLE = "idle"


class ScaleDirection(StrEnum):
    """Which way a decision goes."""

    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The requests in flight (running plus queued) over every replica of one deployment,
    as reported at database time ``at_ms``."""

    at_ms: int
    in_flight: int


class LoadWindow:
    """The samples of one deployment this controller took, oldest first, kept for
    ``horizon_ms`` (the longest window that reads them).

    Args:
        horizon_ms: How far back samples are kept, in milliseconds.
    """

    def __init__(self, horizon_ms: int) -> None:
        self.horizon_ms = horizon_ms
        self._samples: deque[LoadSample] = deque()
        self.since_ms: int | None = None
        """Database time of the first sample this controller took (the start of what it
        watched)."""

    def add(self, sample: LoadSample) -> None:
        """Append ``sample`` (a sample older than the newest one is dropped: time moves
        forward only) and forget those older than the horizon."""
        if self._samples and sample.at_ms < self._samples[-1].at_ms:
            return
        if self.since_ms is None:
            self.since_ms = sample.at_ms
        self._samples.append(sample)
        while self._samples and self._samples[0].at_ms < sample.at_ms - self.horizon_ms:
            self._samples.popleft()

    def samples(self) -> tuple[LoadSample, ...]:
        """The samples kept, oldest first."""
        return tuple(self._samples)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoadFigures(_Frozen):
    """What :func:`decide` saw (the input recorded with a ``fleet.scale`` job, and the
    figures of ``sbproxy_fleet_autoscale_load``).

    Attributes:
        replicas: The count the fleet was set to run.
        target: Requests in flight per replica aimed at.
        stable_in_flight: Mean requests in flight, fleet-wide, over ``window_ms``
            (``None``: no sample in it).
        panic_in_flight: The same over ``panic_window_ms``.
        stable_per_replica: ``stable_in_flight`` per replica (over one replica at zero).
        panic_per_replica: ``panic_in_flight`` per replica.
        peak_in_flight: The most requests in flight in one sample of the last
            ``scale_down_delay_ms``.
        samples: Samples in the stable window.
        watched_ms: How long this controller has sampled the deployment.
    """

    replicas: int
    target: float
    stable_in_flight: float | None
    panic_in_flight: float | None
    stable_per_replica: float | None
    panic_per_replica: float | None
    peak_in_flight: int | None
    samples: int
    watched_ms: int


class ScaleDecision(_Frozen):
    """One change of a deployment's replica count, with the figures that drove it."""

    deployment: str
    from_replicas: int
    to_replicas: int
    reason: ScaleReason
    direction: ScaleDirection
    message: str
    figures: LoadFigures


class ScaleVerdict(_Frozen):
    """:func:`decide`'s answer: the figures always, a decision when the count must
    change."""

    figures: LoadFigures
    decision: ScaleDecision | None = None


def _mean(samples: Iterable[LoadSample]) -> float | None:
    values = [s.in_flight for s in samples]
    return sum(values) / len(values) if values else None


def _per(total: float | None, replicas: int) -> float | None:
    return None if total is None else total / max(replicas, 1)


def decide(
    deployment: str,
    *,
    bounds: ReplicaRange,
    target: float,
    replicas: int,
    samples: Iterable[LoadSample],
    now_ms: int,
    watched_since_ms: int | None,
    last_decision_ms: int | None,
    demand: bool = False,
    settled_since_ms: int | None = None,
) -> ScaleVerdict:
    """The replica count ``deployment`` needs now (module docstring for the rules).

    Args:
        deployment: Its id.
        bounds: Its ``replicas`` range.
        target: Requests in flight per replica (``DeploymentConfig.scale_target``), > 0.
        replicas: The count the fleet is set to run now (>= 0).
        samples: Its load samples (:class:`LoadWindow`), oldest first; those after
            ``now_ms`` are ignored.
        now_ms: Database now.
        watched_since_ms: When this controller took its first sample of it (``None``:
            none yet).
        last_decision_ms: Database time of its last ``fleet.scale`` decision (``None``:
            none).
        demand: A gateway asked for a replica while it had none.
        settled_since_ms: Since when every placed replica has been ready (``None``: one
            is still being placed or started; one no node can take does not count, nothing
            starts). A scale-down needs
            ``scale_down_delay_ms`` of it: a replica that is still starting has not shown
            whether it is needed (requests wait for it at the gateways, unseen).

    Returns:
        The figures, and the decision when the count changes (by one step for a
        scale-down; to what the load needs for a scale-up).

    Raises:
        ValueError: ``target`` <= 0 or ``replicas`` < 0 (a caller bug).
    """
    if not target > 0 or replicas < 0:
        raise ValueError(f"need target > 0 and replicas >= 0, got {target}, {replicas}")
    seen = [s for s in samples if s.at_ms <= now_ms]
    stable = [s for s in seen if s.at_ms > now_ms - bounds.window_ms]
    panic = [s for s in seen if s.at_ms > now_ms - bounds.panic_window_ms]
    recent = [s for s in seen if s.at_ms > now_ms - bounds.scale_down_delay_ms]
    watched = 0 if watched_since_ms is None else max(0, now_ms - watched_since_ms)
    stable_mean, panic_mean = _mean(stable), _mean(panic)
    figures = LoadFigures(
        replicas=replicas,
        target=target,
        stable_in_flight=stable_mean,
        panic_in_flight=panic_mean,
        stable_per_replica=_per(stable_mean, replicas),
        panic_per_replica=_per(panic_mean, replicas),
        peak_in_flight=max((s.in_flight for s in recent), default=None),
        samples=len(stable),
        watched_ms=watched,
    )

    step = _step(
        bounds,
        target=target,
        replicas=replicas,
        demand=demand,
        stable_mean=stable_mean if watched >= bounds.panic_window_ms else None,
        panic_mean=panic_mean if watched >= bounds.panic_window_ms else None,
        peak=figures.peak_in_flight if watched >= bounds.scale_down_delay_ms else None,
        quiet=(last_decision_ms is None or now_ms - last_decision_ms >= bounds.scale_down_delay_ms)
        and settled_since_ms is not None
        and now_ms - settled_since_ms >= bounds.scale_down_delay_ms,
    )
    if step is None:
        return ScaleVerdict(figures=figures)
    to, reason, message = step
    return ScaleVerdict(
        figures=figures,
        decision=ScaleDecision(
            deployment=deployment,
            from_replicas=replicas,
            to_replicas=to,
            reason=reason,
            direction=ScaleDirection.UP if to > replicas else ScaleDirection.DOWN,
            message=message,
            figures=figures,
        ),
    )


def _step(
    bounds: ReplicaRange,
    *,
    target: float,
    replicas: int,
    demand: bool,
    stable_mean: float | None,
    panic_mean: float | None,
    peak: int | None,
    quiet: bool,
) -> tuple[int, ScaleReason, str] | None:
    """The rules of the module docstring, in order; ``None`` keeps the count. A mean or
    peak is ``None`` when its window was not watched long enough."""
    if replicas < bounds.min or replicas > bounds.max:
        to = min(max(replicas, bounds.min), bounds.max)
        return to, ScaleReason.BOUNDS, f"{replicas} is outside [{bounds.min}, {bounds.max}]"
    if replicas == 0:
        if demand:
            return 1, ScaleReason.DEMAND, "a request came for a deployment at zero"
        return None
    up = _up(bounds, target=target, replicas=replicas, stable=stable_mean, panic=panic_mean)
    if up is not None or replicas <= bounds.min or not quiet or peak is None:
        return up
    return _down(bounds, target=target, replicas=replicas, peak=peak)


def _down(
    bounds: ReplicaRange, *, target: float, replicas: int, peak: int
) -> tuple[int, ScaleReason, str] | None:
    """One replica fewer when ``peak`` (the most in flight over the delay) fits in it; the
    last one only when nothing was in flight."""
    if replicas == 1:
        if peak > 0:
            return None
        return 0, ScaleReason.IDLE, f"no request in flight for {bounds.scale_down_delay_ms} ms"
    if peak > target * (replicas - 1):
        return None
    return (
        replicas - 1,
        ScaleReason.BELOW_TARGET,
        f"at most {peak} in flight for {bounds.scale_down_delay_ms} ms, which "
        f"{replicas - 1} replica(s) take at target {target:g}",
    )


def _up(
    bounds: ReplicaRange,
    *,
    target: float,
    replicas: int,
    stable: float | None,
    panic: float | None,
) -> tuple[int, ScaleReason, str] | None:
    """A panic or stable scale-up of ``replicas`` (>= 1), or ``None``."""
    if panic is not None and panic / replicas >= bounds.panic_threshold * target:
        need = min(bounds.max, math.ceil(panic / target))
        if need > replicas:
            return (
                need,
                ScaleReason.PANIC,
                f"{panic:.2f} in flight over the panic window, {panic / replicas:.2f} per "
                f"replica >= {bounds.panic_threshold:g} x target {target:g}",
            )
    if stable is not None and stable / replicas > target:
        need = min(bounds.max, math.ceil(stable / target))
        if need > replicas:
            return (
                need,
                ScaleReason.ABOVE_TARGET,
                f"{stable:.2f} in flight over the stable window, {stable / replicas:.2f} per "
                f"replica > target {target:g}",
            )
    return None
