"""The autoscaler's pure decision (:func:`sbproxy.fleet.autoscale.decide`), driven tick by
tick with an injected database clock: no flapping at the target, panic on a burst, one
replica at a time down after the idle window, never below min, to zero and back on demand."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from sbproxy.config import ReplicaRange
from sbproxy.fleet.autoscale import (
    LoadSample,
    LoadWindow,
    ScaleDecision,
    ScaleReason,
    decide,
)

TICK_MS = 200
RANGE = ReplicaRange(
    min=1, max=4, target=2, window_ms=6_000, panic_window_ms=1_000, scale_down_delay_ms=4_000
)


class Fleet:
    """A controller's view over time: samples each tick, applies each decision at once."""

    def __init__(self, bounds: ReplicaRange = RANGE, *, replicas: int = 1) -> None:
        self.bounds = bounds
        self.replicas = replicas
        self.now = 1_000_000
        self.window = LoadWindow(max(bounds.window_ms, bounds.scale_down_delay_ms))
        self.last: int | None = None
        self.settled: int | None = self.now
        """Every replica ready since (they start at once here)."""
        self.decisions: list[ScaleDecision] = []

    def run(self, ticks: int, load: Callable[[int], int], *, demand: bool = False) -> None:
        for _ in range(ticks):
            self.now += TICK_MS
            self.window.add(LoadSample(self.now, load(self.replicas)))
            verdict = decide(
                "chat",
                bounds=self.bounds,
                target=float(self.bounds.target or 1),
                replicas=self.replicas,
                samples=self.window.samples(),
                now_ms=self.now,
                watched_since_ms=self.window.since_ms,
                last_decision_ms=self.last,
                demand=demand,
                settled_since_ms=self.settled,
            )
            if verdict.decision is not None:
                self.decisions.append(verdict.decision)
                self.replicas = verdict.decision.to_replicas
                self.last = self.now
                demand = False

    def reasons(self) -> list[tuple[int, int, str]]:
        return [(d.from_replicas, d.to_replicas, d.reason.value) for d in self.decisions]


def test_a_steady_load_at_the_target_never_scales() -> None:
    fleet = Fleet(replicas=2)
    fleet.run(500, lambda _: 4)  # 100 s: 2 per replica on 2 replicas, exactly the target
    assert fleet.decisions == []


def test_a_steady_load_at_the_target_from_one_replica_scales_once() -> None:
    fleet = Fleet(replicas=1)
    fleet.run(500, lambda _: 3)  # 3 on one replica: above target 2, under the panic's 4
    assert fleet.reasons() == [(1, 2, "above_target")]
    # At 3 in flight on 2 replicas, 1 would take only 2: it stays at 2 for good.
    assert fleet.replicas == 2


