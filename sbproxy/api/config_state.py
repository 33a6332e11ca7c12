"""The host's configuration state: which file is active, and how the last reload went.

One :class:`ConfigState` per served host (built by :func:`~sbproxy.api.host.open_host`, read
by ``GET /admin/model-host/status`` as its ``config`` object and by ``sbproxy config
status``). It records the active configuration file's path, the SHA-256 of the bytes it was
compiled from, the runtime revision it was committed as, and the last reload attempt from
any source -- the file watcher, ``SIGHUP``, ``POST /admin/reload``, ``sbproxy apply``, the
admin ``PUT`` -- with its result, reason code, bounded message, time and job id.

The runtime slots are not involved: the state follows every commit through the manager's
``on_commit`` listeners (whatever started the reload) and is written only from the event
loop, so it needs no lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Final

from sbproxy.config import CompiledConfig
from sbproxy.errors import ConfigError, SbproxyError
from sbproxy.redact import redact

__all__ = ["ConfigState", "ReloadAttempt", "ReloadResult", "ReloadSource", "result_of"]

# A reload message is for a status line, not a log: the first issues, then cut.
MAX_MESSAGE_CHARS: Final = 1000
MAX_LISTED_ISSUES: Final = 5

# Codes that mean the candidate was refused as such (nothing was staged, and the same
# content will be refused again); any other failure happened while preparing or rolling it
# out and may succeed on a retry (capacity, an engine that did not start).
_REFUSALS: Final[frozenset[str]] = frozenset(
    {
        "invalid_config",
        "empty_config",
        "no_config_source",
        "source_mismatch",
        "lock_drift",
        "restart_required",
        "foundation_change",
        "superseded",
        "revision_conflict",
        "authority_read_only",
        "invalid_desired",
        "unknown_catalog_model",
        "unknown_catalog_variant",
    }
)


class ReloadSource(StrEnum):
    """What asked for a reload."""

    WATCH = "watch"
    SIGHUP = "sighup"
    ADMIN = "admin"
    APPLY = "apply"
    ADMIN_PUT = "admin_put"


class ReloadResult(StrEnum):
    """How a reload attempt ended: ``committed`` (live now), ``refused`` (the candidate was
    rejected before anything was staged) or ``failed`` (preparing or rolling it out failed;
    everything was put back)."""

    COMMITTED = "committed"
    REFUSED = "refused"
    FAILED = "failed"


def result_of(error: SbproxyError) -> ReloadResult:
    """``refused`` or ``failed`` for a reload that raised ``error`` (see ``_REFUSALS``)."""
    if isinstance(error, ConfigError) or error.code in _REFUSALS:
        return ReloadResult.REFUSED
    return ReloadResult.FAILED


def _message(error: SbproxyError) -> str:
    """One bounded, redacted line: a config error's first issues with their dotted paths."""
    if isinstance(error, ConfigError) and error.issues:
        text = "; ".join(issue.render() for issue in error.issues[:MAX_LISTED_ISSUES])
        if len(error.issues) > MAX_LISTED_ISSUES:
            text += f"; and {len(error.issues) - MAX_LISTED_ISSUES} more"
    else:
        text = error.message
    text = " ".join(redact(text).split())  # redacted line by line, then one line
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 1] + "…"
    return text


def _resolved(path: Path | None) -> Path | None:
    if path is None:
        return None
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return None


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    """ISO 8601 in UTC with milliseconds and ``Z``: ``2026-12-01T00:00:00.000Z``."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class ReloadAttempt:
    """One reload attempt.

    Attributes:
        source: What asked for it.
        result: How it ended.
        at: When it ended (ISO 8601, UTC).
        job_id: The ``reload`` job, when one ran (a file that does not validate runs none).
        revision: The runtime revision committed (``committed`` only).
        content_sha256: SHA-256 of the file content it tried, when known (the committed
            content; for a failure, what the watcher read).
        reason_code: The failure's reason code (``invalid_config``, ``restart_required``,
            ``insufficient_capacity``, ...); ``None`` when committed.
        message: What went wrong, redacted and at most 1000 characters; ``None`` when
            committed.
    """

    source: ReloadSource
    result: ReloadResult
    at: str
    job_id: str | None = None
    revision: int | None = None
    content_sha256: str | None = None
    reason_code: str | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``config.last_reload``."""
        return {
            "source": self.source.value,
            "result": self.result.value,
            "at": self.at,
            "job_id": self.job_id,
            "revision": self.revision,
            "content_sha256": self.content_sha256,
            "reason_code": self.reason_code,
            "message": self.message,
        }


