"""The OpenAI-compatible gateway: origins by Host, public model names, admission, relay.

A request is authenticated by the key plane, its public model (or the origin's default
model) is resolved to a deployment, the runtime manager admits it (starting a cold engine
when needed), and the body is forwarded unchanged to the engine over one shared
:class:`aiohttp.ClientSession` -- the measured fastest client for this hop
(``measured-here.md``, "The proxy's hot path"); llama-server ignores ``model``, so the body is
not re-encoded. Answers carry the public model name in ``model``.

Streaming (``"stream": true``) is relayed event by event as the engine writes it: bytes go
out as soon as a complete SSE event has arrived (an event split across reads waits only for
its own end). The admission permit is released, and the upstream connection closed -- which
stops the engine's generation -- when the stream ends, fails, or the client disconnects.

Origin matching (``Host`` without its port, case-insensitive):

1. an origin with exactly that name;
2. for a loopback name (``localhost``, ``127.0.0.1``, ``::1``), any loopback-named origin;
3. when exactly one origin is configured, that origin, whatever the Host.

Anything else is a 404 ``unknown_origin``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from sbproxy.api.errors import (
    ApiError,
    InvalidBody,
    UnknownModel,
    UnknownOrigin,
    gateway_exception_handlers,
)
from sbproxy.api.keys import Caller, KeyPlane
from sbproxy.api.metrics import Rejections
from sbproxy.config import Route
from sbproxy.model_host.runtime import AdmissionRejected
from sbproxy.model_host.runtime.manager import RuntimeManager, Upstream
from sbproxy.model_host.runtime.state import DeploymentState

__all__ = ["Gateway", "Routing", "create_gateway_app"]

logger = logging.getLogger(__name__)

LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
# Embedding batches can be large; anything beyond this is not a chat request.
MAX_BODY_BYTES: Final = 32 * 1024 * 1024


class UpstreamUnavailable(ApiError):
    """The engine could not be reached after admission (``upstream_unavailable``)."""

    default_code = "upstream_unavailable"
    default_retryable = True


class _Head(msgspec.Struct):
    """The only fields of an OpenAI request body the gateway reads."""

    model: str | None = None
    stream: bool = False


_HEAD_DECODER = msgspec.json.Decoder(_Head)
_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def host_of(header: str | None) -> str:
    """The host name of a ``Host`` header, lowercased, without port or IPv6 brackets."""
    value = (header or "").strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        return value.partition(":")[0]
    return value


@dataclass
class _Origin:
    name: str
    models: dict[str, Route] = field(default_factory=dict)
    default: Route | None = None


class Routing:
    """The public routes of every origin (see the module docstring for matching)."""

    def __init__(self, routes: tuple[Route, ...]) -> None:
        self.origins: dict[str, _Origin] = {}
        for route in routes:
            origin = self.origins.setdefault(route.origin.lower(), _Origin(route.origin.lower()))
            origin.models.setdefault(route.public_model, route)
            if route.default and origin.default is None:
                origin.default = route

    def origin(self, host_header: str | None) -> _Origin:
        """The origin serving ``host_header``.

        Raises:
            UnknownOrigin: ``unknown_origin``.
        """
        host = host_of(host_header)
        found = self.origins.get(host)
        if found is not None:
            return found
        if host in LOOPBACK_NAMES:
            for name in sorted(LOOPBACK_NAMES):
                if name in self.origins:
                    return self.origins[name]
        if len(self.origins) == 1:
            return next(iter(self.origins.values()))
        raise UnknownOrigin(
            f"no origin is configured for host {host!r}",
            remediation="Add it under origins: in sb.yml, or send the configured Host header.",
            details={"host": host},
        )

    def route(self, host_header: str | None, model: str | None) -> Route:
        """The route of ``model`` (or the default model) on the request's origin.

        Raises:
            UnknownOrigin: ``unknown_origin``.
            UnknownModel: ``model_not_found``.
            InvalidBody: ``invalid_body`` when no model is named and there is no default.
        """
        origin = self.origin(host_header)
        if not model:
            if origin.default is None:
                raise InvalidBody("the request names no model and the origin has no default")
            return origin.default
        route = origin.models.get(model)
        if route is None:
            known = ", ".join(sorted(origin.models)) or "none"
            raise UnknownModel(
                f"the model {model!r} does not exist on this origin (models: {known})",
                details={"model": model},
            )
        return route


@dataclass
class Gateway:
    """Shared state of the gateway app: the manager, routes, keys and the upstream client."""

    manager: RuntimeManager
    routing: Routing
    keys: KeyPlane
    rejections: Rejections = field(default_factory=Rejections)
    session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Create the shared upstream session (on the app's event loop)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                auto_decompress=False,
            )

    async def close(self) -> None:
        """Close the upstream session."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    def availability(self, deployment: str) -> dict[str, object]:
        """``{state: ready|cold|unavailable, ready_replicas, desired_replicas}``."""
        slot = self.manager.slot(deployment)
        ready = (
            slot.state == DeploymentState.READY
            and slot.process is not None
            and slot.process.alive()
        )
        if ready:
            state = "ready"
        elif slot.crash is not None or slot.state in (
            DeploymentState.FAILED,
            DeploymentState.DRAINING,
        ):
            state = "unavailable"
        else:
            state = "cold"
        return {
            "state": state,
            "ready_replicas": int(ready),
            "desired_replicas": slot.config.replicas,
        }

    async def admit(self, route: Route, caller: Caller) -> Upstream:
        """Admit one request of ``caller`` to ``route``'s deployment.

        Raises:
            AdmissionRejected: any admission reason (counted for the metrics).
        """
        try:
            return await self.manager.acquire(route.deployment, priority=caller.priority)
        except AdmissionRejected as exc:
            self.rejections.record(
                deployment=route.deployment, priority=caller.priority.value, reason=exc.code
            )
            raise

    async def forward(self, request: Request[Any, Any, Any], path: str) -> Response[Any]:
        """Relay one OpenAI request to its engine (see the module docstring)."""
        caller = self.keys.authenticate(request.headers.get("authorization"))
        body = await request.body()
        try:
            head = _HEAD_DECODER.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise InvalidBody(f"the body is not a valid request: {exc}") from None
        route = self.routing.route(request.headers.get("host"), head.model)
        upstream = await self.admit(route, caller)
        try:
            assert self.session is not None  # noqa: S101 - opened at app startup
            response = await self.session.post(
                f"{upstream.base_url}{path}",
                data=body,
                headers={"Content-Type": "application/json"},
            )
        except aiohttp.ClientError as exc:
            upstream.release()
            raise UpstreamUnavailable(
                f"the engine of {route.deployment} did not answer: {type(exc).__name__}",
                details={"deployment": route.deployment},
            ) from None
        except BaseException:
            upstream.release()
            raise
        headers = {"x-sbproxy-logical-model": route.public_model, "x-sbproxy-route-class": "local"}
        streaming = head.stream and response.content_type == "text/event-stream"
        if not streaming:
            try:
                data = await response.read()
            finally:
                response.release()
                upstream.release()
            if response.content_type == "application/json":
                data = rewrite_model(data, route.public_model)
            return Response(
                data,
                status_code=response.status,
                media_type=response.content_type or "application/json",
                headers=headers,
            )
        relay = _Relay(response, upstream, route.public_model)
        return Stream(
            relay.events(),
            status_code=response.status,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
            background=BackgroundTask(relay.close),
        )


