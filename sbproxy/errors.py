"""The one error tree of sbproxy.

Every error raised across a package boundary is an :class:`SbproxyError`. Each carries:

* ``code`` -- a stable snake_case reason code (``invalid_config``, ``unknown_catalog_model``,
  ``digest_mismatch``, ``queue_full`` ...). Codes are a public contract: the CLI prints them,
  the admin API returns them and the job journal stores them. Never rename one.
* ``retryable`` -- whether repeating the same operation unchanged may succeed.
* ``remediation`` -- what the operator should do next, or ``None`` when the message says it.
* ``details`` -- structured, JSON-serialisable fields (``deployment=``, ``path=`` ...).

Messages say what happened *and* what to do. They never contain secrets: callers pass
credentials to transports only, never into an error.

Errors meet HTTP in exactly one place (``sbproxy.api``); nothing here knows about status codes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "CatalogError",
    "ConfigError",
    "ConfigIssue",
    "ResolutionError",
    "SbproxyError",
    "sole_error",
]

JsonScalar = str | int | float | bool | None


class SbproxyError(Exception):
    """Root of every sbproxy error.

    Args:
        message: What happened, in one or two sentences, ideally with what to do.
        code: Stable reason code; defaults to the class's ``default_code``.
        retryable: Whether the same operation may succeed if repeated; defaults to the
            class's ``default_retryable``.
        remediation: Optional separate instruction for the operator.
        details: Structured context (JSON scalars only), e.g. ``{"deployment": "local-qwen"}``.
    """

    default_code: ClassVar[str] = "internal"
    default_retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        remediation: str | None = None,
        details: Mapping[str, JsonScalar] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retryable = self.default_retryable if retryable is None else retryable
        self.remediation = remediation
        self.details: dict[str, JsonScalar] = dict(details or {})

    def __str__(self) -> str:
        if self.remediation:
            message = self.message.rstrip()
            stop = "" if message.endswith((".", "!", "?", ":", "\n")) else "."
            return f"{message}{stop} {self.remediation}"
        return self.message

    def to_dict(self) -> dict[str, object]:
        """Return ``{"code", "error", "retryable", "remediation"?, **details}`` for JSON output."""
        out: dict[str, object] = {
            "code": self.code,
            "error": self.message,
            "retryable": self.retryable,
        }
        if self.remediation:
            out["remediation"] = self.remediation
        out.update(self.details)
        return out


@dataclass(frozen=True)
class ConfigIssue:
    """One problem found in a configuration file.

    Attributes:
        path: Dotted path of the offending value, e.g.
            ``proxy.model_host.deployments.local-qwen.replicas``; ``""`` for the whole file.
        message: What is wrong and what is allowed.
        line: 1-based line in the source file when known.
    """

    path: str
    message: str
    line: int | None = None

    def to_dict(self) -> dict[str, object]:
        """Return ``{"path", "message", "line"?}``."""
        out: dict[str, object] = {"path": self.path, "message": self.message}
        if self.line is not None:
            out["line"] = self.line
        return out

    def render(self, source: str | None = None) -> str:
        """One human line: ``sb.yml:12: proxy.admin.port: <message>``."""
        where = ""
        if source:
            where = f"{source}:{self.line}: " if self.line else f"{source}: "
        subject = f"{self.path}: " if self.path else ""
        return f"{where}{subject}{self.message}"


class ConfigError(SbproxyError):
    """A configuration file is unreadable or invalid (code ``invalid_config``).

    ``issues`` lists every problem found, each with its dotted path.
    """

    default_code = "invalid_config"

    def __init__(
        self,
        issues: list[ConfigIssue],
        *,
        source: str | None = None,
        code: str | None = None,
    ) -> None:
        self.issues = list(issues)
        self.source = source
        head = f"{source}: " if source else ""
        count = len(self.issues)
        summary = f"{head}invalid configuration ({count} problem{'s' if count != 1 else ''})"
        super().__init__(
            summary,
            code=code,
            remediation="Fix the listed fields; `sbproxy config schema` prints what is allowed.",
        )

    def __str__(self) -> str:
        lines = [self.message + ":"]
        lines.extend(f"  - {issue.render(self.source)}" for issue in self.issues)
        return "\n".join(lines)


class CatalogError(SbproxyError):
    """A catalog document is invalid, or a catalog lookup failed.

    Codes: ``invalid_catalog`` (a document breaks the schema), ``unknown_catalog_model``,
    ``unknown_catalog_variant``.
    """

    default_code = "invalid_catalog"


class ResolutionError(SbproxyError):
    """No catalog artifact can serve a deployment request on this worker.

    Codes: ``unknown_catalog_model``, ``unknown_catalog_variant``, ``variant_not_pinned``,
    ``no_compatible_variant``, ``preview_incomplete``.
    """

    default_code = "no_compatible_variant"


def sole_error(exc: BaseException) -> SbproxyError | None:
    """The error to report for ``exc``: itself when it is an :class:`SbproxyError`; for an
    exception group (anyio task groups wrap what their tasks raise, several at once when a
    failure also fails a sibling, e.g. a full disk failing a step and the heartbeat) its first
    leaf, provided every leaf is an :class:`SbproxyError`; else ``None`` (a bug to show whole).
    """
    if isinstance(exc, SbproxyError):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    leaves = [sole_error(inner) for inner in exc.exceptions]
    if not leaves or any(leaf is None for leaf in leaves):
        return None
    return leaves[0]
