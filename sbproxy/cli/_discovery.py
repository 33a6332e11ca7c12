"""How ``sbproxy models ps|load|stop`` and ``apply`` find a running ``sbproxy run``.

While it serves, ``sbproxy run`` keeps one owner-only file, ``run-<pid>.json`` (mode 0600 in
a 0700 directory), naming its admin URL, user and generated password, its gateway URL and its
process (pid and start ticks). The directory is ``$XDG_RUNTIME_DIR/sbproxy`` when that is
set to an existing directory, else ``run/`` under the default cache root (the same for
every command, whatever ``--cache-dir`` a run used). The file is removed when ``run``
returns; one left by a killed ``run`` is ignored, because its pid no longer has those start
ticks.

The admin verbs read it only for what their flags and environment (``--admin-url`` /
``SB_ADMIN_URL``, ``--password`` / ``SB_ADMIN_PASSWORD``) leave unset, and never send a
discovered password to another URL than the one it was written for.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from sbproxy.model_host.artifacts import resolve_cache_root
from sbproxy.workflows import process_start_ticks

__all__ = ["RunRecord", "discovery_dir", "find_run", "published"]


@dataclass(frozen=True)
class RunRecord:
    """One running ``sbproxy run`` as its discovery file says."""

    admin_url: str
    username: str
    password: str
    gateway_url: str
    pid: int
    start_ticks: str

    def alive(self) -> bool:
        """Whether that very process still runs (a reused pid has other start ticks)."""
        return process_start_ticks(self.pid) == self.start_ticks


def discovery_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where discovery files live (see the module docstring)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_absolute() and Path(runtime).is_dir():
        return Path(runtime) / "sbproxy"
    return resolve_cache_root(environ=env).root / "run"


@contextlib.contextmanager
def published(record: RunRecord, *, directory: Path | None = None) -> Iterator[Path]:
    """Write ``record``'s owner-only discovery file for the duration of the block."""
    folder = directory or discovery_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    path = folder / f"run-{record.pid}.json"
    temporary = path.with_suffix(".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(record.__dict__, handle)
    temporary.replace(path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def find_run(*, directory: Path | None = None) -> RunRecord | None:
    """The newest live ``sbproxy run`` of this user, or ``None``."""
    folder = directory or discovery_dir()
    found: list[tuple[float, RunRecord]] = []
    with contextlib.suppress(OSError):
        for path in folder.glob("run-*.json"):
            try:
                if path.stat().st_uid != os.getuid():
                    continue  # someone else's: never trusted
                record = RunRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if record.alive():
                found.append((path.stat().st_mtime, record))
    return max(found, key=lambda item: item[0])[1] if found else None
