"""Request admission for one deployment: an active cap, a bounded priority queue, drain.

Contract (spec "Admission and residency"; reference 7.3 and 7.6, ``admission.rs``):

* at most ``max_active`` requests hold a :class:`Permit` at once;
* a request is admitted at once only if a slot is free **and nobody is queued**, so a
  newcomer never overtakes a waiter;
* otherwise it waits in a queue of at most ``max_queue`` entries, or is refused with
  ``queue_full``;
* a released slot goes to the waiter with the lowest ``(priority rank, arrival)``:
  interactive (0) before standard (1) before batch (2), FIFO within a class. The class
  comes from the authenticated key record, never from a client header;
* a waiter that waits longer than ``queue_timeout_s`` is refused with ``queue_timeout``; a
  waiter whose task is cancelled (the client went away) leaves the queue, and a slot
  granted to it in that same instant is passed on, so no slot ever leaks;
* :meth:`AdmissionGate.drain` refuses new work, refuses every queued waiter with
  ``draining`` and waits, up to a deadline, for the active permits to be released.

The gate lives on one event loop (anyio; no thread safety) and does no I/O. Keep-alive is a
pure predicate, :func:`keep_alive_expired`, over the gate's counts and its
``last_released_at`` stamp.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Final

import anyio

from sbproxy.config import PriorityClass
from sbproxy.errors import SbproxyError

__all__ = [
    "MAX_DETAIL_CHARS",
    "PRIORITY_RANK",
    "REMEDIATIONS",
    "AdmissionGate",
    "AdmissionReason",
    "AdmissionRejected",
    "DrainReport",
    "Permit",
    "keep_alive_expired",
    "reject",
]

MAX_DETAIL_CHARS: Final = 512
"""Longest rejection message kept (reference ``AdmissionRejection.detail``, <= 512)."""


class AdmissionReason(StrEnum):
    """Stable admission reason codes (spec table; reference ``AdmissionReason``)."""

    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    ENGINE_UNHEALTHY = "engine_unhealthy"
    CRASH_LOOP = "crash_loop"
    DRAINING = "draining"


PRIORITY_RANK: Final[dict[PriorityClass, int]] = {
    PriorityClass.INTERACTIVE: 0,
    PriorityClass.STANDARD: 1,
    PriorityClass.BATCH: 2,
}
"""Queue order of the classes; lower ranks are served first (reference 7.3)."""

REMEDIATIONS: Final[dict[AdmissionReason, str]] = {
    AdmissionReason.INSUFFICIENT_CAPACITY: (
        "Choose a smaller variant, reduce context or concurrency, use `recreate`, or move "
        "the deployment to a larger device."
    ),
    AdmissionReason.QUEUE_FULL: (
        "Increase `max_queue_depth`, reduce callers, or add a fallback provider."
    ),
    AdmissionReason.QUEUE_TIMEOUT: "Raise `queue_timeout_ms`, reduce load, or add a fallback.",
    AdmissionReason.ENGINE_UNHEALTHY: (
        "Inspect the retained engine error and reset after correcting the cause."
    ),
    AdmissionReason.CRASH_LOOP: (
        "Fix the engine or artifact problem, then call reset. Automatic retries stay bounded."
    ),
    AdmissionReason.DRAINING: "Wait for the stop or replacement operation to finish.",
}
"""Operator action per reason, verbatim from the spec's admission table."""

# Whether the same request may succeed later unchanged: load-dependent refusals are
# retryable; capacity, unhealthy and crash-loop refusals need an operator first.
_RETRYABLE: Final[dict[AdmissionReason, bool]] = {
    AdmissionReason.INSUFFICIENT_CAPACITY: False,
    AdmissionReason.QUEUE_FULL: True,
    AdmissionReason.QUEUE_TIMEOUT: True,
    AdmissionReason.ENGINE_UNHEALTHY: False,
    AdmissionReason.CRASH_LOOP: False,
    AdmissionReason.DRAINING: True,
}


