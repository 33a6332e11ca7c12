"""The gateway's access log: one line per HTTP request.

uvicorn's own access log stays off (``sbproxy/api/server.py``): it cannot know the
deployment, nor that a client went away before its answer. :func:`access_log` is a pure
ASGI middleware that writes, when the request has ended (a stream at its last event)::

    POST /v1/chat/completions 200 deployment=local-qwen 812.4ms
    POST /v1/completions 499 deployment=local-qwen 1003.0ms client_disconnected
    POST /v1/chat/completions 504 deployment=local-qwen 30001.2ms engine_timeout
    POST /v1/chat/completions 200 deployment=local-qwen 93.1ms peer=gpu-02 spilled=queue_full

to the logger ``sbproxy.api.access``: method, path (no query string), status, deployment
(``-`` before one is known), duration in milliseconds from the request's arrival, on a host
of a fleet the node of the peer replica that answered (``peer=``) and, when this host's own
replica refused first, that refusal's code (``spilled=``: the request spilled over to the
peer; such a line is logged at INFO), and, when the request did not end in a relayed answer,
its reason code (an admission refusal such as ``queue_timeout``, ``engine_timeout``,
``upstream_unavailable``, ``client_disconnected``). Status ``499`` (nginx's "client closed
request") is a client that went away before its answer ended; a stream whose headers already
went out is logged with 499 too, although 200 went out on the wire -- unless the stream's
end (``[DONE]``, or its usage event) had gone out: a client that closes then completed its
request. A stream cut by the gateway (``engine_timeout``, ``upstream_unavailable``) keeps
the status it was sent with and names the reason; so does a request the host ended at its
drain deadline (``shutting_down``: 503, or the status of an answer that had started).

Levels: a request that did not end in a plain answer (an outcome, a status >= 400 -- 499
included) is logged at INFO, so a server logs every refusal, timeout and disconnect; a
successful answer at DEBUG. A line written per successful request cost about 15 % of peak
throughput here (``docs/observability.md``), so ``sbproxy serve`` and ``run`` log those only
with ``SBPROXY_ACCESS_LOG=all`` (``off`` silences the access log;
:func:`sbproxy.cli._output.configure_server_logging`).

Only requests that reach a gateway route are logged (Litestar runs middleware after
routing): an unknown path's 404 has no line.

The route fills in an :class:`AccessNote` found with :func:`access_note`. With the logger
below INFO and no activity ring the middleware only tests one flag per request.

With an :class:`~sbproxy.api.activity.Activity` ring, every request routed to a deployment
also ends as one :class:`~sbproxy.api.activity.RequestRecord` there (key name, status,
usage tokens, time to first token, duration: never prompt text), whatever the log level.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Final

from litestar.enums import ScopeType
from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send

from sbproxy.api.activity import Activity, RequestRecord
from sbproxy.api.errors import code_status

__all__ = [
    "CLIENT_CLOSED",
    "CLIENT_DISCONNECTED",
    "SHUTTING_DOWN",
    "AccessNote",
    "access_log",
    "access_note",
    "note_shutting_down",
]

logger = logging.getLogger(__name__)

# nginx's code for a client that closed the connection before the answer was sent.
CLIENT_CLOSED: Final = 499
# The outcome of such a request (the access log's reason code).
CLIENT_DISCONNECTED: Final = "client_disconnected"
# The outcome of a request the host ended at its drain deadline (or a second stop signal).
SHUTTING_DOWN: Final = "shutting_down"

_KEY: Final = "sbproxy.access"


@dataclass(slots=True)
class AccessNote:
    """What the route tells the access log about one request.

    Attributes:
        deployment: The deployment it was routed to.
        status: Overrides the status sent (``499`` when the client went away).
        outcome: Reason code of an abnormal end (a refusal's code, ``engine_timeout``,
            ``upstream_unavailable``, ``client_disconnected``).
        key_name: The caller's key name (for the activity ring; never the key itself).
        prompt_tokens: The answer's ``usage.prompt_tokens``.
        completion_tokens: The answer's ``usage.completion_tokens``.
        first_token_at: ``time.perf_counter()`` when a stream's first event was relayed.
        peer: The node of the peer replica that answered (peer dispatch); ``None``: here.
        spilled: The code of this host's own refusal when the request spilled over to a
            peer (``queue_full``, ``upstream_unavailable``, ...).
        sent: The status that went out (set by the middleware; 500 until an answer starts:
            an exception that escapes every handler ends as uvicorn's 500).
        answered: Whether an answer started (its status line went out).
    """

    deployment: str | None = None
    status: int | None = None
    outcome: str | None = None
    key_name: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    peer: str | None = None
    spilled: str | None = None
    sent: int = 500
    answered: bool = False


def access_note(scope: Scope) -> AccessNote | None:
    """The note of the request of ``scope``; ``None`` when the access log is off."""
    state: dict[str, Any] | None = scope.get("state")
    if state is None:
        return None
    note: AccessNote | None = state.get(_KEY)
    return note


def note_shutting_down(scope: Scope) -> None:
    """The host is ending the request of ``scope`` (its drain deadline passed, or a second
    stop signal came): logged with the reason code ``shutting_down`` and the status its
    client gets -- the 503 the shutdown answers with, or the status of an answer that
    already started (a stream then ends with an error event) -- not as a client that went
    away (``499 client_disconnected``)."""
    note = access_note(scope)
    if note is not None:
        note.outcome = SHUTTING_DOWN
        note.status = None if note.answered else code_status(SHUTTING_DOWN)


def _record(
    activity: Activity, scope: Scope, note: AccessNote, status: int, started: float
) -> None:
    if note.deployment is None:
        return  # not an inference request (``/v1/models``, a refusal before routing)
    now = perf_counter()
    first = note.first_token_at
    activity.record(
        RequestRecord(
            ended_at_ms=int(time.time() * 1000),
            deployment=note.deployment,
            key_name=note.key_name,
            path=scope["path"],
            status=status,
            outcome=note.outcome,
            prompt_tokens=note.prompt_tokens,
            completion_tokens=note.completion_tokens,
            first_token_ms=(first - started) * 1000 if first is not None else None,
            duration_ms=(now - started) * 1000,
        )
    )


def access_log(activity: Activity | None = None) -> Callable[[ASGIApp], ASGIApp]:
    """A middleware factory logging every HTTP request (see the module docstring), and
    keeping each routed one in ``activity`` when given."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def logged(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or (
                activity is None and not logger.isEnabledFor(logging.INFO)
            ):
                await app(scope, receive, send)
                return
            started = perf_counter()
            note = AccessNote()
            scope.setdefault("state", {})[_KEY] = note

            async def observed(message: Message) -> None:
                if message["type"] == "http.response.start":
                    note.sent = message["status"]
                    note.answered = True
                await send(message)

            try:
                await app(scope, receive, observed)
            finally:
                _finish(activity, scope, note, started)

        return logged

    return middleware


def _finish(activity: Activity | None, scope: HTTPScope, note: AccessNote, started: float) -> None:
    """Keep the ended request in ``activity`` and log its line (see the module docstring)."""
    status = note.status or note.sent
    if activity is not None:
        _record(activity, scope, note, status, started)
    level = logging.INFO if note.outcome or note.spilled or status >= 400 else logging.DEBUG
    if logger.isEnabledFor(level):
        logger.log(
            level,
            "%s %s %d deployment=%s %.1fms%s%s%s",
            scope["method"],
            scope["path"],
            status,
            note.deployment or "-",
            (perf_counter() - started) * 1000,
            f" peer={note.peer}" if note.peer else "",
            f" spilled={note.spilled}" if note.spilled else "",
            f" {note.outcome}" if note.outcome else "",
        )
