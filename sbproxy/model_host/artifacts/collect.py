"""Removing artifacts and collecting the cache: protection, deletion, orphan blobs.

An artifact is protected -- and removal or collection refuses it with a reason -- when it
is ``configured`` (a deployment of the loaded configuration resolves to it), ``resident``
(a running engine serves it), ``pinned``, ``leased`` (some process holds a shared lease on
it), ``locked`` (a publish or delete holds its lock), or when a pull job for it is
``queued``, ``running`` or ``parked``. Shared blobs are freed only when no published
artifact references them any more, and counted once.

A partial download (``partials/<digest>/``) belongs to its pull job while that job is
unfinished -- even one whose process died, since rerunning the pull resumes from it. Once
no unfinished pull owns it (the job failed or was cancelled) it is abandoned, and prune and
gc delete it with the blobs only it still referenced.

Deleting is crash-safe in this order: remove the ready marker (the artifact stops being a
hit), rename the snapshot to ``snapshots/.deleting-<digest>-<pid>`` and remove it, drop its
partials, then delete the blobs nothing references. Each piece tolerates being absent, so
a delete that died half-way simply runs again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from sbproxy.model_host.artifacts.cache import ArtifactCache
from sbproxy.model_host.artifacts.locks import try_hold

__all__ = [
    "Collected",
    "Deletion",
    "abandoned_partials",
    "delete_artifact",
    "delete_orphans",
    "lease_or_lock_reason",
    "orphan_blobs",
]


@dataclass(frozen=True)
class Deletion:
    """What a delete did: whether there was anything, and the bytes it freed."""

    removed: bool
    reclaimed_bytes: int


@dataclass(frozen=True)
class Collected:
    """What :func:`delete_orphans` deleted: counts and the bytes freed in all."""

    orphan_blobs: int
    abandoned_partials: int
    reclaimed_bytes: int


def lease_or_lock_reason(cache: ArtifactCache, digest: str) -> str | None:
    """``leased`` or ``locked`` when another holder has the artifact right now, else None.

    Only a momentary check; callers hold the exclusive mutation lock while they delete, and
    :func:`delete_artifact` takes the locks for the deletion itself.
    """
    with try_hold(cache.lease_lock(digest)) as free:
        if not free:
            return "leased"
    with try_hold(cache.artifact_lock(digest)) as free:
        if not free:
            return "locked"
    return None


def _unlink_blobs(cache: ArtifactCache, candidates: set[str], keep: set[str]) -> int:
    freed = 0
    for sha256 in sorted(candidates - keep):
        path = cache.blob(sha256)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        freed += size
    return freed


def _delete_partial(cache: ArtifactCache, digest: str) -> int:
    """Delete ``partials/<digest>/`` and the blobs that only its manifest referenced; the
    bytes freed. The caller holds the mutation lock and has checked that no unfinished pull
    owns the partial."""
    directory = cache.layout.partials / digest
    if not directory.is_dir():
        return 0
    others = cache.pending_blobs(excluding={digest})
    mine = cache.pending_blobs() - others
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    shutil.rmtree(directory, ignore_errors=True)
    return size + _unlink_blobs(cache, mine, cache.referenced_blobs() | others)


def delete_artifact(
    cache: ArtifactCache, digest: str, *, blocked: Mapping[str, str]
) -> Deletion | str:
    """Delete one artifact unless something protects it right now.

    Args:
        cache: The cache.
        digest: Artifact digest.
        blocked: Explicit protection (digest -> reason) decided by the caller.

    Returns:
        The :class:`Deletion`, or the protection reason as a string.

    Blocking: call from a worker thread while holding the exclusive mutation lock.
    """
    if digest in blocked:
        return blocked[digest]
    with try_hold(cache.lease_lock(digest)) as unleased:
        if not unleased:
            return "leased"
        with try_hold(cache.artifact_lock(digest)) as unlocked:
            if not unlocked:
                return "locked"
            metadata = cache.read_metadata(digest)
            snapshot = cache.snapshot(digest)
            if metadata is None and not snapshot.exists():
                # Never published: at most a partial download, and the blobs only its
                # manifest still references (a multi-file pull promotes them one by one).
                return Deletion(removed=False, reclaimed_bytes=_delete_partial(cache, digest))
            used = {item.sha256 for item in metadata.files} if metadata else set()
            cache.metadata_path(digest).unlink(missing_ok=True)
            if snapshot.exists():
                doomed = cache.layout.snapshots / f".deleting-{digest}-{os.getpid()}"
                snapshot.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
            shutil.rmtree(cache.layout.partials / digest, ignore_errors=True)
            freed = _unlink_blobs(cache, used, cache.referenced_blobs())
            return Deletion(removed=True, reclaimed_bytes=freed)


def orphan_blobs(cache: ArtifactCache, *, pending: set[str] | None = None) -> dict[str, int]:
    """Blobs nothing references: sha256 -> bytes.

    References are the files of published artifacts and those of unfinished pulls (their
    ``partials/<digest>/.manifest.json``): a multi-file pull promotes blobs one by one before
    it publishes, and collecting them in between would break the resumed pull. ``pending``
    replaces the latter (a preview that leaves abandoned partials out).
    """
    if not cache.layout.blobs.is_dir():
        return {}
    referenced = cache.referenced_blobs() | (cache.pending_blobs() if pending is None else pending)
    return {
        path.name: path.stat().st_size
        for path in cache.layout.blobs.iterdir()
        if path.is_file() and path.name not in referenced
    }


def abandoned_partials(cache: ArtifactCache, owned: set[str]) -> dict[str, int]:
    """Partial-download directories no unfinished pull owns: artifact digest -> bytes.

    Args:
        cache: The cache.
        owned: Digests of artifacts with an unfinished (queued, running, parked) pull job.
    """
    root = cache.layout.partials
    if not root.is_dir():
        return {}
    return {
        directory.name: sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        for directory in root.iterdir()
        if directory.is_dir() and directory.name not in owned
    }


def delete_orphans(cache: ArtifactCache, *, owned: set[str]) -> Collected:
    """Delete abandoned partials, then unreferenced blobs and leftover work directories.

    Args:
        cache: The cache.
        owned: Digests with an unfinished pull job, whose partials are kept.

    Blocking; hold the exclusive mutation lock (promote and publish wait for it).
    """
    abandoned = abandoned_partials(cache, owned)
    freed = 0
    for digest, size in abandoned.items():
        shutil.rmtree(cache.layout.partials / digest, ignore_errors=True)
        freed += size
    orphans = orphan_blobs(cache)
    freed += _unlink_blobs(cache, set(orphans), set())
    if cache.layout.snapshots.is_dir():
        for leftover in cache.layout.snapshots.iterdir():
            if leftover.name.startswith((".staging-", ".deleting-")):
                shutil.rmtree(leftover, ignore_errors=True)
    return Collected(
        orphan_blobs=len(orphans), abandoned_partials=len(abandoned), reclaimed_bytes=freed
    )
