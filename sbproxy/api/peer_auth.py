"""The one check of a fleet peer request on the gateway (docs/cluster.md, "Admitting nodes").

A peer presents ``Authorization: Bearer <its own node credential>`` and names itself in
``X-Sbproxy-Peer-Node``; while the shared fleet credential is accepted
(``proxy.model_host.fleet.credential`` with ``accept_shared_credential``), that credential
admits too. A revoked or removed member is refused whatever it presents. Every peer route
(the lease ask, artifact blobs) answers through :func:`peer_refusal`, so the way members
prove themselves to each other is decided in this one place. Credentials are compared in
constant time (the node credential against its recorded hash, by the fleet agent) and never
logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping

from litestar import Response

from sbproxy.fleet.admission import PeerCheck
from sbproxy.model_host.artifacts.peers import PEER_NODE_HEADER

__all__ = ["PeerChecker", "peer_refusal"]

PeerChecker = Callable[[str, str], PeerCheck]
"""``(node id, presented secret) -> PeerCheck``: the fleet agent's ``check_peer``."""


def peer_refusal(
    headers: Mapping[str, str],
    *,
    check: PeerChecker | None,
    shared: str | None,
) -> Response[dict[str, object]] | None:
    """``None`` when the request's headers prove a fleet peer; else the 401
    ``peer_unauthorized`` answer to send.

    Args:
        headers: The request's headers (read case-insensitively, as Litestar's).
        check: The node credential check (``None``: this host knows no member's).
        shared: The shared fleet credential while it is accepted, else ``None``.
    """
    given = headers.get("authorization") or ""
    scheme, _, token = given.partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        node = headers.get(PEER_NODE_HEADER)
        verdict = check(node, token) if node and check is not None else PeerCheck.UNKNOWN
        if verdict is PeerCheck.VALID:
            return None
        if (
            verdict is PeerCheck.UNKNOWN
            and shared
            and hmac.compare_digest(token.encode(), shared.encode())
        ):
            return None
    return Response(
        {
            "code": "peer_unauthorized",
            "error": "a fleet peer request needs the calling node's own node credential "
            "(Authorization: Bearer, X-Sbproxy-Peer-Node) or the shared fleet credential "
            "while it is accepted",
        },
        status_code=401,
    )
