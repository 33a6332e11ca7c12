"""The controller's sampler over a fleet snapshot (:mod:`sbproxy.fleet.scaling`): what
counts as load, which deployments are autoscaled, and the count each is set to run."""

from __future__ import annotations

import json
from types import SimpleNamespace

from sbproxy.fleet.scaling import Autoscaler, autoscaled, in_flight, scaled_counts

RANGE = {"min": 0, "max": 3, "target": 2, "window_ms": 1_000, "panic_window_ms": 400}
DOCUMENT = json.dumps(
    {
        "deployments": {
            "chat": {"model": "m", "variant": "v", "replicas": RANGE},
            "fixed": {"model": "m", "replicas": 1},
        }
    }
)


def placement(node: str, replica: int, state: str = "ready") -> SimpleNamespace:
    return SimpleNamespace(deployment="chat", replica=replica, node=node, state=state)


def snapshot(now_ms: int, **extra: object) -> SimpleNamespace:
    base: dict[str, object] = {
        "now_ms": now_ms,
        "nodes": [
            SimpleNamespace(id="a", replicas={"chat": {"active": 2, "queued": 3}}),
            SimpleNamespace(id="b", replicas={"chat.r1": {"active": 1, "queued": 0}}),
            SimpleNamespace(id="c", replicas={"chat.r2": {"active": 4, "queued": 4}}),
        ],
        "placements": [placement("a", 0), placement("b", 1), placement("c", 2, "stopping")],
        "scales": [],
        "demands": [],
    }
    return SimpleNamespace(**(base | extra))


def test_only_ranges_are_autoscaled_with_the_target_and_queue_timeout() -> None:
    found = autoscaled(DOCUMENT)
    assert set(found) == {"chat"}
    assert (found["chat"].target, found["chat"].queue_timeout_ms) == (2.0, 30_000)
    assert autoscaled(None) == {}


def test_load_is_running_plus_queued_over_placements_not_stopping_on_live_nodes() -> None:
    assert in_flight(snapshot(0), "chat") == (6, 2, 2)
    assert in_flight(snapshot(0), "chat", gone=["b"]) == (5, 1, 1)


def test_the_count_is_the_last_decision_s_else_the_initial_one() -> None:
    scaled = autoscaled(DOCUMENT)
    assert scaled_counts(snapshot(0), scaled) == {"chat": 1}
    row = SimpleNamespace(deployment="chat", replicas=3, decided_at_ms=0)
    assert scaled_counts(snapshot(0, scales=[row]), scaled) == {"chat": 3}


def test_the_sampler_decides_once_it_watched_the_panic_window() -> None:
    scaler = Autoscaler()
    scaled = autoscaled(DOCUMENT)
    # 6 in flight on the 1 replica it is set to run, target 2: 6 >= 2 x target, a burst.
    assert scaler.decide(snapshot(0), scaled, gone=()) == []
    (decision,) = scaler.decide(snapshot(500), scaled, gone=())
    assert (decision.from_replicas, decision.to_replicas, decision.reason.value) == (
        1, 3, "panic",
    )  # fmt: skip
    assert scaler.figures["chat"].stable_in_flight == 6
    scaler.recorded(decision)
    assert scaler.decisions == {("chat", "up", "panic"): 1}
    scaler.forget()
    assert scaler.figures == {}
