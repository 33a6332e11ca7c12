"""Engine output files under the cache root: which exist, and the redacted end of one.

Each engine generation writes ``<root>/logs/<deployment>-g<generation>.log``
(:meth:`~sbproxy.model_host.artifacts.CacheLayout.engine_log`). Readers (the console's logs
page, through :class:`~sbproxy.model_host.service.ModelHostService`) get frozen values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sbproxy.redact import redact

__all__ = ["TAIL_BYTES", "TAIL_LINES", "LogTail", "log_generations", "read_tail"]

# A tail shows at most the last 64 KiB of a file, and of those the last 200 lines.
TAIL_BYTES: Final = 64 * 1024
TAIL_LINES: Final = 200
_LOG_NAME: Final = re.compile(r"(?P<deployment>.+)-g(?P<generation>\d+)\.log")


@dataclass(frozen=True)
class LogTail:
    """The end of one log: ``text`` (redacted, not yet HTML-escaped), whether older output
    was left out, and the file's size in bytes."""

    text: str
    truncated: bool
    size_bytes: int


def log_generations(logs_dir: Path) -> dict[str, list[int]]:
    """Deployment -> the generations with a log under ``logs_dir``, newest first (empty when
    the directory does not exist). Blocking: lists the directory."""
    found: dict[str, list[int]] = {}
    try:
        names = [entry.name for entry in logs_dir.iterdir() if entry.is_file()]
    except FileNotFoundError:
        return found
    for name in names:
        match = _LOG_NAME.fullmatch(name)
        if match is not None:
            found.setdefault(match["deployment"], []).append(int(match["generation"]))
    for generations in found.values():
        generations.sort(reverse=True)
    return found


def read_tail(path: Path, *, max_bytes: int = TAIL_BYTES, max_lines: int = TAIL_LINES) -> LogTail:
    """The last ``max_lines`` lines within the last ``max_bytes`` of ``path``, with secrets
    redacted (:func:`sbproxy.redact.redact`). A missing file is an empty tail. Blocking.

    A cut that falls inside a line drops that partial line; undecodable bytes become U+FFFD.
    """
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            start = max(0, size - max_bytes)
            handle.seek(start)
            data = handle.read(max_bytes)
    except FileNotFoundError:
        return LogTail(text="", truncated=False, size_bytes=0)
    truncated = start > 0
    if truncated:
        data = data.partition(b"\n")[2]
    lines = data.decode("utf-8", errors="replace").splitlines()
    if len(lines) > max_lines:
        lines = lines[-max_lines:]
        truncated = True
    return LogTail(text=redact("\n".join(lines)), truncated=truncated, size_bytes=size)
