"""Fixtures the fleet's real-host tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.pg_hosts import FILE, REPO, REVISION, catalog, tiny_gguf
from tests.support.hf_server import HfMirror


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[HfMirror]:
    """An HF-shaped mirror serving ``tiny`` (the hosts' catalog, written beside them, also
    lists ``tiny-imp`` for ``models import``)."""
    pulled, imported = tiny_gguf(tmp_path / "src", vocab=50), tiny_gguf(tmp_path / "imp", vocab=60)
    catalog(tmp_path / "catalog.yaml", pulled, imported)
    with HfMirror() as served:
        served.add_file(REPO, REVISION, FILE, pulled)
        yield served
