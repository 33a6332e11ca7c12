"""One server span per HTTP request of the gateway and the admin listener.

:func:`server_spans` is a Litestar middleware (pure ASGI). When tracing is off
(:func:`sbproxy.telemetry.enabled` is false: no exporter configured) it calls the route at
once -- the hot path pays one boolean test. When it is on, each request runs inside a span:

* name ``"{method} {route}"`` (the route template, e.g. ``POST /v1/chat/completions`` or
  ``GET /admin/model-host/jobs/{job_id:str}``), kind ``SERVER``;
* attributes ``http.request.method``, ``http.route``, ``http.response.status_code`` and
  ``sbproxy.listener`` (``gateway`` or ``admin``); the gateway adds ``sbproxy.deployment``,
  ``sbproxy.model``, ``sbproxy.key.name`` and the answer's token usage
  (``gen_ai.usage.input_tokens`` / ``output_tokens``);
* status ``ERROR`` for a 5xx answer or an exception;
* the parent is the caller's W3C ``traceparent``, when it sends one.

A job a request submits stores this span's context and each run of the job links to it.
The span covers a streamed answer to its last byte. Header values, query strings and bodies
are never recorded (they may hold keys or prompts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import propagate, trace

from sbproxy.telemetry import enabled, tracer

__all__ = ["server_spans"]

_PROPAGATED: Final = frozenset({b"traceparent", b"tracestate"})


def server_spans(listener: str) -> Callable[[ASGIApp], ASGIApp]:
    """A middleware factory tracing every HTTP request of ``listener`` (see the module)."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def traced(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP or not enabled():
                await app(scope, receive, send)
                return
            method = scope["method"]
            route = scope.get("path_template") or scope["path"]
            carrier = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in scope["headers"]
                if name in _PROPAGATED
            }
            parent = propagate.extract(carrier) if carrier else None
            with tracer().start_as_current_span(
                f"{method} {route}",
                context=parent,
                kind=trace.SpanKind.SERVER,
                attributes={
                    "http.request.method": method,
                    "http.route": route,
                    "sbproxy.listener": listener,
                },
            ) as span:

                async def observed(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        status = int(message["status"])
                        span.set_attribute("http.response.status_code", status)
                        if status >= 500:
                            span.set_status(trace.StatusCode.ERROR)
                    await send(message)

                await app(scope, receive, observed)

        return traced

    return middleware