def test_a_noisy_load_around_the_target_decides_at_most_once() -> None:
    fleet = Fleet(replicas=2)
    fleet.run(500, lambda _: 4 + (1 if (fleet.now // TICK_MS) % 3 == 0 else 0))
    assert len(fleet.decisions) <= 1


def test_a_burst_panics_up_within_the_panic_window() -> None:
    fleet = Fleet(replicas=1)
    fleet.run(30, lambda _: 1)  # watched long enough, below target
    fleet.run(5, lambda _: 8)  # 8 in flight: 4 x target on one replica
    # Within the 1 s panic window, without waiting for the 6 s stable window.
    ((was, now, reason),) = fleet.reasons()
    assert (was, reason) == (1, "panic") and now >= 3
    decision = fleet.decisions[0]
    assert decision.figures.panic_per_replica is not None
    assert decision.figures.panic_per_replica >= 2 * 2
    # The stable window then brings it to what 8 in flight need at 2 each, and stays.
    fleet.run(200, lambda _: 8)
    assert fleet.replicas == 4
    assert len(fleet.decisions) <= 2


def test_the_stable_window_scales_up_what_does_not_panic() -> None:
    fleet = Fleet(replicas=2)
    fleet.run(30, lambda _: 5)  # 2.5 per replica: above target, under 2 x target
    assert fleet.reasons() == [(2, 3, "above_target")]


def test_idle_scales_down_one_at_a_time_after_the_delay_never_below_min() -> None:
    fleet = Fleet(replicas=4)
    fleet.run(400, lambda _: 0)
    assert fleet.reasons() == [
        (4, 3, "below_target"),
        (3, 2, "below_target"),
        (2, 1, "below_target"),
    ]
    times = [d.figures.watched_ms for d in fleet.decisions]
    # Each step waits a full scale_down_delay_ms after the previous decision.
    assert all(b - a >= RANGE.scale_down_delay_ms for a, b in itertools.pairwise(times))
    assert fleet.replicas == RANGE.min


def test_a_short_spike_inside_the_delay_holds_the_scale_down() -> None:
    fleet = Fleet(replicas=2)
    fleet.run(15, lambda _: 0)  # 3 s idle: under the 4 s delay
    fleet.run(1, lambda _: 3)  # one sample that 1 replica cannot take at target 2
    fleet.run(15, lambda _: 0)  # 3 s again: the spike is still inside the delay
    assert fleet.decisions == []
    fleet.run(10, lambda _: 0)
    assert fleet.reasons() == [(2, 1, "below_target")]


def test_min_zero_goes_to_zero_when_idle_and_back_on_demand() -> None:
    bounds = RANGE.model_copy(update={"min": 0})
    fleet = Fleet(bounds, replicas=1)
    fleet.run(30, lambda _: 0)
    assert fleet.reasons() == [(1, 0, "idle")]
    fleet.run(50, lambda _: 0)
    assert fleet.replicas == 0  # no demand: stays at zero, no further decision
    fleet.run(1, lambda _: 0, demand=True)
    assert fleet.reasons()[-1] == (0, 1, "demand")
    # Just woken: not scaled down again before the delay has passed since the decision.
    fleet.run(int(bounds.scale_down_delay_ms / TICK_MS) - 1, lambda _: 0)
    assert fleet.replicas == 1


def test_a_request_in_flight_keeps_the_last_replica() -> None:
    bounds = RANGE.model_copy(update={"min": 0})
    fleet = Fleet(bounds, replicas=1)
    fleet.run(100, lambda _: 1)
    assert fleet.decisions == []


def test_a_changed_range_brings_the_count_inside() -> None:
    fleet = Fleet(RANGE.model_copy(update={"min": 2, "max": 3}), replicas=4)
    fleet.run(1, lambda _: 0)
    assert fleet.reasons() == [(4, 3, "bounds")]
    fleet = Fleet(RANGE.model_copy(update={"min": 2, "max": 3}), replicas=1)
    fleet.run(1, lambda _: 0)
    assert fleet.reasons() == [(1, 2, "bounds")]


def test_a_new_controller_decides_nothing_on_a_window_it_did_not_watch() -> None:
    window = LoadWindow(10_000)
    window.add(LoadSample(1_000, 100))
    verdict = decide(
        "chat", bounds=RANGE, target=2, replicas=1, samples=window.samples(), now_ms=1_000,
        watched_since_ms=window.since_ms, last_decision_ms=None,
    )  # fmt: skip
    assert verdict.decision is None
    assert verdict.figures.panic_in_flight == 100


def test_the_figures_are_per_replica_over_each_window() -> None:
    samples = [LoadSample(t, v) for t, v in ((1_000, 2), (5_500, 6), (6_000, 10))]
    verdict = decide(
        "chat", bounds=RANGE, target=100, replicas=2, samples=samples, now_ms=6_000,
        watched_since_ms=0, last_decision_ms=6_000,
    )  # fmt: skip
    figures = verdict.figures
    assert (figures.stable_in_flight, figures.panic_in_flight) == (6.0, 8.0)
    assert (figures.stable_per_replica, figures.panic_per_replica) == (3.0, 4.0)
    assert (figures.peak_in_flight, figures.samples) == (10, 3)
    assert verdict.decision is None


def test_a_sample_older_than_the_newest_is_dropped() -> None:
    window = LoadWindow(1_000)
    window.add(LoadSample(2_000, 1))
    window.add(LoadSample(1_500, 9))
    window.add(LoadSample(3_500, 2))
    assert window.samples() == (LoadSample(3_500, 2),)


@pytest.mark.parametrize(("target", "replicas"), [(0.0, 1), (1.0, -1)])
def test_bad_inputs_are_a_caller_bug(target: float, replicas: int) -> None:
    with pytest.raises(ValueError, match="target > 0"):
        decide(
            "chat", bounds=RANGE, target=target, replicas=replicas, samples=(), now_ms=0,
            watched_since_ms=None, last_decision_ms=None,
        )  # fmt: skip


def test_every_reason_has_a_stable_value() -> None:
    assert {r.value for r in ScaleReason} == {
        "bounds", "demand", "panic", "above_target", "below_target", "idle",
    }  # fmt: skip


def test_no_scale_down_while_a_replica_is_still_starting() -> None:
    bounds = RANGE.model_copy(update={"min": 0})
    fleet = Fleet(bounds, replicas=1)
    fleet.settled = None  # its placement is not ready: requests may wait for it, unseen
    fleet.run(100, lambda _: 0)
    assert fleet.decisions == []
    fleet.settled = fleet.now  # ready now: the idle window counts from here
    fleet.run(int(bounds.scale_down_delay_ms / TICK_MS) - 1, lambda _: 0)
    assert fleet.decisions == []
    fleet.run(2, lambda _: 0)
    assert fleet.reasons() == [(1, 0, "idle")]
