"""Device residency: which generations hold memory on which device, and whom to evict.

Pure bookkeeping (reference 7.5, ``device_residency.rs``); the runtime manager owns one
:class:`Residency`, asks it for a reservation before it starts an engine, and then drains
and stops the victims the returned :class:`EvictionPlan` names. Nothing here starts or
stops a process.

Rules (spec "Admission and residency"):

* a generation reserves ``estimate.total_bytes`` on **every** device it selected, all or
  nothing; the selected device is never swapped for a larger one;
* a missing device, or an estimate larger than the device's capacity, is refused with
  ``insufficient_capacity``;
* ``max_resident_models`` is one count across all devices;
* only unprotected generations are evicted -- protected means pinned, active, queued,
  preparing or draining -- in :func:`eviction_order`: a generation with no demand (no
  request active, queued or waiting for it) before one with some, fewer requests before
  more, then least recently used first, ``(last_used, deployment, generation)``; a
  multi-device generation is evicted as a unit;
* with eviction policy ``never`` any displacement is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import NamedTuple

from sbproxy.model_host.runtime.admission import AdmissionReason, AdmissionRejected, reject
from sbproxy.model_host.runtime.memory import MemoryEstimate

__all__ = [
    "EvictionPlan",
    "EvictionPolicy",
    "Reservation",
    "ReservationRequest",
    "Residency",
    "ResidencyKey",
    "eviction_order",
    "select_devices",
]

_PROTECTED_STATES = "active, queued, pinned, preparing and draining"


class EvictionPolicy(StrEnum):
    """``lru`` evicts the least recently used idle generation; ``never`` evicts nothing."""

    LRU = "lru"
    NEVER = "never"


class ResidencyKey(NamedTuple):
    """One generation of one deployment."""

    deployment: str
    generation: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """Memory one resident generation holds.

    Attributes:
        key: The generation.
        estimate: Bytes reserved on *each* device in ``devices`` (``total_bytes``).
        devices: Device indexes, one for a single device, several for tensor parallelism.
        protected: Caller-set protection (pinned, active, queued, preparing, draining).
        last_used: Caller's monotonic tick of the last use; orders LRU eviction.
    """

    key: ResidencyKey
    estimate: MemoryEstimate
    devices: tuple[int, ...]
    protected: bool
    last_used: int


@dataclass(frozen=True, slots=True)
class ReservationRequest:
    """A generation asking for memory.

    Attributes:
        key: The generation.
        estimate: Per-device estimate; ``total_bytes`` is reserved on each device.
        devices: The selected device indexes (non-empty, distinct).
        protected: Whether the new reservation starts protected (it usually is: preparing).
        tick: Caller's monotonic tick, recorded as ``last_used``.
    """

    key: ResidencyKey
    estimate: MemoryEstimate
    devices: tuple[int, ...]
    protected: bool = False
    tick: int = 0


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """What admitting one request displaces.

    Attributes:
        victims: Generations to drain and stop, least recently used first.
        already_resident: The same generation was already reserved identically; nothing
            changes but its tick and protection.
    """

    victims: tuple[Reservation, ...] = ()
    already_resident: bool = False

    @property
    def evicted(self) -> tuple[ResidencyKey, ...]:
        """The victims' keys, in eviction order."""
        return tuple(victim.key for victim in self.victims)


