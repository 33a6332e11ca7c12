"""Fixtures shared by the artifact tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.hf_server import HfMirror


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch) -> Iterator[HfMirror]:
    """A local HF-shaped server that this process's ``HF_ENDPOINT`` points at, with no token.

    ``test_pull_processes`` overrides it: its children get the endpoint in their own env.
    """
    with HfMirror() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        yield server
