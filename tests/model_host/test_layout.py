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


def test_without_a_setting_every_user_root_included_caches_under_xdg_or_home(
    tmp_path: Path,
) -> None:
    root_home = {"HOME": "/root"}  # root gets no system-wide default of its own
    assert resolve_cache_root(None, environ=root_home).root == Path("/root/.cache/sbproxy/models")
    xdg = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert resolve_cache_root(None, environ=xdg).root == tmp_path / "xdg" / "sbproxy" / "models"
    relative_xdg = {"HOME": str(tmp_path), "XDG_CACHE_HOME": "cache"}  # ignored, per XDG
    assert resolve_cache_root(None, environ=relative_xdg).root == (
        tmp_path / ".cache" / "sbproxy" / "models"
    )
