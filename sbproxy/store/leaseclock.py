"""The lease clock: time that a wall-clock step cannot move, shared by one boot's processes.

Leases decide liveness, so they are never stamped on the wall clock: an NTP step of +1 h
would expire every live lease at once (and recovery would start a second attempt beside the
first), a step of -1 h would keep a dead owner's lease alive for an hour. Instead a lease is
stamped on ``CLOCK_MONOTONIC`` together with the boot id, ``/proc/sys/kernel/random/boot_id``.

Why this clock:

* ``CLOCK_MONOTONIC`` is one system-wide clock per boot on Linux, read alike by every
  process (``clock_gettime(2)``), so one process can compare a deadline another wrote.
  ``settimeofday`` and NTP steps do not move it; NTP slewing changes its rate by at most
  500 ppm.
* It stops while the machine is suspended, unlike ``CLOCK_BOOTTIME``: every process is
  suspended alike, so a heartbeating owner keeps its lease across a suspend instead of
  losing it to the first recovery pass after resume.
* Its readings mean nothing on another boot, so a lease carries its boot id: an observer on
  another boot treats the lease as lapsed (its owner died with the old boot; ``owner_is_gone``
  concludes the same from the owner id).

Assumed, as for the owner ids of ``sbproxy.workflows.identity``: every process sharing a
journal runs on one machine in one pid and time namespace. Where the boot id cannot be read
every process reports ``unknown-boot``; a reading from an earlier boot is then recognised only
when it lies in the future of this clock (see :meth:`LeaseStamp.remaining_ms`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "UNKNOWN_BOOT",
    "LeaseClock",
    "LeaseStamp",
    "LeaseTime",
    "boot_id",
    "system_lease_time",
]

UNKNOWN_BOOT = "unknown-boot"
_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id() -> str:
    """This machine's boot id (a UUID that changes at every boot), or ``unknown-boot``.

    Read once per process: a process never outlives the boot it started in.
    """
    try:
        return _BOOT_ID_FILE.read_text().strip() or UNKNOWN_BOOT
    except OSError:
        return UNKNOWN_BOOT


@dataclass(frozen=True)
class LeaseTime:
    """A reading of the lease clock.

    Attributes:
        clock: Which clock: the boot id. Readings of different clocks are not comparable.
        ms: Milliseconds on that clock (``CLOCK_MONOTONIC``: since boot, suspend excluded).
    """

    clock: str
    ms: int


LeaseClock = Callable[[], LeaseTime]
"""Source of lease time; :func:`system_lease_time` unless a test injects its own."""


def system_lease_time() -> LeaseTime:
    """Now on this boot's ``CLOCK_MONOTONIC``, in integer milliseconds."""
    return LeaseTime(clock=boot_id(), ms=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000)


@dataclass(frozen=True)
class LeaseStamp:
    """A running job's lease as its owner last renewed it.

    Attributes:
        clock: Boot id of the clock the owner read.
        deadline_ms: When the lease lapses unless renewed, in ms on that clock.
        duration_ms: The lease length the owner asked for; the renewal happened at
            ``deadline_ms - duration_ms``.
    """

    clock: str
    deadline_ms: int
    duration_ms: int

    def remaining_ms(self, now: LeaseTime) -> int | None:
        """Milliseconds until the lease lapses as seen at ``now`` (negative: lapsed that long).

        ``None`` when ``now`` cannot measure it: the stamp is from another boot's clock, or
        it was renewed after ``now`` on a clock of the same name (a reading from before a
        reboot where the boot id is unknown). Either way the lease counts as lapsed.
        """
        if self.clock != now.clock or self.deadline_ms - self.duration_ms > now.ms:
            return None
        return self.deadline_ms - now.ms

    def lapsed(self, now: LeaseTime) -> bool:
        """Whether recovery may take the job from its owner at ``now``.

        The same rule as ``JobStore.requeue_expired``: a lease lapses once ``now`` is past
        its deadline (not at it), or at once when ``now`` cannot measure it.
        """
        remaining = self.remaining_ms(now)
        return remaining is None or remaining < 0
