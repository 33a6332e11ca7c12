"""Secret redaction for anything that is persisted or logged.

Job errors, job events, step errors and log lines pass through :func:`redact` before they are
written, so a credential that slipped into an exception message (an ``Authorization`` header
echoed by a server, a token in a URL) never reaches the journal or a log file.

What is recognised:

* ``Authorization: <anything>`` and ``Proxy-Authorization`` header values;
* ``Bearer <token>`` and ``Basic <credentials>``;
* Hugging Face tokens (``hf_`` followed by 20 or more token characters);
* ``password``/``passwd``/``secret``/``token``/``api_key`` assignments in ``key=value``,
  ``key: value`` and JSON ``"key": "value"`` form;
* user information in URLs (``https://user:pass@host`` -> ``https://[REDACTED]@host``);
* exact values registered with :func:`register_secret` (the admin password, the HF token
  read from the environment), wherever they appear.
"""

from __future__ import annotations

import re
import threading

__all__ = ["REDACTED", "redact", "register_secret", "secrets_generation"]

REDACTED = "[REDACTED]"

# Shorter registered values would redact ordinary words; real secrets are longer.
_MIN_REGISTERED_CHARS = 6

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"(?i)\b((?:proxy-)?authorization\b\s*[:=]\s*)(\"?)[^\"\r\n]+"),
        rf"\1\2{REDACTED}",
    ),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+"), rf"\1\2{REDACTED}"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),
    (
        re.compile(
            r"(?i)(\"(?:password|passwd|secret|token|api_key|apikey|hf_token)\"\s*:\s*\")"
            r"[^\"]*(\")"
        ),
        rf"\1{REDACTED}\2",
    ),
    (
        re.compile(
            r"(?i)\b((?:password|passwd|secret|token|api_key|apikey|hf_token)\s*[=:]\s*)"
            r"(?!\[REDACTED\])[^\s,;&\"'}]+"
        ),
        rf"\1{REDACTED}",
    ),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), rf"\1{REDACTED}@"),
)

_registered: set[str] = set()
_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Remember an exact secret value so :func:`redact` removes it wherever it appears.

    Values shorter than 6 characters are ignored (they would redact ordinary words).
    """
    if value and len(value) >= _MIN_REGISTERED_CHARS:
        with _lock:
            _registered.add(value)


def secrets_generation() -> int:
    """A number that changes whenever :func:`register_secret` remembers a new value: a
    :func:`redact` result kept under one number stays exact while it does not change (the
    patterns are fixed, and registered values are only ever added)."""
    return len(_registered)


def redact(text: str) -> str:
    """Return ``text`` with every recognised secret replaced by ``[REDACTED]``."""
    with _lock:
        known = sorted(_registered, key=len, reverse=True)
    for value in known:
        text = text.replace(value, REDACTED)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text
