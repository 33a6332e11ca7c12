"""The one check of a fleet peer request on the gateway: ``Authorization: Bearer <fleet
credential>`` (``proxy.model_host.fleet.credential``, the one in force now).

Every peer route (the lease ask, artifact blobs) answers through :func:`peer_refusal`, so
the way members prove themselves to each other changes in this one place. The credential is
compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac

from litestar import Response

__all__ = ["peer_refusal"]


def peer_refusal(
    authorization: str | None, current: str | None
) -> Response[dict[str, object]] | None:
    """``None`` when ``authorization`` carries the fleet credential ``current``; else the
    answer to send: 404 ``not_found`` while this host has no credential (it answers no peer),
    401 ``peer_unauthorized`` for a missing or wrong one."""
    if not current:
        return Response(
            {
                "code": "not_found",
                "error": "this host has no fleet credential, so it answers no peer "
                "(proxy.model_host.fleet.credential)",
            },
            status_code=404,
        )
    given = (authorization or "").encode()
    if not hmac.compare_digest(given, f"Bearer {current}".encode()):
        return Response(
            {
                "code": "peer_unauthorized",
                "error": "a fleet peer request needs the fleet credential (Authorization: Bearer)",
            },
            status_code=401,
        )
    return None
