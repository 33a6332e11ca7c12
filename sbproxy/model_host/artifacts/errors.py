"""Errors of the artifact manager (reason codes are the reference's artifact error kinds)."""

from __future__ import annotations

from sbproxy.errors import SbproxyError

__all__ = [
    "ArtifactError",
    "CacheCorrupt",
    "CacheInUse",
    "DigestMismatch",
    "DiskFull",
    "HttpStatusError",
    "ManualArtifactMissing",
    "OfflineArtifactMissing",
    "PickleRefused",
    "PickleUnsafe",
    "ProxyError",
    "RemovalBlocked",
    "SizeMismatch",
    "SourceError",
    "TransportError",
]


class ArtifactError(SbproxyError):
    """Base of artifact errors (``invalid_artifact``)."""

    default_code = "invalid_artifact"


class SourceError(ArtifactError):
    """A source reference cannot be used as written (``invalid_source``)."""

    default_code = "invalid_source"


class TransportError(ArtifactError):
    """The network failed (connection, timeout, cut stream): retryable (``transport``)."""

    default_code = "transport"
    default_retryable = True


class HttpStatusError(ArtifactError):
    """The server answered with an unusable status (``http_status``); 5xx and 429 retry."""

    default_code = "http_status"


class SizeMismatch(ArtifactError):
    """A file's length differs from the catalog's (``size_mismatch``)."""

    default_code = "size_mismatch"


class DigestMismatch(ArtifactError):
    """A file's SHA-256 differs from the catalog's (``digest_mismatch``)."""

    default_code = "digest_mismatch"


class CacheCorrupt(ArtifactError):
    """A published snapshot no longer matches its metadata (``cache_corrupt``); never
    repaired silently."""

    default_code = "cache_corrupt"


class CacheInUse(ArtifactError):
    """Another serving host already holds this cache (``cache_in_use``): one host owns one
    cache's engines and runtime jobs."""

    default_code = "cache_in_use"


class ManualArtifactMissing(ArtifactError):
    """``pull: manual`` and the artifact is not cached (``manual_artifact_missing``)."""

    default_code = "manual_artifact_missing"


class OfflineArtifactMissing(ArtifactError):
    """Network use is denied and the artifact is not cached (``offline_artifact_missing``)."""

    default_code = "offline_artifact_missing"


class PickleRefused(ArtifactError):
    """A pickle artifact without ``allow_pickle: true`` in the catalog (``pickle_refused``)."""

    default_code = "pickle_refused"


class PickleUnsafe(ArtifactError):
    """A pickle file references globals outside the safe set (``pickle_unsafe``)."""

    default_code = "pickle_unsafe"


class RemovalBlocked(ArtifactError):
    """An artifact is protected from removal (``removal_blocked``; ``details['reason']`` is
    configured, resident, pinned, leased, locked or an active job state)."""

    default_code = "removal_blocked"


class DiskFull(ArtifactError):
    """The cache file system has too little space, or ran out of it (``disk_full``).

    Built by :mod:`sbproxy.model_host.artifacts.space`, whose errors carry ``details``
    ``{"path", "needed_bytes", "free_bytes"}``.
    """

    default_code = "disk_full"


class ProxyError(ArtifactError):
    """A proxy variable (``HTTPS_PROXY``, ``HTTP_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) cannot
    be used as written (``invalid_proxy``); ``details["variable"]`` names it."""

    default_code = "invalid_proxy"
