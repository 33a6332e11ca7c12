"""Device residency and eviction choice (reference 7.5, behaviours 43 and 44)."""

from __future__ import annotations

import pytest

from sbproxy.model_host.runtime.admission import AdmissionRejected
from sbproxy.model_host.runtime.memory import MemoryEstimate
from sbproxy.model_host.runtime.residency import (
    EvictionPlan,
    EvictionPolicy,
    Reservation,
    ReservationRequest,
    Residency,
    ResidencyKey,
    eviction_order,
)

GIB = 1024**3


def key(deployment: str, generation: int = 1) -> ResidencyKey:
    return ResidencyKey(deployment, generation)


def gib(count: float) -> MemoryEstimate:
    return MemoryEstimate.from_total(int(count * GIB))


def refused(caught: pytest.ExceptionInfo[AdmissionRejected]) -> str:
    assert caught.value.code == "insufficient_capacity"
    assert not caught.value.retryable
    assert "larger device" in (caught.value.remediation or "")
    return caught.value.message


def test_residency_is_per_device_and_never_evicts_protected_generations() -> None:
    residency = Residency({0: 8 * GIB, 1: 24 * GIB})

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("large-on-small"), estimate=gib(10), devices=[0], tick=1)
    message = refused(caught)
    assert "device 0" in message
    assert "capacity is 8589934592 bytes" in message
    assert key("large-on-small") not in residency, "device 1 was not substituted"

    residency.reserve(key("large"), estimate=gib(10), devices=[1], tick=1)
    residency.reserve(key("small-device"), estimate=gib(6), devices=[0], protected=True, tick=1)
    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("other-small"), estimate=gib(4), devices=[0], tick=2)
    assert f"device 0 lacks {2 * GIB} bytes" in refused(caught)
    assert key("small-device") in residency
    assert key("large") in residency

    residency.set_protected(key("small-device"), False)
    plan = residency.reserve(key("other-small"), estimate=gib(4), devices=[0], tick=3)
    assert plan.evicted == (key("small-device"),)
    assert key("small-device") not in residency
    assert key("large") in residency

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("large"), estimate=MemoryEstimate.from_total(1), devices=[0], tick=4)
    assert "already resident on devices [1]" in refused(caught)
    reservation = residency.get(key("large"))
    assert reservation is not None
    assert reservation.devices == (1,)


def test_max_resident_models_is_global_across_devices() -> None:
    residency = Residency({0: 8 * GIB, 1: 8 * GIB}, max_resident_models=2)
    residency.reserve(key("oldest"), estimate=gib(1), devices=[0], tick=1)
    residency.reserve(key("newer"), estimate=gib(1), devices=[1], tick=2)

    plan = residency.reserve(key("newest"), estimate=gib(1), devices=[1], tick=3)

    assert plan.evicted == (key("oldest"),)
    assert [r.key for r in residency.reservations] == [key("newer"), key("newest")]


def test_never_eviction_rejects_resident_limit_displacement() -> None:
    residency = Residency({0: 8 * GIB, 1: 8 * GIB}, max_resident_models=1, eviction="never")
    residency.reserve(key("resident"), estimate=gib(1), devices=[0], tick=1)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("candidate"), estimate=gib(1), devices=[1], tick=2)

    assert "eviction policy is never" in refused(caught)
    assert key("resident") in residency
    assert key("candidate") not in residency


def test_never_eviction_rejects_capacity_displacement() -> None:
    residency = Residency({0: 8 * GIB}, eviction=EvictionPolicy.NEVER)
    residency.reserve(key("resident"), estimate=gib(5), devices=[0], tick=1)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("candidate"), estimate=gib(5), devices=[0], tick=2)

    assert "eviction policy is never" in refused(caught)
    residency.reserve(key("fits"), estimate=gib(3), devices=[0], tick=3)  # no displacement


def test_an_unknown_or_empty_device_selection_is_insufficient_capacity() -> None:
    residency = Residency({0: 8 * GIB, 1: 0})

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("a"), estimate=gib(1), devices=[7], tick=1)
    assert "device 7 is not present" in refused(caught)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("a"), estimate=gib(1), devices=[], tick=1)
    assert "selected no device" in refused(caught)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("a"), estimate=gib(1), devices=[1], tick=1)
    assert "capacity is 0 bytes" in refused(caught)

    with pytest.raises(ValueError, match="distinct"):
        residency.reserve(key("a"), estimate=gib(1), devices=[0, 0], tick=1)


def test_identical_re_reservation_is_idempotent_and_refreshes_tick_and_protection() -> None:
    residency = Residency({0: 8 * GIB}, max_resident_models=1)
    residency.reserve(key("a"), estimate=gib(6), devices=[0], protected=True, tick=1)

    plan = residency.reserve(key("a"), estimate=gib(6), devices=[0], protected=False, tick=9)

    assert plan == EvictionPlan(already_resident=True)
    assert residency.reservations == (
        Reservation(key=key("a"), estimate=gib(6), devices=(0,), protected=False, last_used=9),
    )
    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("a"), estimate=gib(5), devices=[0], tick=10)
    assert "changed its immutable memory estimate" in refused(caught)


