"""Artifacts of the model host: the content-addressed cache and its layout."""

from __future__ import annotations

from sbproxy.model_host.artifacts.layout import CacheLayout, resolve_cache_root

__all__ = ["CacheLayout", "resolve_cache_root"]
