"""The gateway's key plane: API keys from ``proxy.api_keys``, held and compared as hashes.

Keys are never kept in clear: a configured ``key`` is hashed at start and dropped; a
``key_sha256`` is used as given. A presented bearer token is hashed once and compared with
every record by :func:`hmac.compare_digest`, without stopping at the first match, so the time
taken does not depend on which record (if any) matches. An empty key list is the keyless
local mode (``sbproxy run``): every request is admitted with the ``standard`` class.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from sbproxy.api.errors import Unauthorized
from sbproxy.config import ApiKeyRecord, PriorityClass, TokenBudget

__all__ = ["KEYLESS", "Caller", "KeyPlane"]


@dataclass(frozen=True)
class Caller:
    """Who sent a gateway request: the key record's name (``None`` keyless) and its class."""

    name: str | None
    priority: PriorityClass


KEYLESS = Caller(name=None, priority=PriorityClass.STANDARD)


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    caller: Caller


class KeyPlane:
    """Authenticates gateway requests against the configured key records."""

    def __init__(self, records: list[ApiKeyRecord]) -> None:
        entries = []
        for record in records:
            if record.key is not None:
                digest = hashlib.sha256(record.key.get_secret_value().encode()).digest()
            else:
                assert record.key_sha256 is not None  # noqa: S101 - config guarantees one
                digest = bytes.fromhex(record.key_sha256)
            entries.append(_Entry(digest, Caller(name=record.name, priority=record.priority)))
        self._entries = tuple(entries)
        self.budgets: dict[str, TokenBudget | None] = {
            record.name: record.token_budget for record in records
        }
        """Every configured key name with its token budget (``None``: no budget)."""

    @property
    def keyless(self) -> bool:
        """Whether the gateway runs without keys."""
        return not self._entries

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller of a request with this ``Authorization`` header.

        Raises:
            Unauthorized: ``unauthorized`` when keys are configured and the header is
                missing, not ``Bearer``, or carries an unknown key.
        """
        if not self._entries:
            return KEYLESS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized(
                "missing API key; send Authorization: Bearer <key>",
                remediation=None,
            )
        presented = hashlib.sha256(token.strip().encode()).digest()
        found: Caller | None = None
        for entry in self._entries:
            if hmac.compare_digest(presented, entry.digest):
                found = entry.caller
        if found is None:
            raise Unauthorized("invalid API key")
        return found
