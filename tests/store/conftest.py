"""A fresh journal database per test (real SQLite in the test's temporary directory)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sbproxy.store import Database


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[Database]:
    database = await Database.open(tmp_path / "journal.db")
    try:
        yield database
    finally:
        await database.close()
