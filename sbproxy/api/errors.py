"""Where errors meet HTTP: the one map from sbproxy error codes to status codes and bodies.

Handlers and domain code raise :class:`~sbproxy.errors.SbproxyError` (or let Litestar raise
its own ``HTTPException`` for routing, method and body-size problems); nothing else in the
package builds an error response. Two shapes:

* **gateway** (the OpenAI-compatible listener): the OpenAI envelope
  ``{"error": {"message", "type", "code", "sbproxy_reason", "retryable"}}``. ``type`` is
  ``managed_model_error`` for refusals of the model host (admission, engine, unknown model),
  ``invalid_request_error`` for a bad request and ``authentication_error`` for a missing or
  wrong key, ``insufficient_quota`` for a used-up token budget (429
  ``token_budget_exceeded``) -- the types OpenAI clients already know. Retryable refusals
  carry ``Retry-After`` (whole seconds, at least 1; for a budget, until its period resets).
  A stream whose headers already went out ends with the same envelope as one SSE event
  (``data: {"error": {...}}``, :func:`stream_error_event`) instead of a status.
* **admin**: ``{"code", "error"}`` plus structured details such as ``deployment`` and
  ``job_id`` (reference section 2). Private details (stack traces, paths) never appear.

An unexpected exception becomes a 500 with code ``internal`` and is logged; bad input never
reaches that branch.

A request the host ends while it shuts down (:mod:`sbproxy.api.shutdown`) is answered outside
any handler, as raw ASGI: :func:`error_payload` gives its status, body and headers in the
same two shapes, and :func:`error_event` the last Server-Sent Event of a stream it cuts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any, Final, Literal

from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from sbproxy.errors import JsonScalar, SbproxyError

__all__ = [
    "ENGINE_REACHED",
    "ENGINE_REACHED_HEADER",
    "ApiError",
    "BodyTooLarge",
    "CrossSiteRequest",
    "InvalidBody",
    "InvalidJobId",
    "ShuttingDown",
    "Surface",
    "Unauthorized",
    "UnknownModel",
    "UnknownOrigin",
    "admin_exception_handlers",
    "code_status",
    "error_event",
    "error_payload",
    "gateway_error",
    "gateway_exception_handlers",
    "status_for",
    "stream_error_event",
]

logger = logging.getLogger(__name__)

# Which listener answers: the OpenAI-compatible gateway or the admin API.
Surface = Literal["gateway", "admin"]


class ApiError(SbproxyError):
    """Root of the errors the HTTP surface itself detects (bad input, bad credentials)."""


class InvalidBody(ApiError):
    """The request body is not the JSON the route expects (``invalid_body``)."""

    default_code = "invalid_body"


class InvalidJobId(ApiError):
    """A job id that is not a ULID (``invalid_job_id``)."""

    default_code = "invalid_job_id"


class Unauthorized(ApiError):
    """Missing or wrong credentials (``unauthorized``)."""

    default_code = "unauthorized"


class CrossSiteRequest(ApiError):
    """A state-changing admin request a browser sent from another site, or a console action
    without the console's own header (``cross_site_request``): a page elsewhere must not
    spend the admin credentials a browser has cached for this origin."""

    default_code = "cross_site_request"


class UnknownModel(ApiError):
    """The request names a model no route of its origin serves (``model_not_found``)."""

    default_code = "model_not_found"


class UnknownOrigin(ApiError):
    """The Host header matches no configured origin (``unknown_origin``)."""

    default_code = "unknown_origin"


class BodyTooLarge(ApiError):
    """The request body is larger than the listener accepts (``request_body_too_large``)."""

    default_code = "request_body_too_large"


class ShuttingDown(ApiError):
    """The host is shutting down and ended the request at its drain deadline
    (``shutting_down``, retryable: another replica, or this host once restarted, can answer)."""

    default_code = "shutting_down"
    default_retryable = True


# The status of each stable code. Admission reasons follow the spec's table: load-dependent
# refusals are 429 (queue_full) or 503; an unhealthy or crash-looped engine is a 503 as well
# (the service is unavailable until an operator acts); capacity refusals are 503.
_STATUS: Final[dict[str, int]] = {
    "invalid_body": 400,
    "invalid_request": 400,
    "chat_not_supported": 400,
    "invalid_job_id": 400,
    "invalid_last_event_id": 400,
    "invalid_artifact_digest": 400,
    "unauthorized": 401,
    # A peer hop without the fleet credential (sbproxy/api/peers.py).
    "peer_unauthorized": 401,
    "cross_site_request": 403,
    "model_not_found": 404,
    "unknown_origin": 404,
    "unknown_deployment": 404,
    "job_not_found": 404,
    "artifact_not_found": 404,
    "request_body_too_large": 413,
    "queue_full": 429,
    "token_budget_exceeded": 429,
    "queue_timeout": 503,
    "draining": 503,
    "engine_unhealthy": 503,
    "crash_loop": 503,
    "insufficient_capacity": 503,
    "no_ready_replica": 503,
    "shutting_down": 503,
    # The journal's PostgreSQL server is unreachable: serving goes on, mutations wait.
    "journal_unavailable": 503,
    "upstream_unavailable": 502,
    "engine_timeout": 504,
    "job_not_retryable": 409,
    "job_not_cancellable": 409,
    "removal_blocked": 409,
    "no_cache_budget": 409,
}

_CLIENT_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    413: "invalid_request_error",
}

# Codes whose OpenAI error type is not the status's: a used-up budget is a quota, as OpenAI
# names it (clients that branch on ``type`` already know this one).
_CODE_TYPES: Final[dict[str, str]] = {"token_budget_exceeded": "insufficient_quota"}

# Litestar's own HTTP exceptions, as stable codes.
_HTTP_CODES: Final[dict[int, str]] = {
    400: "invalid_body",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_body_too_large",
}


def status_for(error: SbproxyError) -> int:
    """The HTTP status of ``error``: by its code, else 502 for an upstream-side failure."""
    return code_status(error.code)


def code_status(code: str) -> int:
    """The HTTP status of the stable reason code ``code`` (502 for one not listed)."""
    return _STATUS.get(code, 502)


ENGINE_REACHED: Final = "engine_reached"
"""Detail of an ``upstream_unavailable`` error: whether the request may have reached the
engine. ``False`` (nothing was sent: the engine's port refused the connection) is answered
with ``X-Sbproxy-Engine-Reached: no``, so that a calling host may send the request to another
replica without running the generation twice (issue 30, item 25)."""
ENGINE_REACHED_HEADER: Final = "X-Sbproxy-Engine-Reached"


def _hints(error: SbproxyError) -> dict[str, str]:
    """The headers an error answer carries besides its body: ``Retry-After`` for a
    retryable one; ``X-Sbproxy-Engine-Reached: no`` for an engine failure that sent
    nothing."""
    hints = _retry_after(error)
    if error.details.get(ENGINE_REACHED) is False:
        hints[ENGINE_REACHED_HEADER] = "no"
    return hints


def _retry_after(error: SbproxyError) -> dict[str, str]:
    if not error.retryable:
        return {}
    hint = error.details.get("retry_after_ms")
    millis = hint if isinstance(hint, int) and hint > 0 else 1000
    return {"Retry-After": str(max(1, math.ceil(millis / 1000)))}


def _challenge(status: int) -> dict[str, str]:
    return {"WWW-Authenticate": 'Basic realm="sbproxy-admin"'} if status == 401 else {}


def _http_code(exc: HTTPException) -> str:
    return _HTTP_CODES.get(exc.status_code, "http_error")


def _http_message(exc: HTTPException) -> str:
    if exc.status_code == 413:
        return "the request body is too large"
    if exc.status_code == 404:
        return "no such route"
    if exc.status_code == 405:
        return "method not allowed on this route"
    return str(exc.detail) if exc.detail else "bad request"


# -- gateway --------------------------------------------------------------------------------


def _envelope(*, status: int, message: str, code: str, retryable: bool) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _CODE_TYPES.get(code) or _CLIENT_TYPES.get(status, "managed_model_error"),
            "code": code,
            "sbproxy_reason": code,
            "retryable": retryable,
        }
    }


def stream_error_event(error: SbproxyError) -> bytes:
    """``error`` as the last event of an SSE stream: ``data: {"error": {...}}`` and a blank
    line, the envelope :func:`gateway_error` would have sent with a status."""
    body = _envelope(
        status=status_for(error), message=error.message, code=error.code, retryable=error.retryable
    )
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def gateway_error(exc: Exception) -> tuple[int, dict[str, object], dict[str, str]]:
    """What the gateway answers for ``exc`` raised by a request's handling: its status, the
    OpenAI envelope and the extra headers (``Retry-After``, ``X-Sbproxy-Engine-Reached``,
    an ``HTTPException``'s own). The one map both the Litestar routes and the raw inference
    routes (:class:`sbproxy.api.gateway.GatewayApp`) answer with.

    An :class:`SbproxyError` of status 502 or 504 (the engine failed or timed out) is logged
    as a warning; an exception that is neither an :class:`SbproxyError` nor an
    ``HTTPException`` is logged with its traceback and answered 500 ``internal``.
    """
    if isinstance(exc, SbproxyError):
        status = status_for(exc)
        if status in (502, 504):  # worth an operator's look
            logger.warning("gateway request failed: %s (%s)", exc.message, exc.code)
        envelope = _envelope(
            status=status, message=exc.message, code=exc.code, retryable=exc.retryable
        )
        return status, envelope, _hints(exc)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        envelope = _envelope(
            status=status, message=_http_message(exc), code=_http_code(exc), retryable=False
        )
        return status, envelope, dict(exc.headers or {})
    logger.exception("gateway request failed", exc_info=exc)
    envelope = _envelope(
        status=500, message="internal error; see the server log", code="internal", retryable=False
    )
    return 500, envelope, {}


def _gateway_handler(_: Request[Any, Any, Any], exc: Exception) -> Response[object]:
    status, envelope, headers = gateway_error(exc)
    return Response(envelope, status_code=status, headers=headers)


def gateway_exception_handlers() -> ExceptionHandlersMap:
    """Exception handlers of the gateway app."""
    return {
        SbproxyError: _gateway_handler,
        HTTPException: _gateway_handler,
        Exception: _gateway_handler,
    }


# -- admin ----------------------------------------------------------------------------------


def admin_error(
    *,
    status: int,
    code: str,
    message: str,
    details: Mapping[str, JsonScalar] | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response[dict[str, object]]:
    """The admin error body ``{"code", "error", **details}``."""
    body = _admin_body(code=code, message=message, details=details)
    return Response(
        body, status_code=status, headers=dict(headers or {}), media_type=MediaType.JSON
    )


def _admin_body(
    *, code: str, message: str, details: Mapping[str, JsonScalar] | None
) -> dict[str, object]:
    body: dict[str, object] = {"code": code, "error": message}
    for key, value in (details or {}).items():
        body.setdefault(key, value)
    return body


def _admin_sbproxy(_: Request[Any, Any, Any], exc: SbproxyError) -> Response[object]:
    status = status_for(exc)
    if status == 502:
        logger.warning("admin request failed: %s (%s)", exc.message, exc.code)
    return admin_error(  # type: ignore[return-value]
        status=status,
        code=exc.code,
        message=exc.message,
        details=exc.details,
        headers={**_hints(exc), **_challenge(status)},
    )


def _admin_http(_: Request[Any, Any, Any], exc: HTTPException) -> Response[object]:
    return admin_error(  # type: ignore[return-value]
        status=exc.status_code,
        code=_http_code(exc),
        message=_http_message(exc),
        headers=exc.headers,
    )


def _admin_internal(_: Request[Any, Any, Any], exc: Exception) -> Response[object]:
    logger.exception("admin request failed", exc_info=exc)
    return admin_error(  # type: ignore[return-value]
        status=500, code="internal", message="internal error; see the server log"
    )


def admin_exception_handlers() -> ExceptionHandlersMap:
    """Exception handlers of the admin app."""
    return {
        SbproxyError: _admin_sbproxy,
        HTTPException: _admin_http,
        Exception: _admin_internal,
    }


# -- raw ASGI (responses written outside a handler) -----------------------------------------


def _body(error: SbproxyError, *, surface: Surface) -> dict[str, object]:
    if surface == "gateway":
        return _envelope(
            status=status_for(error),
            message=error.message,
            code=error.code,
            retryable=error.retryable,
        )
    return _admin_body(code=error.code, message=error.message, details=error.details)


def error_payload(
    error: SbproxyError, *, surface: Surface
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """``error`` as a whole HTTP answer of ``surface``, for code that speaks raw ASGI.

    Returns:
        ``(status, body, headers)``: the status of :func:`status_for`, the UTF-8 JSON body
        (OpenAI envelope on the gateway, ``{"code", "error", ...}`` on admin) and the ASGI
        header pairs (content type, length, ``Retry-After`` for a retryable error).
    """
    body = json.dumps(_body(error, surface=surface), separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    headers += [(k.lower().encode(), v.encode()) for k, v in _hints(error).items()]
    return status_for(error), body, headers


def error_event(error: SbproxyError, *, surface: Surface) -> bytes:
    """``error`` as the last Server-Sent Event of a stream of ``surface``: one ``data:``
    line with the gateway's OpenAI envelope, or on admin ``{"type": "error", "code",
    "error", ...}`` (admin frames name their ``type``), then the blank line."""
    document = _body(error, surface=surface)
    if surface == "admin":
        document = {"type": "error", **document}
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"
