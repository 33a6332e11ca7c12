"""Fleet admission in the PostgreSQL journal (migration 13): join tokens, each member's node
credential, and revocation (docs/cluster.md, "Admitting nodes").

* A **join token** is ``<id>.<secret>`` (:func:`new_join_token`): ``id`` (8 characters of
  ``[a-z0-9]``) is public -- listings, logs and jobs name it; ``secret`` (32 hex digits, 128
  random bits) is shown once, when the token is made, and the journal keeps only its
  SHA-256. A token has an expiry on database time (or none) and a number of joins left (or
  unlimited); an operator may revoke it. A new node redeems it inside its join's own
  transaction (:func:`redeem`): expiry, uses and revocation are checked, and the use
  counted, by one ``UPDATE ... WHERE`` on the locked row, so two nodes racing for the last
  use cannot both win.
* A **node credential** is a secret each node makes for itself (:func:`new_node_credential`)
  and keeps in its cache (``fleet/admission.py``); its join records the SHA-256 beside the
  membership row. Peers check a hop's credential against that hash, and a node rejoins after
  a restart with it, without a token.
* **Revocation** (:func:`revoke_node`) marks the row removed and revoked and drops its hash,
  in one transaction with a ``fleet.node`` job (who, when, why): the renewal statement refuses
  a revoked row, peers refuse its credential, the controller ends and re-places its
  placements at its next pass, and a controller lease it held lapses at once.

SHA-256 without a salt is enough here: both secrets are 128 random bits or more, never chosen
by a person, so there is nothing a dictionary could find. Every hash is compared in constant
time where this code compares it (``hmac.compare_digest``), and a hash is never returned by a
listing.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sbproxy.config.model_host import JOIN_TOKEN_PATTERN
from sbproxy.errors import SbproxyError

if TYPE_CHECKING:
    import psycopg

    from sbproxy.store.fleet import FleetStore

__all__ = [
    "JOIN_TOKEN_PATTERN",
    "JoinRefused",
    "JoinTokenRow",
    "admit",
    "create_join_token",
    "credential_matches",
    "list_join_tokens",
    "new_join_token",
    "new_node_credential",
    "parse_join_token",
    "redeem",
    "revoke_join_token",
    "revoke_node",
    "secret_hash",
    "token_body",
]

_TOKEN = re.compile(JOIN_TOKEN_PATTERN)
logger = logging.getLogger(__name__)
_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


class JoinRefused(SbproxyError):
    """A node's join was refused by the fleet's admission (exit 2 at ``serve``): the code
    says why -- ``join_token_required`` (no node credential the fleet knows, no token, and the
    shared credential does not admit), ``join_token_invalid`` (unknown id, wrong secret or a
    revoked token), ``join_token_expired``, ``join_token_used_up``, ``node_revoked`` (an
    operator revoked this node), ``node_credential_invalid`` (the node's stored credential is
    not the one the fleet recorded for it). ``details`` name the node and the token's id,
    never a secret."""

    default_code = "join_token_required"


@dataclass(frozen=True)
class JoinTokenRow:
    """One join token as listed (no secret, no hash); times on database time, epoch ms."""

    id: str
    created_at_ms: int
    created_by: str
    expires_at_ms: int | None
    uses_left: int | None
    used: int
    revoked_at_ms: int | None
    description: str

    def to_dict(self, now_ms: int | None = None) -> dict[str, Any]:
        """The JSON form; with ``now_ms``, ``state`` (``valid``, ``expired``, ``used_up``,
        ``revoked``)."""
        out: dict[str, Any] = {
            "id": self.id,
            "created_at_ms": self.created_at_ms,
            "created_by": self.created_by,
            "expires_at_ms": self.expires_at_ms,
            "uses_left": self.uses_left,
            "used": self.used,
            "revoked_at_ms": self.revoked_at_ms,
            "description": self.description,
        }
        if now_ms is not None:
            out["state"] = self.state(now_ms)
        return out

    def state(self, now_ms: int) -> str:
        """``revoked``, ``expired``, ``used_up`` or ``valid`` at ``now_ms``."""
        if self.revoked_at_ms is not None:
            return "revoked"
        if self.expires_at_ms is not None and self.expires_at_ms <= now_ms:
            return "expired"
        if self.uses_left is not None and self.uses_left <= 0:
            return "used_up"
        return "valid"


def secret_hash(secret: str) -> str:
    """The hex SHA-256 of ``secret`` (UTF-8): what the journal keeps of a token's secret or a
    node credential."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_join_token() -> tuple[str, str]:
    """A fresh ``(id, token)``: ``token`` is ``<id>.<secret>`` (module docstring)."""
    token_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    return token_id, f"{token_id}.{secrets.token_hex(16)}"


