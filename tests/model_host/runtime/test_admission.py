"""The admission gate: priority queue, bounds, timeout, cancellation, drain, keep-alive.

Behaviours 45 and 46 of the reference (section 10), on anyio with small timeouts and an
injected clock for keep-alive.
"""

from __future__ import annotations

import anyio
import pytest

from sbproxy.config import PriorityClass
from sbproxy.errors import SbproxyError
from sbproxy.model_host.runtime.admission import (
    MAX_DETAIL_CHARS,
    REMEDIATIONS,
    AdmissionGate,
    AdmissionReason,
    AdmissionRejected,
    DrainReport,
    Permit,
    keep_alive_expired,
    reject,
)

pytestmark = pytest.mark.anyio

INTERACTIVE, STANDARD, BATCH = (
    PriorityClass.INTERACTIVE,
    PriorityClass.STANDARD,
    PriorityClass.BATCH,
)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def gate_of(
    *,
    max_active: int = 1,
    max_queue: int = 3,
    timeout_s: float = 30.0,
    clock: FakeClock | None = None,
) -> AdmissionGate:
    return AdmissionGate(
        "coder",
        max_active=max_active,
        max_queue=max_queue,
        queue_timeout_s=timeout_s,
        clock=clock or FakeClock(),
    )


async def test_queue_releases_interactive_then_standard_then_batch() -> None:
    gate = gate_of(max_active=1, max_queue=3)
    holder = await gate.admit(STANDARD)
    order: list[str] = []

    async def request(name: str, priority: PriorityClass) -> None:
        async with await gate.admit(priority):
            order.append(name)

    async with anyio.create_task_group() as group:
        for name, priority in (
            ("batch", BATCH),
            ("standard", STANDARD),
            ("interactive", INTERACTIVE),
        ):
            group.start_soon(request, name, priority)
            await anyio.wait_all_tasks_blocked()
        assert (gate.active, gate.queued) == (1, 3)
        holder.release()

    assert order == ["interactive", "standard", "batch"]
    assert (gate.active, gate.queued) == (0, 0)


async def test_waiters_of_one_class_are_served_in_arrival_order() -> None:
    gate = gate_of(max_active=1, max_queue=5)
    holder = await gate.admit(BATCH)
    order: list[str] = []

    async def request(name: str, priority: PriorityClass) -> None:
        async with await gate.admit(priority):
            order.append(name)

    async with anyio.create_task_group() as group:
        for name, priority in (
            ("s1", STANDARD),
            ("b1", BATCH),
            ("s2", STANDARD),
            ("i1", INTERACTIVE),
            ("s3", STANDARD),
        ):
            group.start_soon(request, name, priority)
            await anyio.wait_all_tasks_blocked()
        holder.release()

    assert order == ["i1", "s1", "s2", "s3", "b1"]


async def test_a_newcomer_does_not_overtake_a_waiter_for_a_released_slot() -> None:
    gate = gate_of(max_active=1, max_queue=3)
    holder = await gate.admit(STANDARD)
    order: list[str] = []

    async def request(name: str) -> None:
        async with await gate.admit(BATCH):
            order.append(name)

    async with anyio.create_task_group() as group:
        group.start_soon(request, "waiter")
        await anyio.wait_all_tasks_blocked()
        holder.release()
        # The slot went to the waiter even though it has not run yet.
        assert (gate.active, gate.queued) == (1, 0)
        group.start_soon(request, "newcomer")

    assert order == ["waiter", "newcomer"]


