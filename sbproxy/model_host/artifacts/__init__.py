"""Artifacts of the model host: the content-addressed cache, sources and downloads."""

from __future__ import annotations

from sbproxy.model_host.artifacts.cache import ArtifactCache, CachedFile, CachedMetadata, CacheState
from sbproxy.model_host.artifacts.layout import CacheLayout, resolve_cache_root

__all__ = [
    "ArtifactCache",
    "CacheLayout",
    "CacheState",
    "CachedFile",
    "CachedMetadata",
    "resolve_cache_root",
]
