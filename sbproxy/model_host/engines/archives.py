"""Unpacking engine archives (llama.cpp source and release tarballs) without escaping the target.

Python 3.11.4 and later refuse unsafe members with the standard library's ``data`` filter
(PEP 706): absolute names, names or links that leave the target, device and FIFO nodes, and
they drop set-uid bits. Older 3.11 releases -- Debian 12's system ``python3`` is 3.11.2 -- have
neither the ``filter`` argument nor ``tarfile.FilterError``. So the refusals are made here,
before anything is written, on every Python (the standard filter, where present, stays as a
second check), and on older ones regular files keep only their permission bits.

Errors: :class:`EngineError` with ``engine_blocked`` naming the archive and the member.
"""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from sbproxy.model_host.engines.errors import EngineError

__all__ = ["extract_safely", "has_stdlib_filter"]


def has_stdlib_filter() -> bool:
    """Whether this Python has PEP 706's extraction filters (3.11.4 and later)."""
    return hasattr(tarfile, "data_filter")


def extract_safely(
    archive: Path,
    bundle: tarfile.TarFile,
    target: Path,
    members: Sequence[tarfile.TarInfo] | None = None,
    *,
    stdlib_filter: bool | None = None,
) -> None:
    """Extract ``members`` (default: all) of ``bundle`` under ``target``.

    ``stdlib_filter`` chooses the standard library's ``data`` filter (default: when this
    Python has it) or plain extraction with file modes cut to their permission bits. Either
    way every member is checked here first, so both refuse the same archives. Raises
    :class:`EngineError` ``engine_blocked``, before anything is written, for a member that
    would land outside ``target`` or is not a plain file, directory or link inside it.
    """
    chosen = list(bundle.getmembers() if members is None else members)
    for member in chosen:
        problem = _problem(member)
        if problem is not None:
            raise _unsafe(archive, f"{member.name!r} {problem}")
    use_stdlib = has_stdlib_filter() if stdlib_filter is None else stdlib_filter
    if use_stdlib:
        filter_error: type[Exception] = tarfile.FilterError
        try:
            bundle.extractall(target, members=chosen, filter="data")
        except filter_error as exc:
            raise _unsafe(archive, str(exc)) from exc
        return
    for member in chosen:
        if member.isfile():
            member.mode &= 0o755
    bundle.extractall(target, members=chosen)  # noqa: S202 - every member checked above


def _problem(member: tarfile.TarInfo) -> str | None:
    """Why ``member`` may not be extracted, or ``None``."""
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return "is a device, FIFO or other special file"
    if _escapes(PurePosixPath(member.name), PurePosixPath()):
        return "would be written outside the target directory"
    if member.issym():
        if _escapes(PurePosixPath(member.linkname), PurePosixPath(member.name).parent):
            return f"links to {member.linkname!r}, outside the target directory"
    elif member.islnk() and _escapes(PurePosixPath(member.linkname), PurePosixPath()):
        return f"hard-links to {member.linkname!r}, outside the target directory"
    return None


def _escapes(path: PurePosixPath, base: PurePosixPath) -> bool:
    """Whether ``path``, taken relative to ``base`` inside the target, leaves the target."""
    if path.is_absolute():
        return True
    depth = len(base.parts)
    for part in path.parts:
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part != ".":
            depth += 1
    return False


def _unsafe(archive: Path, detail: str) -> EngineError:
    return EngineError(
        f"{archive} contains an unsafe member: {detail}",
        code="engine_blocked",
        remediation="Use the pinned upstream archive; nothing was installed from this one.",
    )
