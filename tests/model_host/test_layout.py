"""Which cache root a process uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbproxy.errors import SbproxyError
from sbproxy.model_host.artifacts import resolve_cache_root


def test_explicit_then_configured_then_environment(tmp_path: Path) -> None:
    env = {"SBPROXY_CACHE_DIR": str(tmp_path / "env"), "HOME": str(tmp_path)}
    assert resolve_cache_root(tmp_path / "cli", configured="/srv/conf", environ=env).root == (
        tmp_path / "cli"
    )
    assert resolve_cache_root(None, configured="/srv/conf", environ=env).root == Path("/srv/conf")
    layout = resolve_cache_root(None, environ=env)
    assert layout.root == tmp_path / "env"
    assert layout.journal == tmp_path / "env" / "jobs" / "journal.db"


def test_relative_cache_root_is_refused() -> None:
    with pytest.raises(SbproxyError) as info:
        resolve_cache_root("relative/cache", environ={})
    assert info.value.code == "invalid_cache_dir"
    assert "absolute" in str(info.value)
