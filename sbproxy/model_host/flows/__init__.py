"""Flows of the model host."""

from __future__ import annotations

__all__: list[str] = []
