"""Shared building blocks of the configuration models: base class, rule errors, value checks."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

__all__ = [
    "ID_PATTERN",
    "MAX_PATH_CHARS",
    "ConfigModel",
    "Identifier",
    "NonBlank",
    "RuleViolation",
    "check_absolute_path",
    "check_path_text",
    "dotted",
    "is_sha256_hex",
]

# Deployment, variant and key identifiers: what the reference accepts, bounded to 128 chars so
# they fit in metric labels, job subjects and file names.
ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
# Upper bound on path-like settings, as in the reference (PATH_MAX is 4096 on Linux).
MAX_PATH_CHARS = 4096

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


class ConfigModel(BaseModel):
    """Base of every sb.yml model: frozen, unknown fields refused, defaults validated."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        str_strip_whitespace=False,
        use_attribute_docstrings=False,
        defer_build=True,
    )


class RuleViolation(ValueError):
    """A cross-field rule broken inside a model.

    Pydantic reports a validator's error at the model's own location; ``problems`` carries
    the relative sub-path of each offending field, which the loader appends so that every
    message names the exact dotted path (``...deployments.local-qwen.replicas``).

    Args:
        problems: ``(sub_path, message)`` pairs; ``sub_path`` is a tuple of keys and list
            indexes relative to the model that raised.
    """

    def __init__(self, problems: Sequence[tuple[tuple[str | int, ...], str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(message for _, message in self.problems))

    @classmethod
    def at(cls, field: str | tuple[str | int, ...], message: str) -> RuleViolation:
        """One problem at ``field`` (a name or a sub-path tuple)."""
        path = (field,) if isinstance(field, str) else field
        return cls([(path, message)])


def is_sha256_hex(value: str) -> bool:
    """True when ``value`` is 64 lowercase hexadecimal characters."""
    return bool(_SHA256_RE.match(value))


def check_path_text(value: str) -> str:
    """Refuse blank paths, paths over 4096 characters and control characters."""
    if not value.strip():
        raise ValueError("must not be empty")
    if len(value) > MAX_PATH_CHARS:
        raise ValueError(f"must be at most {MAX_PATH_CHARS} characters long")
    if _CONTROL_RE.search(value):
        raise ValueError("must not contain control characters")
    return value


def check_absolute_path(value: str) -> str:
    """Like :func:`check_path_text`, and require an absolute path without ``..`` components."""
    check_path_text(value)
    path = PurePosixPath(value)
    if not path.is_absolute():
        raise ValueError(
            f"{value!r} must be an absolute path; a relative one would depend on the working "
            "directory of whichever process reads it"
        )
    if ".." in path.parts:
        raise ValueError(f"{value!r} must not contain '..' components")
    return value


def _check_not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be empty or blank")
    return value


NonBlank = Annotated[str, AfterValidator(_check_not_blank)]
Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


_PLAIN_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def dotted(path: Sequence[str | int]) -> str:
    """Render a location as a dotted path: ``("origins", "a.b", "action", "providers", 0)``
    becomes ``origins."a.b".action.providers[0]``.

    Keys made only of letters, digits, ``_`` and ``-`` are written bare; others are quoted so
    the path stays unambiguous when ids contain dots.
    """
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = part if _PLAIN_KEY_RE.match(part) else '"' + part.replace('"', '\\"') + '"'
        out = f"{out}.{text}" if out else text
    return out