def new_node_credential() -> str:
    """A fresh node credential: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def parse_join_token(token: str) -> tuple[str, str]:
    """``(id, SHA-256 of the secret)`` of a join token.

    Raises:
        JoinRefused: ``join_token_invalid`` -- not ``<8 of [a-z0-9]>.<32 hex digits>`` (the
            value is not echoed: it is a secret).
    """
    text = token.strip()
    if not _TOKEN.match(text):
        raise JoinRefused(
            "the join token is not of the form <id>.<secret> that `sbproxy nodes token "
            "create` prints",
            code="join_token_invalid",
            remediation="Copy the whole token `sbproxy nodes token create` printed into "
            "proxy.model_host.fleet.join_token (or $SBPROXY_JOIN_TOKEN).",
        )
    token_id, _, secret = text.partition(".")
    return token_id, secret_hash(secret)


def _token_row(row: Any) -> JoinTokenRow:
    return JoinTokenRow(
        id=str(row[0]),
        created_at_ms=int(row[1]),
        created_by=str(row[2]),
        expires_at_ms=None if row[3] is None else int(row[3]),
        uses_left=None if row[4] is None else int(row[4]),
        used=int(row[5]),
        revoked_at_ms=None if row[6] is None else int(row[6]),
        description=str(row[7]),
    )


_TOKEN_COLUMNS = (
    "id, created_at_ms, created_by, expires_at_ms, uses_left, used, revoked_at_ms,"  # noqa: S105
    " description"
)


def redeem(
    cursor: psycopg.Cursor[Any], now_ms: int, *, node_id: str, token: tuple[str, str]
) -> str:
    """Count one use of join token ``token`` (``(id, secret hash)``, :func:`parse_join_token`)
    for ``node_id``'s join, in the caller's transaction; the token's id.

    One ``UPDATE`` checks the secret, revocation, expiry (database time) and uses left on the
    locked row and counts the use; a concurrent join for the last use waits for the row and
    then finds none left.

    Raises:
        JoinRefused: ``join_token_invalid``, ``join_token_expired``, ``join_token_used_up``.
    """
    token_id, digest = token
    done = cursor.execute(
        "UPDATE fleet_join_tokens SET used = used + 1,"
        " uses_left = CASE WHEN uses_left IS NULL THEN NULL ELSE uses_left - 1 END"
        " WHERE id = %(id)s AND secret_sha256 = %(digest)s AND revoked_at_ms IS NULL"
        " AND (expires_at_ms IS NULL OR expires_at_ms > %(now)s)"
        " AND (uses_left IS NULL OR uses_left > 0) RETURNING id",
        {"id": token_id, "digest": digest, "now": now_ms},
    ).fetchone()
    if done is not None:
        return token_id
    found = cursor.execute(
        "SELECT secret_sha256, revoked_at_ms, expires_at_ms, uses_left FROM fleet_join_tokens"
        " WHERE id = %s",
        (token_id,),
    ).fetchone()
    details = {"node_id": node_id, "token_id": token_id}
    if found is None or found[1] is not None or not secrets.compare_digest(str(found[0]), digest):
        raise JoinRefused(
            f"node {node_id} presented join token {token_id}, which the fleet does not accept "
            "(unknown, revoked, or its secret does not match)",
            code="join_token_invalid",
            remediation="Make a new one with `sbproxy nodes token create` on a member and "
            "give it to this host (proxy.model_host.fleet.join_token or $SBPROXY_JOIN_TOKEN).",
            details=details,
        )
    if found[2] is not None and int(found[2]) <= now_ms:
        raise JoinRefused(
            f"join token {token_id} expired {now_ms - int(found[2])} ms ago (database time)",
            code="join_token_expired",
            remediation="Make a new one with `sbproxy nodes token create --ttl ...`.",
            details={**details, "expired_at_ms": int(found[2])},
        )
    raise JoinRefused(
        f"join token {token_id} has no joins left",
        code="join_token_used_up",
        remediation="Make a new one with `sbproxy nodes token create --uses N`.",
        details=details,
    )


def admit(
    cursor: psycopg.Cursor[Any],
    now: int,
    *,
    node_id: str,
    row: Sequence[Any] | None,
    credential_sha256: str,
    join_token: tuple[str, str] | None,
    shared_admits: bool,
) -> None:
    """Admit ``node_id`` to the fleet in the caller's join transaction (the rule of
    :meth:`~sbproxy.store.fleet.FleetStore.join`), ``row`` its member row as locked there
    (``instance, renewed_at_ms, left_fleet, revoked_at_ms, credential_sha256``; ``None`` for a
    new node); or raise.

    Raises:
        JoinRefused: ``node_revoked``, ``join_token_required``, ``join_token_invalid``,
            ``join_token_expired``, ``join_token_used_up``, ``node_credential_invalid``.
    """
    revoked = row is not None and row[3] is not None
    stored = None if row is None else row[4]
    if not revoked and credential_matches(stored, credential_sha256):
        return
    if join_token is not None:
        token_id = redeem(cursor, now, node_id=node_id, token=join_token)
        logger.info("node %s joins with join token %s", node_id, token_id)
        return
    if revoked:
        raise JoinRefused(
            f"node {node_id} was revoked and admitted again: it joins only with a fresh join token",
            code="node_revoked",
            remediation="Make one with `sbproxy nodes token create` and give it to this "
            "host (proxy.model_host.fleet.join_token or $SBPROXY_JOIN_TOKEN).",
            details={"node_id": node_id},
        )
    if shared_admits:
        return
    if stored is not None:
        raise JoinRefused(
            f"node {node_id}'s stored node credential is not the one the fleet recorded "
            "for it (a copied or replaced cache, or another host under this id)",
            code="node_credential_invalid",
            remediation="Give this host a fresh join token (sbproxy nodes token create), "
            "or its own node id.",
            details={"node_id": node_id},
        )
    raise JoinRefused(
        f"node {node_id} has no join token and no node credential the fleet knows: a new "
        "node joins only with a join token",
        code="join_token_required",
        remediation="Make one on a member with `sbproxy nodes token create` and give it to "
        "this host as proxy.model_host.fleet.join_token or $SBPROXY_JOIN_TOKEN.",
        details={"node_id": node_id},
    )


def create_join_token(
    store: FleetStore,
    *,
    by: str,
    ttl_ms: int | None,
    uses: int | None,
    description: str = "",
) -> tuple[JoinTokenRow, str, str]:
    """Make a join token valid for ``ttl_ms`` from now on database time (``None``: no expiry)
    and ``uses`` joins (``None``: unlimited), recorded with a ``fleet.join_token`` job;
    ``(row, token, job id)``. ``token`` is the only copy of the secret: show it once.

    Raises:
        ValueError: ``ttl_ms`` or ``uses`` not positive.
        JournalUnavailable: ``journal_unavailable``.
    """
    if ttl_ms is not None and ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be positive, not {ttl_ms}")
    if uses is not None and uses <= 0:
        raise ValueError(f"uses must be positive, not {uses}")
    token_id, token = new_join_token()
    digest = secret_hash(token.partition(".")[2])
    with store._transaction() as cursor:
        now = store._now(cursor)
        expires = None if ttl_ms is None else now + ttl_ms
        row = cursor.execute(
            "INSERT INTO fleet_join_tokens (id, secret_sha256, created_at_ms, created_by,"  # noqa: S608
            " expires_at_ms, uses_left, description) VALUES (%s, %s, %s, %s, %s, %s, %s)"
            f" RETURNING {_TOKEN_COLUMNS}",
            (token_id, digest, now, by, expires, uses, description),
        ).fetchone()
        job_id = store._job(
            cursor,
            now,
            kind="fleet.join_token",
            subject=f"join_token:{token_id}",
            node=by,
            body={
                "action": "create",
                "token_id": token_id,
                "expires_at_ms": expires,
                "uses": uses,
                "description": description,
            },
        )
    return _token_row(row), token, job_id


def list_join_tokens(store: FleetStore) -> tuple[int, list[JoinTokenRow]]:
    """``(database now, every join token)``, newest first (no secret, no hash).

    Raises:
        JournalUnavailable: ``journal_unavailable``.
    """
    with store._transaction() as cursor:
        now = store._now(cursor)
        rows = cursor.execute(
            f"SELECT {_TOKEN_COLUMNS} FROM fleet_join_tokens"  # noqa: S608 - fixed columns
            " ORDER BY created_at_ms DESC, id"
        ).fetchall()
    return now, [_token_row(r) for r in rows]


def revoke_join_token(store: FleetStore, token_id: str, *, by: str) -> str | None:
    """Revoke join token ``token_id`` (no join redeems it after this commits), recorded with
    a ``fleet.join_token`` job; the job id, ``None`` when there is no such token. Revoking a
    revoked token keeps its first revocation time.

    Raises:
        JournalUnavailable: ``journal_unavailable``.
    """
    with store._transaction() as cursor:
        now = store._now(cursor)
        found = cursor.execute(
            "UPDATE fleet_join_tokens SET revoked_at_ms = COALESCE(revoked_at_ms, %s)"
            " WHERE id = %s RETURNING id",
            (now, token_id),
        ).fetchone()
        if found is None:
            return None
        return store._job(
            cursor,
            now,
            kind="fleet.join_token",
            subject=f"join_token:{token_id}",
            node=by,
            body={"action": "revoke", "token_id": token_id},
        )


def revoke_node(store: FleetStore, node_id: str, *, by: str, reason: str) -> str | None:
    """Revoke member ``node_id`` at once, in one transaction: it is removed from the fleet
    (``left``) and marked revoked with ``reason``, its credential hash is dropped, a
    controller lease it holds lapses now, a ``node_revoked`` event is announced (every host
    re-reads the fleet within milliseconds and refuses its peer calls) and a ``fleet.node``
    job records who, when and why. The id of that job; ``None`` when there is no such node.

    From then on the renewal statement refuses the row (:meth:`FleetStore.renew`), so the
    node fences itself at its next renewal, and the controller ends its placements and
    re-places its replicas at its next pass. ``sbproxy nodes admit`` lets the id join again,
    with a fresh join token only.

    Raises:
        JournalUnavailable: ``journal_unavailable``.
    """
    with store._transaction() as cursor:
        now = store._now(cursor)
        found = cursor.execute(
            "UPDATE fleet_nodes SET left_fleet = 1, credential_sha256 = NULL,"
            " revoked_at_ms = COALESCE(revoked_at_ms, %s), revoked_reason = %s"
            " WHERE id = %s RETURNING id",
            (now, reason, node_id),
        ).fetchone()
        if found is None:
            return None
        # A controller it held is deposed now: its later writes fail their fence.
        cursor.execute(
            "UPDATE fleet_controller SET expires_at_ms = LEAST(expires_at_ms, %s)"
            " WHERE id = 1 AND holder = %s",
            (now, node_id),
        )
        store._event(cursor, now, "node_revoked", node_id, {"by": by, "reason": reason})
        return store._job(
            cursor,
            now,
            kind="fleet.node",
            subject=f"node:{node_id}",
            node=by,
            body={"node": node_id, "revoked": True, "reason": reason},
        )


def credential_matches(stored: str | None, presented: str | None) -> bool:
    """Whether a presented credential's hash is the stored one (constant time)."""
    if stored is None or presented is None:
        return False
    return secrets.compare_digest(stored, presented)


def token_body(row: JoinTokenRow, token: str, now_ms: int) -> dict[str, Any]:
    """The JSON answer of a token's creation: the row and the token itself, once."""
    return {**row.to_dict(now_ms), "token": token}
