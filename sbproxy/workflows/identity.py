"""Who owns a lease: a worker identity that survives pid reuse, and a liveness check.

A lease owner is ``<boot id>/<pid>/<process start ticks>/<nonce>``. The boot id
(``/proc/sys/kernel/random/boot_id``, read by ``sbproxy.store.boot_id``, which also names the
lease clock) changes at every boot; the start ticks (field 22 of
``/proc/<pid>/stat``) tell a reused pid from the original process; the nonce tells two workers
of one process apart. A worker can therefore tell for certain that another worker on the
same machine is gone, and re-queue its job at once instead of waiting for the lease to lapse;
it never mistakes a new process that reused the pid for the old owner.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sbproxy.store import UNKNOWN_BOOT
from sbproxy.store import boot_id as _current_boot_id

__all__ = ["WorkerIdentity", "owner_is_gone", "process_start_ticks"]


def process_start_ticks(pid: int) -> str | None:
    """Start time of a live process in clock ticks, or ``None`` if gone (zombies included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its end.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # field 3: a zombie has exited, only its entry remains
        return None
    return fields[19]  # field 22 overall: starttime in clock ticks since boot


@dataclass(frozen=True)
class WorkerIdentity:
    """The lease owner id of one worker in this process."""

    boot_id: str
    pid: int
    start_ticks: str
    nonce: str

    @classmethod
    def current(cls) -> WorkerIdentity:
        """A fresh identity for a worker in this process."""
        pid = os.getpid()
        return cls(
            boot_id=_current_boot_id(),
            pid=pid,
            start_ticks=process_start_ticks(pid) or "0",
            nonce=secrets.token_hex(4),
        )

    @property
    def owner(self) -> str:
        """The text stored in ``jobs.lease_owner``."""
        return f"{self.boot_id}/{self.pid}/{self.start_ticks}/{self.nonce}"


def owner_is_gone(owner: str) -> bool:
    """True only when the owner process is certainly dead (same boot, pid gone or reused).

    An owner from another boot is gone too. Anything unparseable, or an owner on an
    unknown boot, is treated as possibly alive: its lease will lapse instead.
    """
    parts = owner.split("/")
    if len(parts) != 4 or not parts[1].isdigit():
        return False
    owner_boot, pid_text, ticks, _nonce = parts
    current_boot = _current_boot_id()
    if UNKNOWN_BOOT in (owner_boot, current_boot):
        return False
    if owner_boot != current_boot:
        return True
    pid = int(pid_text)
    observed = process_start_ticks(pid)
    return observed is None or observed != ticks
