"""The HTTP surface: the only package that imports litestar (gateway, admin, jobs, metrics)."""

from __future__ import annotations

__all__: list[str] = []