class AdmissionRejected(SbproxyError):
    """A request (or a load) was refused admission.

    ``code`` is the :class:`AdmissionReason` value; ``remediation`` is the spec's operator
    action for it. ``retryable`` is true for ``queue_full``, ``queue_timeout`` and
    ``draining``. ``details`` carries ``deployment`` when known and ``retry_after_ms`` when
    set (``queue_full`` sets it to the queue timeout, as the reference does).

    Args:
        reason: Why admission was refused.
        detail: What happened, in one sentence; cut to :data:`MAX_DETAIL_CHARS`.
        deployment: The deployment id, if the refusal concerns one.
        retry_after_ms: A hint for ``Retry-After``, in milliseconds.
        retryable: Overrides the reason's default: an ``insufficient_capacity`` that came
            from waiting out busy resident models (a swap) is retryable, one that can never
            fit is not.
    """

    def __init__(
        self,
        reason: AdmissionReason,
        detail: str,
        *,
        deployment: str | None = None,
        retry_after_ms: int | None = None,
        retryable: bool | None = None,
    ) -> None:
        if len(detail) > MAX_DETAIL_CHARS:
            detail = detail[: MAX_DETAIL_CHARS - 1] + "\N{HORIZONTAL ELLIPSIS}"
        details: dict[str, str | int] = {}
        if deployment is not None:
            details["deployment"] = deployment
        if retry_after_ms is not None:
            details["retry_after_ms"] = retry_after_ms
        super().__init__(
            detail,
            code=reason.value,
            retryable=_RETRYABLE[reason] if retryable is None else retryable,
            remediation=REMEDIATIONS[reason],
            details=details,
        )
        self.reason = reason
        self.deployment = deployment
        self.retry_after_ms = retry_after_ms


