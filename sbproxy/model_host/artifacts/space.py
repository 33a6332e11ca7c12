"""Free space on the cache file system: checked before a download, reported when it runs out.

Three rules:

* A pull checks first (:func:`require_space`): the bytes its files still need (their sizes
  less what their partials already hold) plus :data:`JOURNAL_RESERVE_BYTES` must be free on
  the file system of ``partials/``, or it fails at once with ``disk_full`` and the figures.
  The reserve is room for the job journal, which usually shares the cache's file system: a
  pull that would leave it no room could not even record its own end.
* A write that still meets ``ENOSPC`` / ``EDQUOT`` (another writer filled the disk meanwhile)
  is ``disk_full`` too (:func:`disk_full_errors`), naming the path, the bytes it still
  needed and the bytes free.
* A download that filled the disk gives back the last :data:`JOURNAL_RESERVE_BYTES` of its
  partial (:func:`release_reserve`), so that the journal can record the failure; the rest of
  the partial is kept and the next pull resumes from it. So does one whose progress write
  found the journal full on the same file system (:func:`journal_full_beside`).

Every :class:`~sbproxy.model_host.artifacts.errors.DiskFull` carries ``details``
``{"path", "needed_bytes", "free_bytes"}``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.errors import DiskFull

__all__ = [
    "JOURNAL_RESERVE_BYTES",
    "disk_full",
    "disk_full_errors",
    "free_bytes",
    "is_disk_full",
    "journal_full_beside",
    "release_reserve",
    "require_space",
]

# Room kept for the SQLite journal: a failed step, the job's end and their events are a few
# WAL frames of 4 KiB each; a checkpoint that grows the database file needs a few more. One
# MiB is hundreds of frames, and small beside any model file.
JOURNAL_RESERVE_BYTES = 1024 * 1024
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is the OS saying the file system or the user's quota is full."""
    return isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS


def _device(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return candidate.stat().st_dev
        except OSError:
            continue
    return None


def journal_full_beside(exc: BaseException, path: Path) -> bool:
    """Whether ``exc`` is the journal's ``disk_full`` (from the store, its ``details["path"]``
    the journal) on the same file system as ``path``."""
    if not isinstance(exc, SbproxyError) or exc.code != "disk_full":
        return False
    journal = exc.details.get("path")
    if not isinstance(journal, str) or isinstance(exc, DiskFull):
        return False
    here = _device(path)
    return here is not None and here == _device(Path(journal))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``.

    ``path`` may not exist yet: its nearest existing ancestor is asked. Uses ``statvfs``
    (``f_bavail x f_frsize``), the figure ``df`` prints as available.
    """
    for candidate in (path, *path.parents):
        try:
            stats = os.statvfs(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return stats.f_bavail * stats.f_frsize
    return 0


def disk_full(
    path: Path, *, action: str, needed_bytes: int, kept: str, free: int | None = None
) -> DiskFull:
    """The ``disk_full`` error for ``action`` at ``path``.

    Args:
        path: The file or directory that could not be written.
        action: What was being done ("pulling tiny:q4_k_m", "writing <file>").
        needed_bytes: Bytes the action still needed (0 when unknown).
        kept: What the operator can rely on afterwards ("the partial download is kept").
        free: Bytes free, if already measured (else measured now).

    Returns:
        A :class:`DiskFull` with ``details`` ``{"path", "needed_bytes", "free_bytes"}``.
    """
    available = free_bytes(path) if free is None else free
    return DiskFull(
        f"not enough space on the file system of {path}: {action} needs {needed_bytes} "
        f"more bytes, {available} bytes are free",
        remediation="Free space (`sbproxy models gc`, `sbproxy models prune`, `sbproxy models "
        f"partials` lists unfinished downloads) or move the cache, then pull again; {kept}.",
        details={"path": str(path), "needed_bytes": needed_bytes, "free_bytes": available},
    )


@contextlib.contextmanager
def disk_full_errors(
    action: str, *, path: Path, kept: str, needed_bytes: int = 0
) -> Iterator[None]:
    """Turn ``ENOSPC`` / ``EDQUOT`` inside the block into :func:`disk_full`.

    Args:
        action: What was being done, for the message.
        path: Where it was written.
        kept: What the operator can rely on afterwards.
        needed_bytes: Bytes the block was to write, when known.

    Raises:
        DiskFull: ``disk_full``; other ``OSError`` propagate unchanged.
    """
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full(path, action=action, needed_bytes=needed_bytes, kept=kept) from exc
        raise


def require_space(
    path: Path, *, needed_bytes: int, action: str, reserve_bytes: int = JOURNAL_RESERVE_BYTES
) -> None:
    """Fail fast unless ``needed_bytes`` plus ``reserve_bytes`` are free where ``path`` lives.

    Raises:
        DiskFull: ``disk_full`` with the bytes needed (reserve included) and the bytes free;
            nothing was written.
    """
    if needed_bytes <= 0:
        return
    available = free_bytes(path)
    wanted = needed_bytes + reserve_bytes
    if available < wanted:
        raise disk_full(
            path,
            action=f"{action} (with {reserve_bytes} kept free for the job journal)",
            needed_bytes=wanted,
            kept="nothing was downloaded",
            free=available,
        )


def release_reserve(part: Path, *, reserve_bytes: int = JOURNAL_RESERVE_BYTES) -> int:
    """Cut the last ``reserve_bytes`` off a partial that filled the disk; the bytes freed.

    The partial stays resumable (a resume starts from its length and the final SHA-256
    decides); the freed room lets the journal record why the download stopped.
    """
    try:
        size = part.stat().st_size
        keep = max(0, size - reserve_bytes)
        os.truncate(part, keep)
    except OSError:
        return 0
    return size - keep