@dataclass
class ConfigState:
    """The active configuration and the last reload attempt of one host.

    Attributes:
        path: The configuration file as the host was started with it, made absolute
            (``None``: not from a file).
        resolved_path: Where ``path`` led when the active content was committed (through
            every symlink: a ConfigMap's ``..<timestamp>/sb.yml``).
        content_sha256: SHA-256 of the active file content (``None`` without a file).
        revision: The runtime revision of the active desired state.
        last_reload: The newest attempt, or ``None`` before the first.
        poll_interval_s: Seconds between the file watcher's looks without an event;
            ``None`` while no watcher runs (``serve --no-watch``).
        looks: How many times the watcher has read the file and compared its digest.
        last_look_at: When it last did (ISO 8601, UTC).
        clock: Current time (UTC-aware); injectable for tests.
    """

    path: Path | None
    resolved_path: Path | None
    content_sha256: str | None
    revision: int | None
    last_reload: ReloadAttempt | None = None
    poll_interval_s: float | None = None
    looks: int = 0
    last_look_at: str | None = None
    clock: Callable[[], datetime] = field(default=_utc_now, repr=False)

    @classmethod
    def of(cls, compiled: CompiledConfig, *, revision: int | None) -> ConfigState:
        """The state of a host that started with ``compiled`` as ``revision``."""
        path = compiled.source.absolute() if compiled.source is not None else None
        return cls(
            path=path,
            resolved_path=_resolved(path),
            content_sha256=compiled.content_sha256,
            revision=revision,
        )

    def on_commit(self, candidate: CompiledConfig) -> None:
        """A manager ``on_commit`` listener: ``candidate`` is live now (any reload source).

        A candidate that did not come from the file (an admin ``PUT`` keeps the file's
        routes and keys) keeps the file's identity.
        """
        if candidate.source is None:
            return
        self.path = candidate.source.absolute()
        self.resolved_path = _resolved(self.path)
        self.content_sha256 = candidate.content_sha256

    def committed(self, source: ReloadSource, *, job_id: str, revision: int) -> ReloadAttempt:
        """Record a committed reload (after :meth:`on_commit` saw its candidate)."""
        self.revision = revision
        attempt = ReloadAttempt(
            source=source,
            result=ReloadResult.COMMITTED,
            at=_iso(self.clock()),
            job_id=job_id,
            revision=revision,
            content_sha256=self.content_sha256,
        )
        self.last_reload = attempt
        return attempt

    def failed(
        self, source: ReloadSource, error: SbproxyError, *, content_sha256: str | None = None
    ) -> ReloadAttempt:
        """Record a reload that raised ``error``; the active state is unchanged."""
        job_id = error.details.get("job_id")
        attempt = ReloadAttempt(
            source=source,
            result=result_of(error),
            at=_iso(self.clock()),
            job_id=job_id if isinstance(job_id, str) else None,
            content_sha256=content_sha256,
            reason_code=error.code,
            message=_message(error),
        )
        self.last_reload = attempt
        return attempt

    def watching(self, *, poll_interval_s: float) -> None:
        """A file watcher now follows the file, looking at least every ``poll_interval_s``."""
        self.poll_interval_s = poll_interval_s

    def looked(self) -> None:
        """The watcher read the file and compared its digest (whether or not it changed)."""
        self.looks += 1
        self.last_look_at = _iso(self.clock())

    def to_dict(self) -> dict[str, object]:
        """The ``config`` object of ``GET /admin/model-host/status``: ``{path,
        resolved_path, content_sha256, revision, last_reload, watch}``; ``watch`` is
        ``null`` without a file watcher, else ``{poll_interval_s, looks, last_look_at}``."""
        watch = None
        if self.poll_interval_s is not None:
            watch = {
                "poll_interval_s": self.poll_interval_s,
                "looks": self.looks,
                "last_look_at": self.last_look_at,
            }
        return {
            "path": str(self.path) if self.path is not None else None,
            "resolved_path": str(self.resolved_path) if self.resolved_path else None,
            "content_sha256": self.content_sha256,
            "revision": self.revision,
            "last_reload": self.last_reload.to_dict() if self.last_reload else None,
            "watch": watch,
        }
