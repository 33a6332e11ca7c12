"""Artifacts of the model host: the content-addressed cache, sources and downloads."""

from __future__ import annotations

from sbproxy.model_host.artifacts.cache import (
    ArtifactCache,
    CachedFile,
    CachedMetadata,
    CacheState,
    PartialDownload,
    PartialFile,
)
from sbproxy.model_host.artifacts.layout import (
    CacheLayout,
    check_cache_writable,
    resolve_cache_root,
    unusable_cache_dir,
)

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
