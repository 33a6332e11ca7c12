"""The SQLite job journal: the only package that imports sqlalchemy, sqlmodel and aiosqlite."""

from __future__ import annotations

__all__: list[str] = []
