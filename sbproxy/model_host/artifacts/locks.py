"""Cross-process locks of the cache (files under ``<root>/locks``).

* ``<digest>.lock`` -- exclusive while one artifact is published or deleted;
* ``blob-<sha256>.lock`` -- exclusive while one blob is promoted;
* ``cache-mutation.lock`` -- shared by promote/publish, exclusive for gc, prune and removal,
  so that collection never deletes a blob a publish is about to link;
* ``lease-<digest>.lock`` -- shared by every live runtime that serves the artifact; removal
  and collection try it exclusively and refuse (``leased``) when they cannot get it;
* ``host.lock`` -- exclusive for the life of the one serving host (``sbproxy serve`` or
  ``run``) of the cache: a second host on the same cache is refused (``cache_in_use``), so
  the runtime jobs and engines recorded in the cache have one owner. The file names its
  holder (pid, start ticks, start time) for that refusal.

The admin_managed revision store's ``<store_path>.lock`` uses the same primitive
(:func:`hold_blocking`): one lock mechanism in the whole package. All are ``flock(2)`` locks
on the standard library's ``fcntl``: the kernel releases them when the holder dies, so a
crashed process never leaves a stale lock, and one primitive gives both shared and exclusive
modes (the ``filelock`` package's ``FileLock`` is exclusive only).
Waiting polls a non-blocking attempt with ``anyio.sleep``, so the event loop never blocks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio

from sbproxy.model_host.artifacts.errors import CacheInUse
from sbproxy.workflows import process_start_ticks

__all__ = ["DigestLease", "HostLock", "hold", "hold_blocking", "serving_host", "try_hold"]

_POLL_S = 0.05


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _try(fd: int, *, exclusive: bool) -> bool:
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.asynccontextmanager
async def hold(
    path: Path, *, exclusive: bool = True, timeout_s: float = 600.0
) -> AsyncIterator[None]:
    """Hold a lock on ``path``, waiting up to ``timeout_s``.

    Raises:
        TimeoutError: the lock stayed unavailable for ``timeout_s``.
    """
    fd = _open(path)
    try:
        with anyio.fail_after(timeout_s):
            while not _try(fd, exclusive=exclusive):
                await anyio.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_blocking(path: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` from synchronous code, waiting up to ``timeout_s``
    (polling a non-blocking attempt with ``time.sleep``: run it off the event loop, or only
    where the holders are quick).

    Raises:
        TimeoutError: the lock stayed unavailable for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with try_hold(path) as taken:
            if taken:
                yield
                return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{path} stayed locked for {timeout_s:g} s")
        time.sleep(_POLL_S)


@contextlib.contextmanager
def try_hold(path: Path, *, exclusive: bool = True) -> Iterator[bool]:
    """Try a lock on ``path`` without waiting; yields whether it was taken."""
    fd = _open(path)
    try:
        taken = _try(fd, exclusive=exclusive)
        try:
            yield taken
        finally:
            if taken:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class DigestLease:
    """A live runtime's shared lease on one artifact, held until :meth:`release`.

    Removal and collection cannot take the artifact while any lease is held, in this or any
    other process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = _open(path)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> None:
        """Drop the lease (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DigestLease:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class HostLock:
    """The serving host's exclusive hold on its cache (``<root>/locks/host.lock``), taken at
    start and kept until :meth:`release` (or the process's death: the kernel drops a
    ``flock`` with its holder, so a crashed host never blocks the next start).

    Raises (from :meth:`acquire`):
        CacheInUse: ``cache_in_use`` when another live process holds it; the message names
            that process's pid and the cache.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: Path, *, cache_root: Path) -> HostLock:
        """Take the lock on ``path`` without waiting and record this process in it."""
        fd = _open(path)
        if not _try(fd, exclusive=True):
            os.close(fd)
            holder = serving_host(path) or "unknown"  # "unknown": its record is being written
            raise CacheInUse(
                f"the cache {cache_root} is already served by sbproxy pid {holder}",
                remediation="Stop that host first, or give this one its own cache "
                "(proxy.model_host.cache.directory or --cache-dir).",
                details={"cache": str(cache_root), "pid": holder},
            )
        pid = os.getpid()
        record = {"pid": pid, "start_ticks": process_start_ticks(pid), "started_at": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let the next host start (idempotent)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def serving_host(path: Path) -> int | None:
    """The pid of the live host that serves the cache whose host lock is ``path``, or
    ``None`` when none does. Reads the holder's record only (never takes the lock, which
    would refuse a host starting at that moment): a record whose process is gone or whose
    pid now belongs to another process (start ticks) names no host."""
    try:
        record = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return None
    pid = record.get("pid") if isinstance(record, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        return None
    ticks = record.get("start_ticks")
    return pid if ticks is not None and process_start_ticks(pid) == ticks else None