class Residency:
    """Per-device reservations of resident generations.

    Args:
        capacities: Bytes each device offers to models, by device index. A device absent
            here cannot be selected; a 0-byte device refuses every load.
        max_resident_models: Generations resident at once across all devices; ``None``
            means unlimited (``cache.max_resident_models``).
        eviction: ``lru`` or ``never`` (``cache.eviction``).
        is_protected: Optional live check, e.g. "has active or queued requests", consulted
            in addition to each reservation's ``protected`` flag.
        demand: Optional live count of the requests active, queued or waiting for a
            generation (its gate's and its waiters'), which orders the victims
            (:func:`eviction_order`); ``None``: every generation counts 0 (plain LRU).

    Raises:
        ValueError: a capacity is negative or ``max_resident_models`` is below 1.
    """

    def __init__(
        self,
        capacities: Mapping[int, int],
        *,
        max_resident_models: int | None = None,
        eviction: EvictionPolicy | str = EvictionPolicy.LRU,
        is_protected: Callable[[ResidencyKey], bool] | None = None,
        demand: Callable[[ResidencyKey], int] | None = None,
    ) -> None:
        if any(capacity < 0 for capacity in capacities.values()):
            raise ValueError(f"device capacities must be >= 0, got {dict(capacities)}")
        if max_resident_models is not None and max_resident_models < 1:
            raise ValueError(f"max_resident_models must be >= 1, got {max_resident_models}")
        self._capacities = dict(capacities)
        self.max_resident_models = max_resident_models
        self.eviction = EvictionPolicy(eviction)
        self._is_protected = is_protected
        self._demand = demand
        self._reservations: dict[ResidencyKey, Reservation] = {}

    # -- observation -------------------------------------------------------------------

    @property
    def capacities(self) -> dict[int, int]:
        """A copy of the device capacities, in bytes."""
        return dict(self._capacities)

    @property
    def reservations(self) -> tuple[Reservation, ...]:
        """Current reservations, in the order they were made."""
        return tuple(self._reservations.values())

    def get(self, key: ResidencyKey) -> Reservation | None:
        """The reservation of ``key``, if resident."""
        return self._reservations.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._reservations

    def used_bytes(self, device: int) -> int:
        """Bytes reserved on ``device``."""
        return sum(
            reservation.estimate.total_bytes
            for reservation in self._reservations.values()
            if device in reservation.devices
        )

    def free_bytes(self, device: int) -> int:
        """Unreserved bytes on ``device`` (0 for an unknown device)."""
        return max(0, self._capacities.get(device, 0) - self.used_bytes(device))

    def is_protected(
        self, reservation: Reservation, *, by: Callable[[ResidencyKey], bool] | None = None
    ) -> bool:
        """Whether ``reservation`` may not be evicted now (``by`` replaces the protection
        callback for one question, e.g. "if the busy ones were idle")."""
        if reservation.protected:
            return True
        check = by or self._is_protected
        return check is not None and check(reservation.key)

    # -- planning ----------------------------------------------------------------------

    def plan(
        self,
        request: ReservationRequest,
        *,
        is_protected: Callable[[ResidencyKey], bool] | None = None,
    ) -> EvictionPlan:
        """Decide whether ``request`` fits and which idle generations it displaces
        (``is_protected``: another protection rule for this plan only).

        Greedy LRU (reference 7.5): compute the bytes short on each selected device
        (``total - free``) and the count overflow (``reservations + 1 - max``); walk the
        unprotected reservations in :func:`eviction_order` (idle before in demand, then
        ``(last_used, deployment, generation)``) and take one
        if it frees a device that is still short or the count still overflows. A taken
        multi-device generation frees its bytes on every device it holds.

        Returns:
            The plan; empty when the request fits as is.

        Raises:
            AdmissionRejected: code ``insufficient_capacity`` -- no device selected; a
                selected device is unknown; ``total_bytes`` exceeds a device's capacity;
                the generation is already resident with other devices or another estimate;
                a displacement is needed under policy ``never`` ("eviction policy is
                never"); or the shortage remains after every unprotected candidate (the
                message names the device and the bytes).
            ValueError: ``request.devices`` repeats a device.
        """
        existing = self._check(request)
        if existing:
            return EvictionPlan(already_resident=True)
        key, devices, total = request.key, request.devices, request.estimate.total_bytes
        short = {device: max(0, total - self.free_bytes(device)) for device in devices}
        overflow = self._overflow(len(self._reservations) + 1)
        if not any(short.values()) and overflow == 0:
            return EvictionPlan()
        if self.eviction is EvictionPolicy.NEVER:
            raise _refuse(
                key,
                f"{_name(key)} requires displacing a resident generation, but the eviction "
                "policy is never",
            )

        victims: list[Reservation] = []
        for candidate in self._candidates(is_protected):
            if not any(short.values()) and overflow == 0:
                break
            frees_short_device = any(short.get(device, 0) > 0 for device in candidate.devices)
            if not frees_short_device and overflow == 0:
                continue
            for device in candidate.devices:
                if device in short:
                    short[device] = max(0, short[device] - candidate.estimate.total_bytes)
            overflow = max(0, overflow - 1)
            victims.append(candidate)

        for device, missing in sorted(short.items()):
            if missing:
                raise _refuse(
                    key,
                    f"device {device} lacks {missing} bytes for {_name(key)} after protecting "
                    f"{_PROTECTED_STATES} generations",
                )
        if overflow:
            raise _refuse(
                key,
                f"resident model limit {self.max_resident_models} requires {overflow} more "
                f"evictions after protecting {_PROTECTED_STATES} generations",
            )
        return EvictionPlan(victims=tuple(victims))

    def _check(self, request: ReservationRequest) -> bool:
        """Refuse a request that can never fit; return whether it is already resident."""
        key, devices, total = request.key, request.devices, request.estimate.total_bytes
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct, got {devices}")
        if not devices:
            raise _refuse(key, f"{_name(key)} selected no device")
        existing = self._reservations.get(key)
        if existing is not None:
            if existing.devices != devices:
                raise _refuse(
                    key, f"{_name(key)} is already resident on devices {list(existing.devices)}"
                )
            if existing.estimate != request.estimate:
                raise _refuse(key, f"{_name(key)} changed its immutable memory estimate")
            return True
        for device in devices:
            capacity = self._capacities.get(device)
            if capacity is None:
                raise _refuse(key, f"selected device {device} is not present")
            if total > capacity:
                raise _refuse(
                    key,
                    f"{_name(key)} needs {total} bytes on device {device}, whose capacity is "
                    f"{capacity} bytes",
                )
        return False

    # -- mutation ----------------------------------------------------------------------

    def reserve(
        self,
        key: ResidencyKey,
        *,
        estimate: MemoryEstimate,
        devices: Iterable[int],
        protected: bool = False,
        tick: int,
    ) -> EvictionPlan:
        """Plan and apply one reservation: drop the victims' accounting, add ``key``.

        The caller drains and stops ``plan.victims``; if a stop fails it calls
        :meth:`release` for ``key`` and :meth:`restore` for the victim. Re-reserving the
        same generation identically only refreshes its tick and protection.

        Returns:
            The applied :class:`EvictionPlan`.

        Raises:
            AdmissionRejected: as :meth:`plan` (``insufficient_capacity``); nothing changes.
        """
        request = ReservationRequest(
            key=key, estimate=estimate, devices=tuple(devices), protected=protected, tick=tick
        )
        plan = self.plan(request)
        if plan.already_resident:
            current = self._reservations[key]
            self._reservations[key] = replace(current, protected=protected, last_used=tick)
            return plan
        for victim in plan.victims:
            del self._reservations[victim.key]
        self._reservations[key] = Reservation(
            key=key,
            estimate=estimate,
            devices=request.devices,
            protected=protected,
            last_used=tick,
        )
        return plan

    def release(self, key: ResidencyKey) -> Reservation | None:
        """Forget ``key``'s reservation (its engine stopped); returns it, if there was one."""
        return self._reservations.pop(key, None)

    def touch(self, key: ResidencyKey, tick: int) -> None:
        """Record a use of ``key`` at ``tick`` (ignored for a generation not resident)."""
        current = self._reservations.get(key)
        if current is not None and current.last_used < tick:
            # Built directly: dataclasses.replace costs more than the rest of an admission,
            # and this runs for every request.
            self._reservations[key] = Reservation(
                key=current.key,
                estimate=current.estimate,
                devices=current.devices,
                protected=current.protected,
                last_used=tick,
            )

    def set_protected(self, key: ResidencyKey, protected: bool) -> None:
        """Set ``key``'s protection flag (ignored for a generation not resident)."""
        current = self._reservations.get(key)
        if current is not None:
            self._reservations[key] = replace(current, protected=protected)

    def restore(self, reservation: Reservation) -> None:
        """Put back a victim whose stop failed (its memory is still in use).

        The count limit is not applied: the process exists either way.

        Raises:
            AdmissionRejected: ``insufficient_capacity`` -- a device is unknown or the
                reservation no longer fits beside the current ones.
        """
        key = reservation.key
        if key in self._reservations:
            raise _refuse(key, f"{_name(key)} is already resident")
        for device in reservation.devices:
            if device not in self._capacities:
                raise _refuse(key, f"selected device {device} is not present")
            if reservation.estimate.total_bytes > self.free_bytes(device):
                raise _refuse(key, f"{_name(key)} no longer fits on device {device}")
        self._reservations[key] = reservation

    def enforce_limit(self, max_resident_models: int | None) -> EvictionPlan:
        """Apply a new ``max_resident_models`` (a reload lowered it), evicting idle LRU.

        Returns:
            The victims to drain and stop; the limit is updated only on success.

        Raises:
            AdmissionRejected: ``insufficient_capacity`` -- policy ``never`` with any
                overflow, or too few unprotected generations.
            ValueError: ``max_resident_models`` is below 1.
        """
        if max_resident_models is not None and max_resident_models < 1:
            raise ValueError(f"max_resident_models must be >= 1, got {max_resident_models}")
        overflow = 0
        if max_resident_models is not None:
            overflow = max(0, len(self._reservations) - max_resident_models)
        victims: tuple[Reservation, ...] = ()
        if overflow:
            if self.eviction is EvictionPolicy.NEVER:
                raise _refuse(
                    None,
                    f"resident model limit {max_resident_models} requires displacing "
                    f"{overflow} generations, but the eviction policy is never",
                )
            candidates = self._candidates()
            if len(candidates) < overflow:
                raise _refuse(
                    None,
                    f"resident model limit {max_resident_models} requires "
                    f"{overflow - len(candidates)} more evictions after protecting "
                    f"{_PROTECTED_STATES} generations",
                )
            victims = tuple(candidates[:overflow])
            for victim in victims:
                del self._reservations[victim.key]
        self.max_resident_models = max_resident_models
        return EvictionPlan(victims=victims)

    # -- internals ---------------------------------------------------------------------

    def _overflow(self, count: int) -> int:
        if self.max_resident_models is None:
            return 0
        return max(0, count - self.max_resident_models)

    def _candidates(
        self, is_protected: Callable[[ResidencyKey], bool] | None = None
    ) -> list[Reservation]:
        unprotected = [
            r for r in self._reservations.values() if not self.is_protected(r, by=is_protected)
        ]
        demand = self._demand
        return eviction_order(
            unprotected, demand={r.key: demand(r.key) for r in unprotected} if demand else {}
        )