async def test_full_queue_is_refused_and_an_aborted_waiter_leaves_the_count() -> None:
    gate = gate_of(max_active=1, max_queue=1, timeout_s=30.0)
    holder = await gate.admit(STANDARD)

    async with anyio.create_task_group() as group:
        group.start_soon(gate.admit, STANDARD)
        await anyio.wait_all_tasks_blocked()
        assert gate.queued == 1

        with pytest.raises(AdmissionRejected) as caught:
            await gate.admit(INTERACTIVE)

        group.cancel_scope.cancel()  # the waiting client went away

    rejection = caught.value
    assert isinstance(rejection, SbproxyError)
    assert rejection.code == "queue_full"
    assert rejection.reason is AdmissionReason.QUEUE_FULL
    assert rejection.retryable
    assert rejection.retry_after_ms == 30_000
    assert rejection.details == {"deployment": "coder", "retry_after_ms": 30_000}
    assert rejection.remediation == REMEDIATIONS[AdmissionReason.QUEUE_FULL]
    assert "max_queue_depth" in str(rejection)
    assert gate.queued == 0, "cancelled waiters are removed"
    holder.release()
    assert gate.active == 0


async def test_no_queue_means_refusal_while_busy() -> None:
    gate = gate_of(max_active=1, max_queue=0)
    async with await gate.admit(STANDARD):
        with pytest.raises(AdmissionRejected, match="full queue of 0"):
            await gate.admit(INTERACTIVE)
    async with await gate.admit(STANDARD):
        assert gate.active == 1


async def test_waiting_past_the_timeout_is_queue_timeout() -> None:
    gate = gate_of(max_active=1, max_queue=2, timeout_s=0.05)
    holder = await gate.admit(STANDARD)
    started = anyio.current_time()

    with pytest.raises(AdmissionRejected) as caught:
        await gate.admit(BATCH)

    assert anyio.current_time() - started >= 0.04  # the deadline, less timer slack
    assert caught.value.code == "queue_timeout"
    assert caught.value.retryable
    assert "queue_timeout_ms" in (caught.value.remediation or "")
    assert (gate.active, gate.queued) == (1, 0)
    holder.release()
    assert gate.active == 0


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_a_waiter_cancelled_as_its_slot_arrives_passes_the_slot_on(
    cancel_first: bool,
) -> None:
    gate = gate_of(max_active=1, max_queue=3)
    holder = await gate.admit(STANDARD)
    served: list[str] = []
    first_scope = anyio.CancelScope()

    async def first() -> None:
        with first_scope:
            async with await gate.admit(INTERACTIVE):
                served.append("first")
                await anyio.sleep_forever()

    async def second() -> None:
        async with await gate.admit(STANDARD):
            served.append("second")

    async with anyio.create_task_group() as group:
        group.start_soon(first)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert gate.queued == 2
        # Both orders within one step: the grant and the cancellation race.
        if cancel_first:
            first_scope.cancel()
            holder.release()
        else:
            holder.release()
            first_scope.cancel()

    assert served[-1] == "second"
    assert (gate.active, gate.queued) == (0, 0), "no slot leaked"


async def test_permit_release_is_idempotent() -> None:
    gate = gate_of(max_active=2)
    permit = await gate.admit(STANDARD)
    other = await gate.admit(STANDARD)
    assert isinstance(permit, Permit)

    permit.release()
    permit.release()

    assert permit.released
    assert gate.active == 1
    other.release()
    assert gate.active == 0


async def test_drain_cancels_queued_work_and_waits_for_active() -> None:
    gate = gate_of(max_active=1, max_queue=2, timeout_s=5.0)
    active = await gate.admit(STANDARD)
    queued_codes: list[str] = []
    reports: list[DrainReport] = []

    async def queued() -> None:
        try:
            await gate.admit(INTERACTIVE)
        except AdmissionRejected as rejection:
            queued_codes.append(rejection.code)

    async def drain() -> None:
        reports.append(await gate.drain(deadline_s=10.0))

    async with anyio.create_task_group() as group:
        group.start_soon(queued)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(drain)
        await anyio.wait_all_tasks_blocked()

        assert queued_codes == ["draining"]
        assert reports == [], "the drain waits for the active permit"
        assert gate.draining
        active.release()

    assert reports == [
        DrainReport(active_at_start=1, cancelled_queued=1, remaining_active=0, timed_out=False)
    ]
    with pytest.raises(AdmissionRejected) as caught:
        await gate.admit(STANDARD)
    assert caught.value.code == "draining"
    assert caught.value.retryable