def rewrite_model(data: bytes, public_model: str) -> bytes:
    """``data`` with a top-level JSON ``model`` set to ``public_model`` (else unchanged)."""
    try:
        document = _DECODER.decode(data)
    except msgspec.DecodeError:
        return data
    if not isinstance(document, dict) or "model" not in document:
        return data
    document["model"] = public_model
    return _ENCODER.encode(document)


def rewrite_event(event: bytes, public_model: str) -> bytes:
    """One SSE event with the ``model`` of its JSON ``data:`` line rewritten."""
    if b'"model"' not in event:
        return event
    lines = event.split(b"\n")
    for index, line in enumerate(lines):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload.startswith(b"{"):
                lines[index] = b"data: " + rewrite_model(payload, public_model)
    return b"\n".join(lines)


class _Relay:
    """One streamed answer: yields complete SSE events, frees everything exactly once."""

    def __init__(
        self, response: aiohttp.ClientResponse, upstream: Upstream, public_model: str
    ) -> None:
        self.response = response
        self.upstream = upstream
        self.public_model = public_model
        self.finished = False
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for chunk in self.response.content.iter_any():
                pending += chunk.replace(b"\r\n", b"\n")
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                complete, pending = pending[: end + 2], pending[end + 2 :]
                yield b"".join(
                    rewrite_event(event, self.public_model) + b"\n\n"
                    for event in complete[:-2].split(b"\n\n")
                )
            if pending:
                yield rewrite_event(pending, self.public_model)
            self.finished = True
        finally:
            await self.close()

    async def close(self) -> None:
        """Release the permit; close the upstream connection unless it was read to its end
        (a closed connection is how the engine learns to stop generating)."""
        if self.closed:
            return
        self.closed = True
        if self.finished:
            self.response.release()
        else:
            self.response.close()
        self.upstream.release()


def create_gateway_app(gateway: Gateway, *, debug: bool = False) -> Litestar:
    """The gateway app: ``/v1/models``, chat/completions/embeddings relays.

    The app opens the shared upstream session at startup and closes it at shutdown.
    """

    @get(["/v1/models", "/models"], sync_to_thread=False)
    def list_models(request: Request[Any, Any, Any]) -> dict[str, object]:
        gateway.keys.authenticate(request.headers.get("authorization"))
        origin = gateway.routing.origin(request.headers.get("host"))
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "sbproxy",
                "availability": gateway.availability(route.deployment),
            }
            for name, route in sorted(origin.models.items())
        ]
        return {"object": "list", "data": data}

    @post("/v1/chat/completions")
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await gateway.forward(request, "/v1/chat/completions")

    @post("/v1/completions")
    async def completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await gateway.forward(request, "/v1/completions")

    @post("/v1/embeddings")
    async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
        return await gateway.forward(request, "/v1/embeddings")

    return Litestar(
        route_handlers=[list_models, chat_completions, completions, embeddings],
        exception_handlers=gateway_exception_handlers(),
        on_startup=[gateway.open],
        on_shutdown=[gateway.close],
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=None,
        debug=debug,
        # Logging is configured once by the process (sbproxy serve / run), not per app.
        logging_config=None,
    )