def eviction_order(
    candidates: Iterable[Reservation], *, demand: Mapping[ResidencyKey, int]
) -> list[Reservation]:
    """The order in which to evict ``candidates`` (pure): the best victim first.

    A generation that nothing waits for is the cheapest to evict: evicting one that has
    requests active, queued (a held gate's queue) or waiting for it makes them wait for its
    relaunch, which evicts another in turn. So: no demand first; then fewer requests
    before more (the sooner it idles); then least recently used, ``last_used``; then
    ``(deployment, generation)`` so that ties have one answer.

    Args:
        candidates: Reservations that may be evicted (protection already applied).
        demand: Requests active, queued or waiting per generation; a key absent counts 0.

    Returns:
        ``candidates`` sorted, best victim first.
    """

    def rank(reservation: Reservation) -> tuple[bool, int, int, str, int]:
        wanted = max(0, demand.get(reservation.key, 0))
        key = reservation.key
        return (wanted > 0, wanted, reservation.last_used, key.deployment, key.generation)

    return sorted(candidates, key=rank)


def select_devices(
    free: Mapping[int, int], *, deployment: str, count: int, pinned: Sequence[int] | None
) -> tuple[int, ...]:
    """The devices a new generation of ``deployment`` runs on (pure).

    ``pinned`` (the deployment's ``devices``) wins, in its order; otherwise the ``count``
    devices with the most free bytes now, ties to the lower index (reference: the worker
    is the device with the most free memory), returned by ascending index.

    Args:
        free: Unreserved bytes by device index, every device of the host.
        deployment: The deployment, for the refusal.
        count: Devices wanted without ``pinned`` (``tensor_parallel``, default 1; >= 1).
        pinned: The configured device indexes, or ``None``.

    Raises:
        AdmissionRejected: ``insufficient_capacity`` -- a pinned device is not on this host
            (named, with the host's devices), or the host has fewer than ``count`` devices.
    """
    host = ", ".join(str(index) for index in sorted(free)) or "none"
    if pinned is not None:
        missing = [index for index in pinned if index not in free]
        if missing:
            raise reject(
                AdmissionReason.INSUFFICIENT_CAPACITY,
                f"deployment {deployment!r} is pinned to device {missing[0]}, which this "
                f"host does not have (its devices: {host}); set "
                f"proxy.model_host.deployments.{deployment}.devices to devices it has, or "
                "drop it to let the runtime choose",
                deployment=deployment,
            )
        return tuple(pinned)
    if count > len(free):
        raise reject(
            AdmissionReason.INSUFFICIENT_CAPACITY,
            f"deployment {deployment!r} needs {count} devices (tensor_parallel) but this "
            f"host has {len(free)} (devices: {host}); lower "
            f"proxy.model_host.deployments.{deployment}.tensor_parallel or run it on a host "
            "with more devices",
            deployment=deployment,
        )
    ranked = sorted(free, key=lambda index: (-free[index], index))
    return tuple(sorted(ranked[:count]))


def _name(key: ResidencyKey) -> str:
    return f"deployment {key.deployment!r} generation {key.generation}"


def _refuse(key: ResidencyKey | None, detail: str) -> AdmissionRejected:
    return reject(
        AdmissionReason.INSUFFICIENT_CAPACITY,
        detail,
        deployment=None if key is None else key.deployment,
    )