async def test_drain_gives_up_at_its_deadline() -> None:
    gate = gate_of(max_active=2)
    permit = await gate.admit(STANDARD)

    report = await gate.drain(deadline_s=0.05)

    assert report == DrainReport(
        active_at_start=1, cancelled_queued=0, remaining_active=1, timed_out=True
    )
    permit.release()
    assert gate.active == 0


async def test_keep_alive_counts_from_the_last_release() -> None:
    clock = FakeClock()
    gate = gate_of(max_active=1, max_queue=2, timeout_s=5.0, clock=clock)
    assert not keep_alive_expired(gate, 30, clock.now), "never idle yet"

    permit = await gate.admit(STANDARD)
    clock.now += 100
    assert not keep_alive_expired(gate, 30, clock.now), "an active permit pauses expiry"

    permit.release()
    assert gate.last_released_at == clock.now
    clock.now += 29
    assert not keep_alive_expired(gate, 30, clock.now)
    clock.now += 1
    assert keep_alive_expired(gate, 30, clock.now)
    assert not keep_alive_expired(gate, None, clock.now), "no keep-alive: never expires"

    report = await gate.drain(deadline_s=1.0)  # the idle drain that expiry starts

    assert report == DrainReport(
        active_at_start=0, cancelled_queued=0, remaining_active=0, timed_out=False
    )
    assert not keep_alive_expired(gate, 30, clock.now), "never while draining"
    with pytest.raises(AdmissionRejected) as caught:
        await gate.admit(STANDARD)
    assert caught.value.code == "draining"

    gate.resume()
    async with await gate.admit(STANDARD):
        assert gate.active == 1


async def test_queued_work_pauses_keep_alive() -> None:
    clock = FakeClock()
    gate = gate_of(max_active=1, max_queue=1, clock=clock)
    gate.mark_idle()
    clock.now += 60
    assert keep_alive_expired(gate, 30, clock.now)

    async with anyio.create_task_group() as group:
        holder = await gate.admit(STANDARD)
        group.start_soon(gate.admit, BATCH)
        await anyio.wait_all_tasks_blocked()
        holder.release()  # the slot passes straight to the waiter: never idle
        assert gate.last_released_at == clock.now - 60
        assert not keep_alive_expired(gate, 30, clock.now)
        group.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("reason", "retryable"),
    [
        ("engine_unhealthy", False),
        ("crash_loop", False),
        ("insufficient_capacity", False),
        ("draining", True),
    ],
)
def test_reject_builds_the_same_rejection_type(reason: str, retryable: bool) -> None:
    rejection = reject(reason, "something happened", deployment="coder")

    assert isinstance(rejection, AdmissionRejected)
    assert rejection.code == reason
    assert rejection.retryable is retryable
    assert rejection.remediation == REMEDIATIONS[AdmissionReason(reason)]
    assert rejection.to_dict()["deployment"] == "coder"


def test_rejection_detail_is_bounded() -> None:
    rejection = reject(AdmissionReason.CRASH_LOOP, "x" * 2_000)

    assert len(rejection.message) == MAX_DETAIL_CHARS
    assert "reset" in (rejection.remediation or "")


def test_unknown_reason_and_bad_limits_are_caller_errors() -> None:
    with pytest.raises(ValueError, match="not_a_reason"):
        reject("not_a_reason", "x")
    with pytest.raises(ValueError, match="max_active"):
        AdmissionGate("coder", max_active=0, max_queue=1, queue_timeout_s=1.0)
    with pytest.raises(ValueError, match="max_queue"):
        AdmissionGate("coder", max_active=1, max_queue=-1, queue_timeout_s=1.0)
    with pytest.raises(ValueError, match="queue_timeout_s"):
        AdmissionGate("coder", max_active=1, max_queue=1, queue_timeout_s=0)