def test_another_generation_of_the_same_deployment_is_a_separate_reservation() -> None:
    residency = Residency({0: 8 * GIB})
    residency.reserve(key("a", 1), estimate=gib(3), devices=[0], protected=True, tick=1)

    residency.reserve(key("a", 2), estimate=gib(3), devices=[0], protected=True, tick=2)

    assert residency.used_bytes(0) == 6 * GIB
    assert residency.free_bytes(0) == 2 * GIB


def test_victims_are_least_recently_used_then_by_deployment_and_generation() -> None:
    residency = Residency({0: 10 * GIB})
    residency.reserve(key("b", 1), estimate=gib(2), devices=[0], tick=5)
    residency.reserve(key("a", 2), estimate=gib(2), devices=[0], tick=5)
    residency.reserve(key("a", 1), estimate=gib(2), devices=[0], tick=5)
    residency.reserve(key("old"), estimate=gib(2), devices=[0], tick=7)
    residency.touch(key("old"), 3)  # an older tick never moves a reservation back
    residency.touch(key("b", 1), 8)

    plan = residency.plan(ReservationRequest(key=key("new"), estimate=gib(7), devices=(0,), tick=9))

    assert plan.evicted == (key("a", 1), key("a", 2), key("old"))
    assert len(residency.reservations) == 4, "plan changes nothing"


def test_a_candidate_that_frees_no_short_device_is_skipped() -> None:
    residency = Residency({0: 8 * GIB, 1: 8 * GIB})
    residency.reserve(key("idle-on-1"), estimate=gib(6), devices=[1], tick=1)
    residency.reserve(key("idle-on-0"), estimate=gib(6), devices=[0], tick=2)

    plan = residency.reserve(key("new"), estimate=gib(4), devices=[0], tick=3)

    assert plan.evicted == (key("idle-on-0"),)
    assert key("idle-on-1") in residency


def test_a_multi_device_generation_is_evicted_as_a_unit() -> None:
    residency = Residency({0: 8 * GIB, 1: 8 * GIB})
    residency.reserve(key("tensor-parallel"), estimate=gib(6), devices=[0, 1], tick=1)
    assert (residency.used_bytes(0), residency.used_bytes(1)) == (6 * GIB, 6 * GIB)

    plan = residency.reserve(key("single"), estimate=gib(4), devices=[1], tick=2)

    assert plan.evicted == (key("tensor-parallel"),)
    assert residency.used_bytes(0) == 0
    assert residency.used_bytes(1) == 4 * GIB


def test_a_multi_device_request_reserves_on_every_device_or_none() -> None:
    residency = Residency({0: 8 * GIB, 1: 8 * GIB})
    residency.reserve(key("busy-on-1"), estimate=gib(6), devices=[1], protected=True, tick=1)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("tp"), estimate=gib(4), devices=[0, 1], tick=2)

    assert f"device 1 lacks {2 * GIB} bytes" in refused(caught)
    assert residency.used_bytes(0) == 0, "nothing reserved on device 0"


def test_a_live_protection_callback_is_honoured() -> None:
    busy = {key("busy")}
    residency = Residency({0: 8 * GIB}, is_protected=lambda k: k in busy)
    residency.reserve(key("busy"), estimate=gib(6), devices=[0], tick=1)

    with pytest.raises(AdmissionRejected):
        residency.reserve(key("new"), estimate=gib(4), devices=[0], tick=2)

    busy.clear()
    assert residency.reserve(key("new"), estimate=gib(4), devices=[0], tick=3).evicted == (
        key("busy"),
    )


def test_resident_limit_overflow_with_only_protected_generations_is_refused() -> None:
    residency = Residency({0: 8 * GIB}, max_resident_models=1)
    residency.reserve(key("pinned"), estimate=gib(1), devices=[0], protected=True, tick=1)

    with pytest.raises(AdmissionRejected) as caught:
        residency.reserve(key("new"), estimate=gib(1), devices=[0], tick=2)

    assert "resident model limit 1 requires 1 more evictions" in refused(caught)


def test_release_and_restore_undo_a_failed_eviction() -> None:
    residency = Residency({0: 8 * GIB})
    residency.reserve(key("victim"), estimate=gib(6), devices=[0], tick=1)
    plan = residency.reserve(key("new"), estimate=gib(4), devices=[0], tick=2)
    (victim,) = plan.victims

    # Stopping the victim failed: give its memory back to it.
    assert residency.release(key("new")) is not None
    residency.restore(victim)

    assert residency.reservations == (victim,)
    assert residency.release(key("new")) is None
    residency.reserve(key("other"), estimate=gib(2), devices=[0], protected=True, tick=3)
    residency.release(key("victim"))
    residency.reserve(key("big"), estimate=gib(6), devices=[0], protected=True, tick=4)
    with pytest.raises(AdmissionRejected) as caught:
        residency.restore(victim)
    assert "no longer fits on device 0" in refused(caught)


