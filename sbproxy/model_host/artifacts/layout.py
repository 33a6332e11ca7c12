"""The cache root and its fixed layout.

``<root>/blobs/sha256/<hex>``, ``<root>/snapshots/<artifact digest>/``,
``<root>/metadata/<artifact digest>.json``, ``<root>/partials/``, ``<root>/locks/``,
``<root>/jobs/journal.db`` (the SQLite job journal shared by server and CLI processes) and
``<root>/engines/``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbproxy.errors import SbproxyError

__all__ = ["CacheLayout", "resolve_cache_root"]

ENV_CACHE_DIR = "SBPROXY_CACHE_DIR"
SYSTEM_CACHE_DIR = Path("/var/lib/sbproxy/models")


@dataclass(frozen=True)
class CacheLayout:
    """Paths under one absolute cache root."""

    root: Path

    @property
    def journal(self) -> Path:
        """The SQLite job journal."""
        return self.root / "jobs" / "journal.db"

    @property
    def blobs(self) -> Path:
        """Verified file contents by SHA-256."""
        return self.root / "blobs" / "sha256"

    @property
    def snapshots(self) -> Path:
        """Published artifacts by artifact digest."""
        return self.root / "snapshots"

    @property
    def metadata(self) -> Path:
        """Ready markers by artifact digest."""
        return self.root / "metadata"

    @property
    def partials(self) -> Path:
        """In-progress downloads and their resume state."""
        return self.root / "partials"

    @property
    def locks(self) -> Path:
        """Cross-process lock and lease files."""
        return self.root / "locks"

    @property
    def engines(self) -> Path:
        """Acquired or built engine binaries."""
        return self.root / "engines"


def _writable_ancestor(path: Path) -> bool:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return os.access(candidate, os.W_OK)
    return False


def resolve_cache_root(
    explicit: str | Path | None = None,
    *,
    configured: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheLayout:
    """Choose the cache root, first match wins.

    Order: ``explicit`` (``--cache-dir``) > ``configured`` (``proxy.model_host.cache
    .directory``) > ``$SBPROXY_CACHE_DIR`` > ``/var/lib/sbproxy/models`` when its nearest
    existing ancestor is writable > ``$XDG_CACHE_HOME/sbproxy/models`` (default
    ``~/.cache/sbproxy/models``).

    Raises:
        SbproxyError: ``invalid_cache_dir`` when the chosen path is relative; a relative root
            would depend on the working directory of whichever process opens it.
    """
    env = os.environ if environ is None else environ
    chosen: str | Path | None = explicit or configured or env.get(ENV_CACHE_DIR) or None
    if chosen is None:
        if _writable_ancestor(SYSTEM_CACHE_DIR):
            chosen = SYSTEM_CACHE_DIR
        else:
            base = env.get("XDG_CACHE_HOME") or str(
                Path(env.get("HOME", "~")).expanduser() / ".cache"
            )
            chosen = Path(base) / "sbproxy" / "models"
    path = Path(chosen).expanduser()
    if not path.is_absolute():
        raise SbproxyError(
            f"cache directory {str(chosen)!r} must be an absolute path",
            code="invalid_cache_dir",
            remediation="Pass an absolute --cache-dir (or set proxy.model_host.cache.directory).",
        )
    return CacheLayout(root=path)
