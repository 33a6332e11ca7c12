"""The ``admin_managed`` desired-state store: one JSON file of deployment revisions.

Under ``authority: admin_managed`` the deployments come from the file at ``store_path``, not
from ``sb.yml`` (whose ``deployments`` only seed an empty store at first start). Each write is
a compare-and-set on ``expected_revision`` (``None`` means "the store is empty"), under an
exclusive lock on ``<store_path>.lock`` held across processes, and lands atomically: a
temporary file in the same directory, ``fsync``, ``rename`` over the old file, ``fsync`` of
the directory. ``sb.yml`` is never written.

A revision's ``content_digest`` is the SHA-256 (hex) of the RFC 8785 canonical JSON of
``{schema_version, revision, source_mode, catalog_revision, deployments}`` (reference 3.3),
so it does not depend on key order and survives a JSON round trip.

Hosts sharing a PostgreSQL journal (``proxy.model_host.journal``) share one store instead:
the same documents, one row per revision in the journal's database
(:class:`~sbproxy.store.revisions.SharedRevisions`), the compare-and-set done by the
revision's primary key, so of two hosts writing at once one wins and the other gets
``revision_conflict``. ``store_path`` is not used then.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rfc8785

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts.locks import hold_blocking
from sbproxy.store.revisions import SharedRevisions

__all__ = [
    "MAX_REVISION",
    "DeploymentRevision",
    "RevisionConflict",
    "RevisionStore",
    "revision_digest",
]

SCHEMA_VERSION = 1
SOURCE_MODE = "admin_managed"
# Revisions are JSON numbers that JavaScript clients read exactly (2^53 - 1).
MAX_REVISION = (1 << 53) - 1
LOCK_TIMEOUT_S = 30.0


class RevisionConflict(SbproxyError):
    """``expected_revision`` is not the store's revision (``revision_conflict``)."""

    default_code = "revision_conflict"


@dataclass(frozen=True)
class DeploymentRevision:
    """One committed desired state of an ``admin_managed`` host."""

    revision: int
    content_digest: str
    catalog_revision: str
    deployments: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The stored JSON object."""
        return {
            "schema_version": SCHEMA_VERSION,
            "revision": self.revision,
            "source_mode": SOURCE_MODE,
            "catalog_revision": self.catalog_revision,
            "deployments": dict(self.deployments),
            "content_digest": self.content_digest,
        }


def revision_digest(*, revision: int, catalog_revision: str, deployments: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of a revision (see the module docstring)."""
    body = {
        "schema_version": SCHEMA_VERSION,
        "revision": revision,
        "source_mode": SOURCE_MODE,
        "catalog_revision": catalog_revision,
        "deployments": dict(deployments),
    }
    return hashlib.sha256(rfc8785.dumps(body)).hexdigest()  # type: ignore[arg-type]


def _named(revision: int | None) -> str:
    return "empty" if revision is None else str(revision)


def _store_error(path: Path, message: str) -> SbproxyError:
    return SbproxyError(
        f"revision store {path}: {message}",
        code="store_failed",
        remediation="Fix or move the file named by proxy.model_host.store_path.",
        details={"store_path": str(path)},
    )