def test_lowering_the_limit_evicts_idle_generations_lru_first() -> None:
    residency = Residency({0: 8 * GIB})
    residency.reserve(key("a"), estimate=gib(1), devices=[0], tick=1)
    residency.reserve(key("b"), estimate=gib(1), devices=[0], protected=True, tick=0)
    residency.reserve(key("c"), estimate=gib(1), devices=[0], tick=2)

    plan = residency.enforce_limit(1)

    assert plan.evicted == (key("a"), key("c"))
    assert residency.max_resident_models == 1
    assert [r.key for r in residency.reservations] == [key("b")]


def test_lowering_the_limit_is_refused_under_never_or_with_protected_work() -> None:
    never = Residency({0: 8 * GIB}, eviction="never")
    never.reserve(key("a"), estimate=gib(1), devices=[0], tick=1)
    never.reserve(key("b"), estimate=gib(1), devices=[0], tick=2)
    with pytest.raises(AdmissionRejected) as caught:
        never.enforce_limit(1)
    assert "eviction policy is never" in refused(caught)
    assert never.max_resident_models is None

    busy = Residency({0: 8 * GIB})
    busy.reserve(key("a"), estimate=gib(1), devices=[0], protected=True, tick=1)
    busy.reserve(key("b"), estimate=gib(1), devices=[0], protected=True, tick=2)
    with pytest.raises(AdmissionRejected) as caught:
        busy.enforce_limit(1)
    assert "requires 1 more evictions" in refused(caught)
    assert busy.enforce_limit(None) == EvictionPlan()


def test_invalid_construction_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="capacities"):
        Residency({0: -1})
    with pytest.raises(ValueError, match="max_resident_models"):
        Residency({0: 1}, max_resident_models=0)
    with pytest.raises(ValueError, match="EvictionPolicy"):
        Residency({0: 1}, eviction="sometimes")


def held(deployment: str, last_used: int, generation: int = 1) -> Reservation:
    return Reservation(
        key=key(deployment, generation),
        estimate=gib(1),
        devices=(0,),
        protected=False,
        last_used=last_used,
    )


# (candidates as (deployment, last_used), demand per deployment, expected order): a
# generation nothing waits for goes first even when it was used more recently; then the
# one with fewer requests; then LRU; then (deployment, generation).
EVICTION_ORDER_CASES = [
    ([("a", 1), ("b", 2)], {}, ["a", "b"]),  # plain LRU when nothing is wanted
    ([("a", 1), ("b", 9)], {"a": 1}, ["b", "a"]),  # a queued request outweighs recency
    ([("a", 1), ("b", 9), ("c", 5)], {"a": 3, "b": 1}, ["c", "b", "a"]),
    ([("a", 1), ("b", 2)], {"a": 2, "b": 2}, ["a", "b"]),  # equal demand: LRU
    ([("b", 4), ("a", 4)], {}, ["a", "b"]),  # equal ticks: by deployment
    ([("a", 3)], {"a": -1}, ["a"]),  # a miscount below zero counts as none
    ([("a", 1), ("b", 2)], {"z": 5}, ["a", "b"]),  # demand of others does not matter
]


@pytest.mark.parametrize(("candidates", "wanted", "expected"), EVICTION_ORDER_CASES)
def test_eviction_order_puts_unwanted_generations_first_then_lru(
    candidates: list[tuple[str, int]], wanted: dict[str, int], expected: list[str]
) -> None:
    demand = {key(deployment): count for deployment, count in wanted.items()}
    ordered = eviction_order([held(d, tick) for d, tick in candidates], demand=demand)
    assert [r.key.deployment for r in ordered] == expected


def test_a_plan_evicts_the_idle_generation_before_one_with_requests_waiting() -> None:
    # max_resident_models: 2 with a (least recently used, but its held gate queues two
    # requests) and b (used since, nothing waiting): the swap displaces b, not a.
    waiting = {key("a"): 2}
    residency = Residency({0: 8 * GIB}, max_resident_models=2, demand=lambda k: waiting.get(k, 0))
    residency.reserve(key("a"), estimate=gib(1), devices=[0], tick=1)
    residency.reserve(key("b"), estimate=gib(1), devices=[0], tick=2)

    plan = residency.plan(ReservationRequest(key=key("c"), estimate=gib(1), devices=(0,)))
    assert plan.evicted == (key("b"),)

    waiting.clear()  # a's requests were served: plain LRU again
    plan = residency.plan(ReservationRequest(key=key("c"), estimate=gib(1), devices=(0,)))
    assert plan.evicted == (key("a"),)