def reject(
    reason: AdmissionReason | str,
    detail: str,
    *,
    deployment: str | None = None,
    retry_after_ms: int | None = None,
    retryable: bool | None = None,
) -> AdmissionRejected:
    """Build the rejection for ``reason`` (e.g. ``engine_unhealthy``, ``crash_loop``).

    The runtime manager refuses requests with these for states the gate does not own: a
    crash-looped or stuck engine, or a load that does not fit. Raise the result.

    Raises:
        ValueError: ``reason`` is not an :class:`AdmissionReason` value.
    """
    return AdmissionRejected(
        AdmissionReason(reason),
        detail,
        deployment=deployment,
        retry_after_ms=retry_after_ms,
        retryable=retryable,
    )


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What a drain did (reference ``DrainReport``).

    Attributes:
        active_at_start: Permits held when the drain began.
        cancelled_queued: Waiters refused with ``draining``.
        remaining_active: Permits still held when the drain returned.
        timed_out: The deadline passed with permits still held.
    """

    active_at_start: int
    cancelled_queued: int
    remaining_active: int
    timed_out: bool


class _Outcome(StrEnum):
    WAITING = "waiting"
    GRANTED = "granted"
    REFUSED = "refused"


class _Waiter:
    __slots__ = ("event", "outcome", "rank", "refusal")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.event = anyio.Event()
        self.outcome = _Outcome.WAITING
        self.refusal: AdmissionRejected | None = None


class Permit:
    """One admitted request's slot; release it when the response (stream included) ends.

    Use ``async with await gate.admit(priority):`` or call :meth:`release` from a
    ``finally``. Releasing twice is a no-op.
    """

    __slots__ = ("_gate", "_released")

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate = gate
        self._released = False

    @property
    def released(self) -> bool:
        """Whether the slot was given back."""
        return self._released

    def release(self) -> None:
        """Give the slot back: to the next waiter, or free it (stamping keep-alive)."""
        if not self._released:
            self._released = True
            self._gate._pass_slot()

    async def __aenter__(self) -> Permit:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


class AdmissionGate:
    """Admission for one deployment generation (see the module docstring for the contract).

    Args:
        deployment: Deployment id, named in rejections.
        max_active: Permits held at once (``max_concurrency``, >= 1).
        max_queue: Waiters allowed (``max_queue_depth``, >= 0; 0 means no queue).
        queue_timeout_s: Longest wait for a slot, in seconds (``queue_timeout_ms / 1000``).
        clock: Monotonic clock in seconds for ``last_released_at``; injectable for tests.

    Raises:
        ValueError: a limit is out of range.
    """

    def __init__(
        self,
        deployment: str,
        *,
        max_active: int,
        max_queue: int,
        queue_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_active < 1 or max_queue < 0 or not queue_timeout_s > 0:
            raise ValueError(
                "need max_active >= 1, max_queue >= 0 and queue_timeout_s > 0, got "
                f"{max_active}, {max_queue}, {queue_timeout_s}"
            )
        self.deployment = deployment
        self.max_active = max_active
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._clock = clock
        self._active = 0
        self._queues: tuple[deque[_Waiter], ...] = tuple(deque() for _ in PRIORITY_RANK)
        self._draining = False
        self._idle: anyio.Event | None = None
        self._last_released_at: float | None = None
        self._held = False
        self.on_idle: Callable[[], None] | None = None

    # -- observation -------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Permits held now."""
        return self._active

    @property
    def queued(self) -> int:
        """Requests waiting now."""
        return sum(len(queue) for queue in self._queues)

    @property
    def draining(self) -> bool:
        """Whether new work is refused with ``draining``."""
        return self._draining

    @property
    def held(self) -> bool:
        """Whether grants are paused (a swap waits for this generation to go idle)."""
        return self._held

    @property
    def last_released_at(self) -> float | None:
        """Clock time the active count last fell to 0 (or :meth:`mark_idle`); ``None``: never."""
        return self._last_released_at

    # -- admission ---------------------------------------------------------------------

    async def admit(self, priority: PriorityClass) -> Permit:
        """Wait for a slot.

        Args:
            priority: The class from the caller's authenticated key record.

        Returns:
            A held :class:`Permit`.

        Raises:
            AdmissionRejected: ``draining`` (now, or while queued), ``queue_full`` (with
                ``retry_after_ms`` = the queue timeout), or ``queue_timeout``.
        """
        if self._draining:
            raise self._refusal(AdmissionReason.DRAINING)
        permit = self.try_admit()
        if permit is not None:
            return permit
        if self.queued >= self.max_queue:
            raise self._refusal(AdmissionReason.QUEUE_FULL)

        waiter = _Waiter(PRIORITY_RANK[priority])
        self._queues[waiter.rank].append(waiter)
        try:
            with anyio.fail_after(self.queue_timeout_s):
                await waiter.event.wait()
        except TimeoutError:
            if waiter.outcome is _Outcome.GRANTED:
                return Permit(self)  # the slot arrived as the deadline passed: keep it
            if waiter.refusal is not None:
                raise waiter.refusal from None
            self._forget(waiter)
            raise self._refusal(AdmissionReason.QUEUE_TIMEOUT) from None
        except BaseException:
            # Cancelled (the client went away) or failed: leave the queue, and hand on a
            # slot that was granted before this task could resume.
            if waiter.outcome is _Outcome.GRANTED:
                self._pass_slot()
            else:
                self._forget(waiter)
            raise
        if waiter.refusal is not None:
            raise waiter.refusal
        return Permit(self)

    def try_admit(self) -> Permit | None:
        """A permit now, without waiting, when a slot is free and nobody queues (and the
        gate is neither draining nor held); else ``None`` (then :meth:`admit` queues)."""
        if (
            self._active < self.max_active
            and not self._draining
            and not self._held
            and not any(self._queues)
        ):
            self._active += 1
            return Permit(self)
        return None

    def hold(self) -> None:
        """Pause grants: new requests queue (bounded as usual) while active ones finish.

        The runtime holds a busy generation that a swap is waiting to evict, so that a
        stream of newcomers cannot keep it busy for ever.
        """
        self._held = True

    def unhold(self) -> None:
        """Resume grants: queued waiters take the free slots, best first."""
        if not self._held:
            return
        self._held = False
        while self._active < self.max_active and self.queued:
            self._active += 1
            self._grant_next()

    def mark_idle(self) -> None:
        """Start the keep-alive clock now (the engine just became ready with no requests)."""
        self._last_released_at = self._clock()

    # -- drain -------------------------------------------------------------------------

    async def drain(self, *, deadline_s: float) -> DrainReport:
        """Refuse new and queued work with ``draining``, then wait for active permits.

        Args:
            deadline_s: Longest wait for active permits, in seconds
                (``shutdown_deadline_ms / 1000``).

        Returns:
            The :class:`DrainReport`. The gate stays draining until :meth:`resume`.
        """
        self._draining = True
        active_at_start = self._active
        cancelled = 0
        for queue in self._queues:
            while queue:
                waiter = queue.popleft()
                waiter.outcome = _Outcome.REFUSED
                waiter.refusal = self._refusal(AdmissionReason.DRAINING)
                waiter.event.set()
                cancelled += 1
        if self._active:
            if self._idle is None:
                self._idle = anyio.Event()
            with anyio.move_on_after(deadline_s):
                await self._idle.wait()
        return DrainReport(
            active_at_start=active_at_start,
            cancelled_queued=cancelled,
            remaining_active=self._active,
            timed_out=self._active > 0,
        )

    def resume(self) -> None:
        """Accept work again after a drain (the deployment was started again)."""
        self._draining = False

    # -- internals ---------------------------------------------------------------------

    def _refusal(self, reason: AdmissionReason) -> AdmissionRejected:
        if reason is AdmissionReason.QUEUE_FULL:
            return reject(
                reason,
                f"deployment {self.deployment!r} has {self._active} active requests and a "
                f"full queue of {self.max_queue}",
                deployment=self.deployment,
                retry_after_ms=max(1, round(self.queue_timeout_s * 1000)),
            )
        if reason is AdmissionReason.QUEUE_TIMEOUT:
            detail = (
                f"request waited {self.queue_timeout_s:g} s for deployment "
                f"{self.deployment!r} without getting a slot"
            )
        else:
            detail = f"deployment {self.deployment!r} is draining and accepts no new requests"
        return reject(reason, detail, deployment=self.deployment)

    def _forget(self, waiter: _Waiter) -> None:
        queue = self._queues[waiter.rank]
        if waiter in queue:
            queue.remove(waiter)

    def _grant_next(self) -> None:
        for queue in self._queues:
            if queue:
                waiter = queue.popleft()
                waiter.outcome = _Outcome.GRANTED
                waiter.event.set()
                return

    def _pass_slot(self) -> None:
        """A permit ended: give its slot to the best waiter, or free it."""
        if not self._held and any(self._queues):
            self._grant_next()
            return
        self._active -= 1
        if self._active == 0:
            self._last_released_at = self._clock()
            if self._idle is not None:
                self._idle.set()
                self._idle = None
            if self.on_idle is not None:
                self.on_idle()


def keep_alive_expired(gate: AdmissionGate, keep_alive_s: float | None, now: float) -> bool:
    """Whether an idle deployment's keep-alive has run out (reference 7.6).

    Expired iff the gate is not draining, holds no permit, has nobody queued, and
    ``now - gate.last_released_at >= keep_alive_s``. Active or queued work pauses expiry;
    a gate that was never idle (no release, no :meth:`AdmissionGate.mark_idle`) and a
    deployment without keep-alive (``None``) never expire.

    Args:
        gate: The deployment's gate.
        keep_alive_s: Idle seconds allowed (``keep_alive_secs``), or ``None``.
        now: Current time on the gate's clock, in seconds.
    """
    if keep_alive_s is None or gate.draining or gate.active or gate.queued:
        return False
    released = gate.last_released_at
    return released is not None and now - released >= keep_alive_s