class RevisionStore:
    """Compare-and-set store of deployment revisions in one JSON file (module docstring).

    Args:
        path: ``proxy.model_host.store_path`` (absolute after config loading).
        journal_url: The shared PostgreSQL journal's URL: the store lives there instead of
            at ``path`` (module docstring).
    """

    def __init__(self, path: Path, *, journal_url: str | None = None) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._shared = SharedRevisions(journal_url) if journal_url else None

    def load(self) -> DeploymentRevision | None:
        """The current revision, or ``None`` for an empty (absent) store.

        Raises:
            SbproxyError: ``store_failed`` when the file is unreadable, not a revision
                document, or its ``content_digest`` does not match its content;
                ``journal_unavailable`` when the shared store's server cannot be reached.
        """
        if self._shared is not None:
            latest = self._shared.latest()
            return None if latest is None else self._parse(latest[1].encode())
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _store_error(self.path, f"cannot be read ({exc.strerror})") from exc
        return self._parse(raw)

    def _parse(self, raw: bytes) -> DeploymentRevision:
        """A stored document, checked (``store_failed`` when it is not one)."""
        try:
            document = json.loads(raw)
            revision = int(document["revision"])
            catalog_revision = str(document["catalog_revision"])
            deployments = document["deployments"]
            digest = str(document["content_digest"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _store_error(self.path, "is not a revision document") from exc
        if not isinstance(deployments, dict) or not 1 <= revision <= MAX_REVISION:
            raise _store_error(self.path, "is not a revision document")
        expected = revision_digest(
            revision=revision, catalog_revision=catalog_revision, deployments=deployments
        )
        if digest != expected:
            raise _store_error(self.path, "content_digest does not match its content")
        return DeploymentRevision(revision, digest, catalog_revision, deployments)

    def compare_and_set(
        self,
        *,
        expected_revision: int | None,
        catalog_revision: str,
        deployments: Mapping[str, Any],
    ) -> DeploymentRevision:
        """Write the next revision if the store is still at ``expected_revision``.

        Returns:
            The written revision (``actual + 1``, or 1 for an empty store).

        Raises:
            RevisionConflict: ``revision_conflict`` with ``expected_revision`` and
                ``actual_revision`` in its details; the file is unchanged.
            SbproxyError: ``store_failed`` (lock timeout, I/O error, a corrupt file,
                ``counter_overflow`` past 2^53 - 1); ``journal_unavailable`` (shared store).
        """
        if self._shared is not None:
            return self._shared_compare_and_set(expected_revision, catalog_revision, deployments)
        try:
            with hold_blocking(self._lock_path, timeout_s=LOCK_TIMEOUT_S):
                current = self.load()
                actual = current.revision if current else None
                if actual != expected_revision:
                    raise RevisionConflict(
                        f"the store is at revision {_named(actual)}, not "
                        f"{_named(expected_revision)}",
                        remediation="Read GET /admin/model-host/deployments and retry with "
                        "its revision.",
                        details={"expected_revision": expected_revision, "actual_revision": actual},
                    )
                revision = (actual or 0) + 1
                if revision > MAX_REVISION:
                    raise SbproxyError("the revision counter is exhausted", code="counter_overflow")
                written = DeploymentRevision(
                    revision=revision,
                    content_digest=revision_digest(
                        revision=revision,
                        catalog_revision=catalog_revision,
                        deployments=deployments,
                    ),
                    catalog_revision=catalog_revision,
                    deployments=dict(deployments),
                )
                self._write(written)
                return written
        except TimeoutError as exc:
            raise _store_error(self.path, "its lock is held by another process") from exc

    def _shared_compare_and_set(
        self,
        expected_revision: int | None,
        catalog_revision: str,
        deployments: Mapping[str, Any],
    ) -> DeploymentRevision:
        shared = self._shared
        assert shared is not None  # noqa: S101 - only called for a shared store
        revision = (expected_revision or 0) + 1
        if revision > MAX_REVISION:
            raise SbproxyError("the revision counter is exhausted", code="counter_overflow")
        written = DeploymentRevision(
            revision=revision,
            content_digest=revision_digest(
                revision=revision, catalog_revision=catalog_revision, deployments=deployments
            ),
            catalog_revision=catalog_revision,
            deployments=dict(deployments),
        )
        document = json.dumps(written.to_dict(), sort_keys=True)
        actual = shared.insert_next(
            expected=expected_revision, revision=revision, document=document
        )
        if actual is None:
            return written
        found = None if actual == 0 else actual
        raise RevisionConflict(
            f"the store is at revision {_named(found)}, not {_named(expected_revision)}",
            remediation="Read GET /admin/model-host/deployments and retry with its revision.",
            details={"expected_revision": expected_revision, "actual_revision": found},
        )

    def _write(self, revision: DeploymentRevision) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=".revision-", dir=directory)
            try:
                with os.fdopen(handle, "wb") as out:
                    out.write(json.dumps(revision.to_dict(), indent=2, sort_keys=True).encode())
                    out.flush()
                    os.fsync(out.fileno())
                Path(temporary).replace(self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _store_error(self.path, f"cannot be written ({exc.strerror})") from exc
