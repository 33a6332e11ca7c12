"""The cache root and its fixed layout.

``<root>/blobs/sha256/<hex>``, ``<root>/snapshots/<artifact digest>/``,
``<root>/metadata/<artifact digest>.json``, ``<root>/partials/``, ``<root>/locks/``,
``<root>/jobs/journal.db`` (the SQLite job journal shared by server and CLI processes),
``<root>/engines/`` and ``<root>/logs/<deployment>-g<generation>.log`` (engine output).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sbproxy.errors import SbproxyError

__all__ = ["CacheLayout", "check_cache_writable", "resolve_cache_root", "unusable_cache_dir"]

ENV_CACHE_DIR = "SBPROXY_CACHE_DIR"


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

    @property
    def owned_engines(self) -> Path:
        """Ownership records of the engine processes this cache's host started (what orphan
        reaping reads)."""
        return self.engines / "owned"

    @property
    def logs(self) -> Path:
        """Engine output, one file per deployment generation."""
        return self.root / "logs"

    def engine_log(self, deployment: str, generation: int) -> Path:
        """The output file of ``deployment``'s engine generation ``generation``."""
        return self.logs / f"{deployment}-g{generation}.log"


def unusable_cache_dir(root: Path, exc: OSError, *, at: Path | None = None) -> SbproxyError:
    """The ``invalid_cache_dir`` error for an ``OSError`` met while preparing ``root``.

    The message names the cache root, the path the OS refused (``at``, else the error's
    file name, when it differs from the root) and the OS reason (``Read-only file system``,
    ``Permission denied``, ``Not a directory`` ...).
    """
    refused = str(at) if at is not None else exc.filename
    where = f" ({refused})" if refused and str(refused) != str(root) else ""
    reason = exc.strerror or str(exc)
    return SbproxyError(
        f"cannot use the cache directory {root}: {reason}{where}.",
        code="invalid_cache_dir",
        remediation="Make it a writable directory for this user (a read-only file system "
        "cannot hold the cache), or choose another with --cache-dir or "
        "proxy.model_host.cache.directory.",
        details={"path": str(root), "errno": exc.errno},
    )


def check_cache_writable(layout: CacheLayout) -> None:
    """Create (then drop) an unnamed file under the root, so that a root on a read-only
    file system, or one this user may not write, is refused before any work starts.

    Creating the layout's directories is not enough: ``mkdir`` of an existing directory
    succeeds even where nothing can be written.

    Raises:
        SbproxyError: ``invalid_cache_dir`` naming the root and the OS reason.
    """
    try:
        with tempfile.TemporaryFile(dir=layout.locks):
            pass
    except OSError as exc:
        raise unusable_cache_dir(layout.root, exc, at=layout.locks) from exc


def resolve_cache_root(
    explicit: str | Path | None = None,
    *,
    configured: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheLayout:
    """Choose the cache root, first match wins.

    Order: ``explicit`` (``--cache-dir``) > ``configured`` (``proxy.model_host.cache
    .directory``) > ``$SBPROXY_CACHE_DIR`` > ``$XDG_CACHE_HOME/sbproxy/models`` >
    ``~/.cache/sbproxy/models``. The same for every command and every user, root included,
    so a model that ``main.sh`` or ``models pull`` cached is found by ``run``, ``serve``,
    ``doctor`` and ``jobs`` in a new shell.

    Raises:
        SbproxyError: ``invalid_cache_dir`` when the chosen path is relative; a relative root
            would depend on the working directory of whichever process opens it.
    """
    env = os.environ if environ is None else environ
    chosen: str | Path | None = explicit or configured or env.get(ENV_CACHE_DIR) or None
    if chosen is None:
        xdg = env.get("XDG_CACHE_HOME") or ""
        # The XDG spec says a relative value is invalid and to be ignored.
        base = (
            Path(xdg)
            if Path(xdg).is_absolute()
            else Path(env.get("HOME", "~")).expanduser() / ".cache"
        )
        chosen = base / "sbproxy" / "models"
    path = Path(chosen).expanduser()
    if not path.is_absolute():
        raise SbproxyError(
            f"cache directory {str(chosen)!r} must be an absolute path",
            code="invalid_cache_dir",
            remediation="Pass an absolute --cache-dir (or set proxy.model_host.cache.directory).",
        )
    return CacheLayout(root=path)
