"""The fleet's admission routes on the admin listener (HTTP Basic, as every admin route;
docs/cluster.md, "Admitting nodes"). All JSON, ``schema_version: 1``; on a host that is not
``cluster_authority`` each answers 409 ``fleet_disabled``, and 503 ``journal_unavailable``
when the journal cannot be reached.

* ``POST /admin/fleet/join-tokens`` -- body ``{ttl_ms?, uses?, description?}`` (each
  optional: no expiry, unlimited uses); 201 ``{job_id, token: {id, token, expires_at_ms,
  uses_left, ...}}``. ``token.token`` is the only time the secret is shown: the journal keeps
  its SHA-256. 400 ``invalid_join_token_request`` for a bad body.
* ``GET /admin/fleet/join-tokens`` -- ``{now_ms, tokens: [...]}``, each with its ``state``
  (``valid``, ``expired``, ``used_up``, ``revoked``); never a secret or a hash.
* ``POST /admin/fleet/join-tokens/{id}/revoke`` -- 202 ``{job_id, token_id}``; 404
  ``unknown_join_token``.

A node's revocation is ``POST /admin/fleet/nodes/{node}/revoke[?reason=...]``
(:mod:`sbproxy.api.fleet`).
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from litestar import Request, Response, get, post
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from sbproxy.api.errors import admin_error
from sbproxy.api.fleet import fleet_disabled, fleet_store_error
from sbproxy.errors import SbproxyError
from sbproxy.fleet.agent import FleetAgent
from sbproxy.store.admission import (
    create_join_token,
    list_join_tokens,
    revoke_join_token,
    token_body,
)

__all__ = ["admission_handlers"]

MAX_DESCRIPTION_CHARS = 200


def _bad(message: str, field: str) -> Response[dict[str, object]]:
    return admin_error(
        status=400, code="invalid_join_token_request", message=message, details={"field": field}
    )


def _request(raw: bytes) -> tuple[int | None, int | None, str] | Response[dict[str, object]]:
    """``(ttl_ms, uses, description)`` of a creation body, or the 400 to answer."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        return _bad("the body is not JSON", "body")
    if not isinstance(body, dict):
        return _bad("the body must be a JSON object", "body")
    unknown = sorted(set(body) - {"ttl_ms", "uses", "description"})
    if unknown:
        return _bad(f"unknown field {unknown[0]!r} (ttl_ms, uses, description)", unknown[0])
    values: dict[str, int | None] = {}
    for name in ("ttl_ms", "uses"):
        value = body.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            return _bad(f"{name} must be a positive integer or null", name)
        values[name] = value
    description = body.get("description") or ""
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        return _bad(f"description must be text of at most {MAX_DESCRIPTION_CHARS}", "description")
    return values["ttl_ms"], values["uses"], description


def admission_handlers(agent: FleetAgent | None) -> list[HTTPRouteHandler]:
    """The join-token routes (module docstring), mounted under ``/admin``."""

    @post("/fleet/join-tokens", status_code=201)
    async def create(request: Request[Any, Any, Any]) -> Response[dict[str, object]]:
        """Make a join token; its secret is in this answer only."""
        if agent is None:
            return fleet_disabled()
        parsed = _request(await request.body())
        if isinstance(parsed, Response):
            return parsed
        ttl_ms, uses, description = parsed
        try:
            row, token, job_id = await anyio.to_thread.run_sync(
                lambda: create_join_token(
                    agent.store,
                    by=agent.identity.id,
                    ttl_ms=ttl_ms,
                    uses=uses,
                    description=description,
                )
            )
        except SbproxyError as exc:
            return fleet_store_error(exc)
        return Response(
            {
                "schema_version": 1,
                "job_id": job_id,
                "token": token_body(row, token, row.created_at_ms),
            },
            status_code=201,
            headers={"Cache-Control": "no-store"},
        )

    @get("/fleet/join-tokens")
    async def tokens() -> Response[dict[str, object]]:
        """Every join token, without secrets."""
        if agent is None:
            return fleet_disabled()
        try:
            now, rows = await anyio.to_thread.run_sync(lambda: list_join_tokens(agent.store))
        except SbproxyError as exc:
            return fleet_store_error(exc)
        return Response(
            {"schema_version": 1, "now_ms": now, "tokens": [r.to_dict(now) for r in rows]}
        )

    @post("/fleet/join-tokens/{token_id:str}/revoke", status_code=202)
    async def revoke(token_id: FromPath[str]) -> Response[dict[str, object]]:
        """Revoke a join token: no join redeems it from now on."""
        if agent is None:
            return fleet_disabled()
        try:
            job_id = await anyio.to_thread.run_sync(
                lambda: revoke_join_token(agent.store, token_id, by=agent.identity.id)
            )
        except SbproxyError as exc:
            return fleet_store_error(exc)
        if job_id is None:
            return admin_error(
                status=404,
                code="unknown_join_token",
                message=f"no join token {token_id!r} (sbproxy nodes token list shows them)",
                details={"token_id": token_id},
            )
        return Response(
            {"schema_version": 1, "job_id": job_id, "token_id": token_id}, status_code=202
        )

    return [create, tokens, revoke]
