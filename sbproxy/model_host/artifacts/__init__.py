"""Artifacts of the model host: the content-addressed cache, sources and downloads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sbproxy._lazy_exports import lazy_exports
from sbproxy.model_host.artifacts.layout import (
    CacheLayout,
    check_cache_writable,
    resolve_cache_root,
    unusable_cache_dir,
)

# The cache imports the download stack (anyio, BLAKE3, the journal's fault points, pydantic):
# it loads when first used, so resolving a cache root costs none of it.
_LAZY = {
    "sbproxy.model_host.artifacts.cache": (
        "ArtifactCache",
        "CachedFile",
        "CachedMetadata",
        "CacheState",
        "PartialDownload",
        "PartialFile",
    ),
}
if TYPE_CHECKING:
    from sbproxy.model_host.artifacts.cache import (
        ArtifactCache,
        CachedFile,
        CachedMetadata,
        CacheState,
        PartialDownload,
        PartialFile,
    )
else:
    __getattr__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "ArtifactCache",
    "CacheLayout",
    "CacheState",
    "CachedFile",
    "CachedMetadata",
    "PartialDownload",
    "PartialFile",
    "check_cache_writable",
    "resolve_cache_root",
    "unusable_cache_dir",
]
