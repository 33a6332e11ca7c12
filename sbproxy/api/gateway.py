"""The OpenAI-compatible gateway: origins by Host, public model names, admission, relay.

A request is authenticated by the key plane, its public model (or the origin's default
model) is resolved to a deployment, the runtime manager admits it (starting a cold engine
when needed), and the body is forwarded unchanged to the engine over kept-alive loopback
connections (:class:`~sbproxy.api.engine_http.EnginePool`: asyncio protocols parsing answers
with httptools, ~8x less CPU per exchange than an aiohttp session, which stays the client of
peer hops); llama-server ignores ``model``, so the body is not re-encoded. A request that
meets a kept-alive connection the engine closed is sent again on another. Answers carry the
public model name in ``model``.

The inference routes (:data:`INFERENCE_PATHS`) are served by :class:`GatewayApp` in front
of the Litestar app, as raw ASGI, with the same access log, spans and error answers; the
rest of the listener is Litestar's.

Streaming (``"stream": true``) is relayed event by event as the engine writes it
(:class:`~sbproxy.api.relay.StreamRelay`). The admission permit is released, and the
upstream connection closed -- which stops the engine's generation -- when the stream ends,
fails, runs out of a limit, or the client disconnects.

Supervision (:mod:`sbproxy.api.supervision`): every admitted request is bounded by its
deployment's ``request_timeout_ms``, a stream also by ``first_token_timeout_ms`` and
``stall_timeout_ms``. A limit that runs out closes the upstream connection, frees the permit
at once and answers 504 ``engine_timeout`` -- or, once a stream's headers went out, ends the
stream with that error as an SSE event. A client that disconnects while its request waits
(for admission, or for a plain answer) is noticed on the ASGI ``receive`` channel (watched
once the request has waited 50 ms: :class:`~sbproxy.api.supervision.ExchangeBound`): the wait
is cancelled, the upstream connection closed and the permit freed at once; a stream's
client is watched the same way while the stream runs (:class:`_EventStream`). Each admitted
request reports its end to the runtime once (:meth:`Upstream.report`; ``timed_out`` only for
a supervision limit), then releases its permit. A request whose client went away is counted in
``sbproxy_gateway_client_disconnects_total`` and logged with status 499
(:mod:`sbproxy.api.access`); a stream's client that closes once it has the stream's end
(``[DONE]``, or the usage event before it) did not go away (:mod:`sbproxy.api.relay`).

Usage and budgets (:mod:`sbproxy.api.usage`): a key over its token budget is refused with
429 ``token_budget_exceeded`` before admission, so the engine never sees the request. Each
answer's ``usage`` is counted under the caller's key name: from the body of a plain answer
(the body is decoded for the ``model`` rewrite anyway), and from the event of a stream that
carries ``usage``. A streamed *chat completion* carries it only when
``stream_options.include_usage`` is true, so the gateway sets it on every streamed chat
request -- re-encoding only those bodies -- and, when the client had not asked for it, the
relay drops that usage-only event: the client sees exactly the stream it asked for (see
:mod:`sbproxy.api.relay` for a stream that ends without ``usage``).

Several hosts (:mod:`sbproxy.api.peers`): on a host of a fleet (``Gateway.fleet``), a request
for a deployment with no ready replica here goes to a peer host's gateway -- the one with the
fewest outstanding requests -- and its answer comes back byte for byte
(``x-sbproxy-route-class: peer``, ``x-sbproxy-peer-node``); so does a client's request that the
replica here refused before any byte went out (spill-over, :meth:`Gateway.forward_to_peer`:
only on that exception path). A ``routing: prefix`` deployment's request goes to the replica
that most likely holds its prompt's prefix, here or a peer's (:mod:`sbproxy.api.prefix_route`).
A peer host's own request (``X-Sbproxy-Peer-Hop`` with the fleet
credential) is served here only, with no key, budget or usage, and never spills. A single host
never looks at any of it: with no fleet the request path is the one above.

Origin matching (``Host`` without its port, case-insensitive):

1. an origin with exactly that name;
2. for a loopback name (``localhost``, ``127.0.0.1``, ``::1``), any loopback-named origin;
3. when exactly one origin is configured, that origin, whatever the Host.

Anything else is a 404 ``unknown_origin``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, cast

import aiohttp
import msgspec
from litestar import Litestar, Request, get, post
from litestar.enums import ScopeType
from litestar.exceptions import ClientException, InternalServerException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import HTTPRouteHandler
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Receive, Scope, Send
from opentelemetry import trace
from yarl import URL

from sbproxy.api import engine_client
from sbproxy.api.access import (
    CLIENT_CLOSED,
    CLIENT_DISCONNECTED,
    SHUTTING_DOWN,
    AccessNote,
    access_log,
    access_note,
)
from sbproxy.api.activity import Activity
from sbproxy.api.bodies import ChatNotSupported, Head, check_body, decode_head, with_fields
from sbproxy.api.engine_http import EnginePool, EngineResponse
from sbproxy.api.errors import (
    ENGINE_REACHED,
    InvalidBody,
    UnknownModel,
    UnknownOrigin,
    gateway_error,
    gateway_exception_handlers,
)
from sbproxy.api.keys import Caller, KeyPlane
from sbproxy.api.metrics import Disconnects, Rejections
from sbproxy.api.peers import (
    NoReadyReplica,
    PeerDispatch,
    PeerOutcome,
    peer_headers,
    trace_context,
)
from sbproxy.api.prefix_route import fleet_choice, local_choice, prefix_routed
from sbproxy.api.relay import (
    StreamRelay,
    UpstreamUnavailable,
    Usage,
    answer_usage,
    rewrite_answer,
)
from sbproxy.api.supervision import ExchangeBound, Limit, engine_timeout
from sbproxy.api.tracing import server_spans
from sbproxy.api.usage import UsageLedger
from sbproxy.config import DeploymentConfig, Route
from sbproxy.errors import SbproxyError
from sbproxy.fleet.prefix import prefix_key
from sbproxy.fleet.routing import PeerReplica
from sbproxy.model_host.runtime import AdmissionRejected
from sbproxy.model_host.runtime.manager import RuntimeManager, Upstream
from sbproxy.model_host.runtime.state import DeploymentStatus
from sbproxy.model_host.service import ModelHostService
from sbproxy.telemetry import (
    ATTR_DEPLOYMENT,
    ATTR_INPUT_TOKENS,
    ATTR_KEY_NAME,
    ATTR_MODEL,
    ATTR_OUTPUT_TOKENS,
    ATTR_PEER_NODE,
    ATTR_SPILLED,
    enabled,
)

__all__ = ["INFERENCE_PATHS", "Gateway", "GatewayApp", "Routing", "create_gateway_app"]

LOOPBACK_NAMES: Final = frozenset({"localhost", "127.0.0.1", "::1"})
# Embedding batches can be large; anything beyond this is not a chat request.
MAX_BODY_BYTES: Final = 32 * 1024 * 1024
# Upstream URLs kept parsed (by engine base URL and path); a relaunch on a new port adds one.
_URLS_KEPT: Final = 64
# Statuses whose answer has no body (as Litestar's ASGIResponse treats them).
_NO_BODY: Final = frozenset({204, 304})
_ROUTE_CLASS: Final = (b"x-sbproxy-route-class", b"local")
# How a peer's relayed stream ended, as a try's outcome.
_PEER_OUTCOMES: Final = {
    "upstream_unavailable": PeerOutcome.CUT,
    "engine_timeout": PeerOutcome.TIMED_OUT,
    CLIENT_DISCONNECTED: PeerOutcome.CLIENT_GONE,
}
# What a local replica may refuse before any byte reached the client and a peer replica can
# take instead (spill-over, Gateway.forward_to_peer).
# An answer a peer host served (sbproxy/api/peers.py), the node that served it, and the code
# of this host's own refusal when the request spilled over.
_PEER_CLASS: Final = (b"x-sbproxy-route-class", b"peer")
_PEER_NODE: Final = b"x-sbproxy-peer-node"
_SPILLED: Final = b"x-sbproxy-spilled"


def _spillable(exc: SbproxyError) -> bool:
    """Whether a local refusal may go to a peer instead: any admission refusal, and an
    engine failure that provably never reached the engine (the peer would run it again)."""
    if isinstance(exc, AdmissionRejected):
        return True
    return isinstance(exc, UpstreamUnavailable) and exc.details.get(ENGINE_REACHED) is False


def _request_headers(scope: Scope) -> tuple[str | None, str | None, bytes | None]:
    """The first ``Authorization``, ``Host`` and ``Content-Length`` header of the request
    (ASGI names are lowercase), read from the scope without building a header map."""
    authorization: str | None = None
    host: str | None = None
    length: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is None:
                authorization = value.decode("latin-1")
        elif name == b"host":
            if host is None:
                host = value.decode("latin-1")
        elif name == b"content-length" and length is None:
            length = value
    return authorization, host, length


async def read_body(receive: Receive, length: bytes | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, read from ``receive`` as Litestar's ``Request.body()`` reads it --
    with its errors, so the same answers go out -- without its generator and header map.

    Raises:
        ClientException: 400 for a ``Content-Length`` that is not a number.
        RequestEntityTooLarge: 413 for a body (announced or received) over ``limit`` bytes.
        InternalServerException: the client disconnected before the body ended.
    """
    if length is not None:
        try:
            announced = int(length)
        except ValueError:
            raise ClientException(f"Invalid content-length: {length.decode('latin-1')!r}") from None
        if announced > limit:
            raise RequestEntityTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        if event["type"] == "http.request":
            chunk = event["body"]
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestEntityTooLarge
                chunks.append(chunk)
            if not event.get("more_body", False):
                break
        elif event["type"] == "http.disconnect":
            raise InternalServerException("client disconnected prematurely")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _PlainAnswer:
    """A whole answer as an ASGI app: the start message with the route's headers and the
    body, the same messages Litestar's ``ASGIResponse`` sends (headers ``x-sbproxy-*``,
    ``content-type``, ``content-length``, in that order) without building its header map
    per request."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self, status: int, model_header: bytes, media_type: str | None, body: bytes
    ) -> None:
        self.status = status
        headers = [(b"x-sbproxy-logical-model", model_header), _ROUTE_CLASS]
        if status in _NO_BODY or status < 200:  # informational statuses: no body
            body = b""
        else:
            media = media_type or "application/json"
            if media.startswith("text/"):
                media = f"{media}; charset=utf-8"
            headers.append((b"content-type", media.encode("latin-1")))
            headers.append((b"content-length", str(len(body)).encode()))
        self.headers = headers
        self.body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


_STREAM_HEADERS: Final = (
    (b"x-sbproxy-route-class", b"local"),
    (b"cache-control", b"no-cache"),
    # Proxies in front (nginx) must pass events on as they come, not buffer them.
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
)
_PEER_STREAM_HEADERS: Final = (_PEER_CLASS, *_STREAM_HEADERS[1:])


class _EventStream:
    """A relayed stream as an ASGI app: the messages Litestar's streaming response sends
    (the start, one body message per batch of events, an empty last one), with the
    client's disconnect watched by an :class:`ExchangeBound` -- from :data:`WATCH_AFTER_S`
    on, as for the wait before the answer -- instead of a task group and a listener task
    per stream: a stream of a fast engine ends before it pays for either. A client that
    leaves cancels the relay (the upstream connection is closed, the permit freed, the
    disconnect counted by :class:`StreamRelay`); the relay is closed in any case."""

    __slots__ = ("model_header", "relay", "status")
    stream_headers: tuple[tuple[bytes, bytes], ...] = _STREAM_HEADERS

    def __init__(self, status: int, model_header: bytes, relay: StreamRelay) -> None:
        self.status = status
        self.model_header = model_header
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = self.relay
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status,
                    "headers": [
                        (b"x-sbproxy-logical-model", self.model_header),
                        *self.stream_headers,
                    ],
                }
            )
            events = relay.events()
            bound = ExchangeBound(receive)
            ended = False
            with bound:
                try:
                    async for chunk in events:
                        # The batch with [DONE] goes out as the body's last message: the
                        # server writes it and the chunked body's end in one write.
                        ended = relay.at_done
                        await send(
                            {"type": "http.response.body", "body": chunk, "more_body": not ended}
                        )
                finally:
                    await events.aclose()  # a cancellation at send leaves it at a yield
            if not bound.cancelled_caught and not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await relay.close()


class _PeerEventStream(_EventStream):
    """A stream a peer host serves, relayed as it comes (``extra``: the headers naming the
    node, and the spill-over)."""

    __slots__ = ("stream_headers",)

    def __init__(
        self,
        status: int,
        model_header: bytes,
        relay: StreamRelay,
        extra: tuple[tuple[bytes, bytes], ...],
    ) -> None:
        super().__init__(status, model_header, relay)
        self.stream_headers = (*_PEER_STREAM_HEADERS, *extra)


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


@dataclass(slots=True)
class _Answer:
    """The engine's answer to one admitted request: whole (``data``), or a stream to relay
    (``data`` is ``None``; ``started`` is the loop time it was sent upstream)."""

    upstream: Upstream
    response: EngineResponse
    started: float
    data: bytes | None


@dataclass
class Gateway:
    """Shared state of the gateway app: the manager, routes, keys and the upstream client."""

    manager: RuntimeManager
    routing: Routing
    keys: KeyPlane
    rejections: Rejections = field(default_factory=Rejections)
    disconnects: Disconnects = field(default_factory=Disconnects)
    session: aiohttp.ClientSession | None = None
    activity: Activity = field(default_factory=Activity)
    # Peer dispatch (sbproxy/api/peers.py); None: a single host, whose request path never
    # looks at the fleet.
    fleet: PeerDispatch | None = None
    # The deployments of the configuration in force, by id (handed over at start and at each
    # committed reload, as the routes are): which ones this host has, and their limits.
    deployments: Mapping[str, DeploymentConfig] = field(default_factory=dict)
    usage: UsageLedger = field(init=False)
    # The client of this host's engines (sbproxy/api/engine_http.py), opened with the app.
    engines: EnginePool | None = field(default=None, init=False, repr=False)
    _addresses: dict[str, tuple[str, int]] = field(default_factory=dict, init=False, repr=False)
    _model_headers: dict[str, bytes] = field(default_factory=dict, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.usage = UsageLedger(ModelHostService.serving(self.manager).usage(), self.keys.budgets)

    async def open(self) -> None:
        """Create the shared upstream session (on the app's event loop) and load usage.

        Raises:
            StoreError: ``store_failed`` when the usage of the current periods cannot be read.
        """
        if self.session is None:
            self.session = engine_client.engine_session()
        if self.engines is None:
            self.engines = EnginePool()
        await self.usage.start()

    async def close(self) -> None:
        """Close the upstream session and write pending usage."""
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.engines is not None:
            await self.engines.close()
            self.engines = None
        await self.usage.stop()

    def availability(self, deployment: str) -> dict[str, object]:
        """``{state: ready|cold|unavailable, ready_replicas, desired_replicas}``; on a host of
        a fleet, of the fleet's replicas (:meth:`PeerDispatch.availability`)."""
        if self.fleet is None:
            return self.manager.snapshot(deployment).availability()
        local = self.local_status(deployment)
        return self.fleet.availability(
            deployment, local=local.availability() if local is not None else None
        )

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

    def prepare(self, path: str, head: Head, body: bytes, route: Route) -> tuple[bytes, bool]:
        """Check ``body`` and complete it for the engine (``sbproxy/api/bodies.py``); the
        body to forward and whether the relay drops a usage-only event the client did not
        ask for.

        Raises:
            InvalidRequest: ``invalid_request`` (400) -- never forwarded.
            ChatNotSupported: ``chat_not_supported`` (400) for a completion-only model.
        """
        deployment = route.deployment
        limited = check_body(path, head)
        if path == "/v1/chat/completions" and not self.manager.can_chat(deployment):
            raise ChatNotSupported(
                f"{route.public_model!r} (deployment {deployment!r}) is a completion-only "
                "model: its catalog variant has no chat template. Send a `prompt` to "
                "/v1/completions instead.",
                details={"deployment": deployment, "use": "/v1/completions"},
            )
        fields: dict[str, Any] | None = None
        strip_usage = False
        if head.stream and path == "/v1/chat/completions":
            fields, strip_usage = ask_for_usage(head)
        if not limited and path != "/v1/embeddings":
            if fields is None:
                fields = {}
            fields["max_tokens"] = self.manager.output_limit(deployment)
        return (with_fields(head, fields) if fields else body), strip_usage

    def address(self, base_url: str) -> tuple[str, int]:
        """``(host, port)`` of an engine's ``base_url`` (``http://127.0.0.1:PORT``), parsed
        once per engine."""
        found = self._addresses.get(base_url)
        if found is None:
            if len(self._addresses) >= _URLS_KEPT:
                self._addresses.clear()
            url = URL(base_url)
            assert url.host is not None and url.port is not None  # noqa: S101 - ours
            found = self._addresses[base_url] = (url.host, url.port)
        return found

    def model_header(self, public_model: str) -> bytes:
        """The ``x-sbproxy-logical-model`` header value of ``public_model``."""
        value = self._model_headers.get(public_model)
        if value is None:
            if len(self._model_headers) >= _URLS_KEPT:
                self._model_headers.clear()
            value = self._model_headers[public_model] = public_model.encode("latin-1")
        return value

    async def forward(self, scope: Scope, receive: Receive, path: str) -> ASGIApp:
        """Relay one OpenAI request to its engine (see the module docstring).

        The answer is built as an ASGI app directly, not as a ``Response`` for the route to
        convert: the route layers add no headers or cookies, and the conversion was a
        measurable part of the request path (``benchmarks/proxy.py``); a whole answer is a
        :class:`_PlainAnswer`, lighter still than Litestar's ``ASGIResponse``.

        Raises:
            AdmissionRejected: any admission reason.
            UpstreamUnavailable: ``upstream_unavailable`` (502): the engine did not answer.
            EngineTimeout: ``engine_timeout`` (504): a supervision limit ran out before the
                answer's headers went out.
        """
        authorization, host, length = _request_headers(scope)
        fleet = self.fleet
        if fleet is None:
            caller, hop = self.keys.authenticate(authorization), None
        else:
            caller, hop = self.fleet_caller(fleet, scope, authorization)
        body = await read_body(receive, length)
        head = decode_head(body)
        route = self.routing.route(host, head.model)
        deployment = route.deployment
        note, span = _annotate(scope, route, caller)
        if fleet is None:
            # A single host: its own deployment, no fleet to consult (the hot path).
            self.usage.check(caller.name)
            here: Route | None = route
            prefer = None
        else:
            here, prefer = await self.place(fleet, route, caller, hop, path, head)
        if here is None:
            assert fleet is not None  # noqa: S101 - only a fleet's route goes elsewhere
            return await self.forward_to_peer(
                scope, receive, route, fleet, caller=caller, host=host, path=path,
                head=head, body=body, span=span, note=note, prefer=prefer,
            )  # fmt: skip
        deployment = here.deployment
        sent, strip_usage = self.prepare(path, head, body, here)
        # For a hop the calling host counts usage: it gets the usage event and drops it for
        # its client as needed.
        strip_usage = strip_usage and hop is None
        try:
            answer = await self.exchange(
                receive, here, caller=caller, path=path, body=sent, streamed=head.stream
            )
        except SbproxyError as exc:  # a refusal, an engine timeout, an unreachable engine
            if fleet is not None and hop is None and _spillable(exc):
                return await self.forward_to_peer(
                    scope, receive, route, fleet, caller=caller, host=host, path=path,
                    head=head, body=body, span=span, note=note, spilled=exc,
                )  # fmt: skip
            if note is not None:
                note.outcome = exc.code
            raise
        if answer is None:
            return self.client_gone(deployment, note)
        response = answer.response
        if answer.data is not None:
            data = answer.data
            content_type = response.content_type
            if content_type == "application/json":
                data, usage = rewrite_answer(data, route.public_model)
                if usage is not None and hop is None:
                    self.count(caller, usage, span, note)
            return _PlainAnswer(
                response.status, self.model_header(route.public_model), content_type, data
            )

        def ended(outcome: str | None) -> None:
            self.stream_ended(deployment, note, relay, outcome)

        relay = StreamRelay(
            response,
            answer.upstream,
            route.public_model,
            started=answer.started,
            strip_usage=strip_usage,
            on_usage=(lambda usage: self.count(caller, usage, span, note)) if hop is None else None,
            on_end=ended,
        )
        return _EventStream(response.status, self.model_header(route.public_model), relay)

    def stream_ended(
        self, deployment: str, note: AccessNote | None, relay: StreamRelay, outcome: str | None
    ) -> None:
        """Count and note how a relayed stream ended (``outcome`` as
        :class:`StreamRelay` reports it: ``None``, or why it ended early)."""
        if note is not None and note.outcome == SHUTTING_DOWN:
            # The host ended it (its drain deadline), not the client: noted already.
            note.first_token_at = relay.first_event_at
            return
        if outcome == CLIENT_DISCONNECTED:
            self.disconnects.record(deployment)
            if note is not None:
                note.status = CLIENT_CLOSED
        if note is not None:
            note.first_token_at = relay.first_event_at
            if outcome is not None:
                note.outcome = outcome

    def fleet_caller(
        self, fleet: PeerDispatch, scope: Scope, authorization: str | None
    ) -> tuple[Caller, str | None]:
        """The caller of a request to a fleet's gateway and, for a peer host's request, the
        calling node id: a peer hop presents the fleet credential instead of a key.

        Raises:
            Unauthorized: ``unauthorized`` (a client's request without a valid key).
            PeerUnauthorized: ``peer_unauthorized`` (a hop without the fleet credential).
        """
        hop, priority = peer_headers(scope)
        if hop is None:
            return self.keys.authenticate(authorization), None
        return fleet.admit_hop(authorization, priority, node=hop), hop

    async def wake_if_cold(self, fleet: PeerDispatch | None, deployment: str) -> None:
        """On a host of a fleet, for a deployment autoscaling took to zero replicas: ask the
        fleet for one and wait until one is ready (:mod:`sbproxy.api.wake`).

        Raises:
            AdmissionRejected: ``queue_timeout`` (503) -- none ready within the deployment's
                ``queue_timeout_ms``.
        """
        if fleet is not None and fleet.cold is not None and fleet.cold.wanted(deployment):
            await fleet.cold.wait(deployment)

    def serves_here(self, fleet: PeerDispatch, deployment: str) -> bool:
        """Whether this node serves ``deployment`` itself (:meth:`PeerDispatch.serves_here`):
        a client's request goes to a peer otherwise, a peer's hop is refused."""
        here = self._runtime_ids(fleet, deployment, unlisted=(deployment,))

        def running() -> bool:
            for local in here:
                status = self.local_status(local)
                if status is not None and status.routable:
                    return True
            return False

        return fleet.serves_here(deployment, known=bool(here), running=running)

    async def place(
        self,
        fleet: PeerDispatch,
        route: Route,
        caller: Caller,
        hop: str | None,
        path: str,
        head: Head,
    ) -> tuple[Route | None, PeerReplica | None]:
        """Where a request to a host of a fleet goes: ``route`` aimed at the replica of this
        host that takes it, or ``None`` and the peer replica to try first (``None``: the least
        outstanding) when a peer host serves it. A client's request is checked against its
        key's budget, then, for a deployment autoscaling took to zero replicas, waits for
        one (:meth:`wake_if_cold`); a peer's hop is served here or refused
        (:meth:`hop_here`).

        Raises:
            TokenBudgetExceeded: ``token_budget_exceeded`` (429).
            AdmissionRejected: ``queue_timeout`` -- no replica woke in time.
            NoReadyReplica: ``no_ready_replica`` for a hop this node does not serve.
        """
        if hop is not None:
            self.hop_here(fleet, route.deployment)
            # The replica of this node that takes it (one of several).
            return self.local_route(fleet, route, path=path, head=head), None
        self.usage.check(caller.name)
        await self.wake_if_cold(fleet, route.deployment)
        return self.fleet_route(fleet, route, path, head)

    def fleet_route(
        self, fleet: PeerDispatch, route: Route, path: str, head: Head
    ) -> tuple[Route | None, PeerReplica | None]:
        """Where a client's request goes on a host of a fleet: ``route`` aimed at the replica
        here that takes it, or ``None`` and the peer replica to try first (``None``: the
        least outstanding) when a peer serves it -- the replica prefix routing picks for a
        ``routing: prefix`` deployment (:func:`fleet_choice`), else this node's replicas
        when it serves the deployment (:meth:`serves_here`, :meth:`local_route`)."""
        target = fleet_choice(fleet, route.deployment, path, head.document, self._replica_load)
        if target is not None:
            if not target.local:
                return None, target.replica
            return replace(route, deployment=target.replica.runtime_id), None
        if not self.serves_here(fleet, route.deployment):
            return None, None
        return self.local_route(fleet, route), None

    def local_route(
        self, fleet: PeerDispatch, route: Route, *, path: str = "", head: Head | None = None
    ) -> Route:
        """``route`` aimed at the replica of this node that takes a request for its
        deployment: with several replicas here (``chat``, ``chat.r1``, each on its own
        devices), a routable one with the fewest requests in flight and queued, in turn
        among equals -- or, for a peer's hop (``head`` given) of a ``routing: prefix``
        deployment, the one prefix routing picks (:func:`local_choice`); with one, that one;
        with none listed, ``route`` itself (a deployment that is not the fleet's)."""
        here = self._runtime_ids(fleet, route.deployment, unlisted=())
        if not here:
            return route
        chosen = None
        if len(here) > 1 and head is not None and prefix_routed(fleet, route.deployment):
            chosen = self._hop_choice(fleet, here, path, head)
        if chosen is not None:
            target = chosen
        elif len(here) == 1:
            target = here[0]
        else:
            ranked = [(self._load_of(local), local) for local in here]
            fewest = min(rank for rank, _ in ranked)
            best = [local for rank, local in ranked if rank == fewest]
            self._turn += 1
            target = best[self._turn % len(best)]
        return route if target == route.deployment else replace(route, deployment=target)

    def _hop_choice(
        self, fleet: PeerDispatch, here: list[str], path: str, head: Head
    ) -> str | None:
        """The replica here that prefix routing picks for a peer's hop, among the routable
        ones; ``None`` when the request has no key or none is routable."""
        key = prefix_key(path, head.document)
        if key is None:
            return None
        loads = {local: load for local in here if (load := self._prefix_load(local)) is not None}
        return local_choice(key, fleet.directory.routing().local_node_id, loads)

    def _replica_load(self, local: str) -> tuple[int, bool] | None:
        """Requests in flight and queued at this host's replica ``local`` and whether it is
        routable now; ``None`` when this host does not run it."""
        status = self.local_status(local)
        if status is None:
            return None
        return status.active_requests + status.queued_requests, status.routable

    def _prefix_load(self, local: str) -> int | None:
        """Requests in flight and queued at this host's replica ``local``; ``None`` when it
        cannot take a request now (not routable, or not this host's)."""
        status = self.local_status(local)
        if status is None or not status.routable:
            return None
        return status.active_requests + status.queued_requests

    def _runtime_ids(
        self, fleet: PeerDispatch, deployment: str, *, unlisted: tuple[str, ...]
    ) -> list[str]:
        """The ids this host's runtime runs ``deployment``'s replicas under, as the fleet's
        table lists them here (``unlisted`` when it lists none here), that this host has."""
        listed = fleet.local_replicas(deployment) or unlisted
        return [local for local in listed if local in self.deployments]

    def _load_of(self, local: str) -> tuple[int, int]:
        """How a local replica ranks for the next request: routable ones first, then by
        requests in flight plus queued."""
        status = self.local_status(local)
        if status is None or not status.routable:
            return (1, 0)
        return (0, status.active_requests + status.queued_requests)

    def local_status(self, deployment: str) -> DeploymentStatus | None:
        """This host's runtime status of ``deployment``; ``None`` when it has none (on a
        host of a fleet, a deployment placed elsewhere only)."""
        if deployment not in self.deployments:
            return None
        try:
            return self.manager.snapshot(deployment)
        except SbproxyError:  # unknown_deployment: a reload is removing it
            return None

    def hop_here(self, fleet: PeerDispatch | None, deployment: str) -> None:
        """Check that a peer hop's deployment is served here (a hop is never passed on).

        Raises:
            NoReadyReplica: ``no_ready_replica`` (503, retryable: the caller tries another).
        """
        assert fleet is not None  # noqa: S101 - a hop is only read on a host of a fleet
        if not self.serves_here(fleet, deployment):
            raise NoReadyReplica(
                f"deployment {deployment!r} has no ready replica on this node (a peer hop is "
                "served here or not at all)",
                details={"deployment": deployment},
            )

    async def forward_to_peer(
        self,
        scope: Scope,
        receive: Receive,
        route: Route,
        fleet: PeerDispatch,
        *,
        caller: Caller,
        host: str | None,
        path: str,
        head: Head,
        body: bytes,
        span: trace.Span | None,
        note: AccessNote | None,
        spilled: SbproxyError | None = None,
        prefer: PeerReplica | None = None,
    ) -> ASGIApp:
        """Relay one request to a peer host's replica (:mod:`sbproxy.api.peers`): the
        client's body as it came (checked here first), with the trace context
        (:func:`~sbproxy.api.peers.trace_context`); the peer's answer back byte for byte,
        naming the node that served it (``x-sbproxy-peer-node``), its usage counted here.

        Spill-over (``spilled``: the refusal of this host's own replica, before any byte
        reached the client -- an admission refusal such as ``queue_full``,
        ``queue_timeout``, ``crash_loop``, or an engine that failed before answering): the
        answer also carries ``x-sbproxy-spilled: <its code>``, and the spill is counted in
        ``sbproxy_gateway_peer_spills_total``; with no peer replica ready, ``spilled``
        itself is the answer. Only a client's request spills (a peer's hop is served here or
        refused), and only once.

        Raises:
            InvalidRequest: ``invalid_request`` (400) -- never forwarded.
            NoReadyReplica: ``no_ready_replica`` (503) -- ``spilled`` instead, when given.
            UpstreamUnavailable: ``upstream_unavailable`` (502): no peer answered.
            EngineTimeout: ``engine_timeout`` (504).
        """
        deployment = route.deployment
        check_body(path, head)
        strip_usage = head.stream and path == "/v1/chat/completions" and ask_for_usage(head)[1]
        assert self.session is not None  # noqa: S101 - opened at app startup
        try:
            answer = await fleet.dispatch(
                self.session,
                receive,
                deployment=deployment,
                config=self.deployments.get(deployment),
                caller=caller,
                host=host,
                path=path,
                body=body,
                streamed=head.stream,
                carrier=trace_context(scope),
                prefer=prefer,
            )
        except SbproxyError as exc:
            raise _peer_failure(fleet, deployment, exc, spilled, note) from None
        if spilled is not None:
            fleet.spills[(deployment, spilled.code)] += 1
        if answer is None:
            return self.client_gone(deployment, note)
        response = answer.response
        model_header = self.model_header(route.public_model)
        extra = _peer_note(answer.replica.node_id, spilled, span, note)
        if answer.data is not None:
            if response.content_type == "application/json" and response.status < 400:
                usage = answer_usage(answer.data)
                if usage is not None:
                    self.count(caller, usage, span, note)
            plain = _PlainAnswer(response.status, model_header, response.content_type, answer.data)
            plain.headers[1] = _PEER_CLASS
            plain.headers.extend(extra)
            retry_after = response.headers.get("Retry-After")
            if retry_after is not None:
                plain.headers.append((b"retry-after", retry_after.encode("latin-1")))
            return plain

        def ended(outcome: str | None) -> None:
            fleet.record(answer.replica, _PEER_OUTCOMES.get(outcome or "", PeerOutcome.ANSWERED))
            self.stream_ended(deployment, note, relay, outcome)

        relay = StreamRelay(
            response,
            answer.ticket,
            route.public_model,
            started=answer.started,
            strip_usage=strip_usage,
            on_usage=lambda usage: self.count(caller, usage, span, note),
            on_end=ended,
        )
        return _PeerEventStream(response.status, model_header, relay, extra)

    async def exchange(
        self,
        receive: Receive,
        route: Route,
        *,
        caller: Caller,
        path: str,
        body: bytes,
        streamed: bool,
    ) -> _Answer | None:
        """Admit a request and send it to the engine, watching its client (on ``receive``)
        and its limit.

        A plain answer is read whole, and its exchange is over (reported, permit freed); a
        stream comes back with its headers read, for :class:`StreamRelay` to finish.

        Returns:
            The answer; ``None`` when the client went away first (everything is freed).

        Raises:
            AdmissionRejected: any admission reason.
            UpstreamUnavailable: ``upstream_unavailable``.
            EngineTimeout: ``engine_timeout``.
        """
        # One bound covers the wait for admission (no deadline: the gate has its own) and
        # for the engine's answer (the deadline of the first limit); it ends early when the
        # client goes away.
        bound = ExchangeBound(receive)
        upstream: Upstream | None = None
        response: EngineResponse | None = None
        limit, limit_s, started = Limit.REQUEST, 0.0, 0.0
        data: bytes | None = None
        try:
            with bound:
                upstream = await self.admit(route, caller)
                started = asyncio.get_running_loop().time()
                limit, limit_s = _first_limit(upstream, streamed=streamed)
                bound.set_deadline(started + limit_s)
                assert self.engines is not None  # noqa: S101 - opened at app startup
                host, port = self.address(upstream.base_url)
                response = await self.engines.post(host, port, path, body)
                if not (streamed and response.content_type == "text/event-stream"):
                    data = await response.read()
        except aiohttp.ClientError as exc:
            _end(upstream, response, timed_out=False)
            # Whether the request may have reached the engine: only a failure that opened
            # no connection provably did not (a peer's caller, or spill-over, may then send
            # it elsewhere without running it twice; issue 30, item 25).
            reached = not isinstance(exc, engine_client.NOT_SENT)
            raise UpstreamUnavailable(
                f"the engine of {route.deployment} did not answer: {type(exc).__name__}",
                details={"deployment": route.deployment, ENGINE_REACHED: reached},
            ) from None
        except BaseException:
            _end(upstream, response, timed_out=False)
            raise
        if bound.cancelled_caught:
            timed_out = upstream is not None and not bound.disconnected
            _end(upstream, response, timed_out=timed_out)
            if not timed_out:
                return None
            raise engine_timeout(route.deployment, limit, limit_s)
        assert upstream is not None and response is not None  # noqa: S101 - set in the scope
        if data is not None:
            response.release()
            _end(upstream, None, timed_out=False)
        return _Answer(upstream=upstream, response=response, started=started, data=data)

    def client_gone(self, deployment: str, note: AccessNote | None) -> ASGIResponse:
        """Count and note a request whose client disconnected before its answer; the
        response (status 499) goes nowhere, the server drops it."""
        self.disconnects.record(deployment)
        if note is not None:
            note.status = CLIENT_CLOSED
            note.outcome = CLIENT_DISCONNECTED
        return ASGIResponse(body=b"", status_code=CLIENT_CLOSED, media_type="application/json")

    def count(
        self,
        caller: Caller,
        usage: Usage,
        span: trace.Span | None,
        note: AccessNote | None = None,
    ) -> None:
        """Count one answer's ``usage`` for ``caller`` (and note it on the request span and
        for the activity ring)."""
        self.usage.record(caller.name, prompt_tokens=usage[0], completion_tokens=usage[1])
        if note is not None:
            note.prompt_tokens, note.completion_tokens = usage[0], usage[1]
        if span is not None:
            span.set_attribute(ATTR_INPUT_TOKENS, usage[0])
            span.set_attribute(ATTR_OUTPUT_TOKENS, usage[1])


def _annotate(
    scope: Scope, route: Route, caller: Caller
) -> tuple[AccessNote | None, trace.Span | None]:
    """The request's access-log note and span (when tracing is on), with its deployment,
    model and key name written on them."""
    note = access_note(scope)
    if note is not None:
        note.deployment = route.deployment
        note.key_name = caller.name
    span = trace.get_current_span() if enabled() else None
    if span is not None:
        span.set_attribute(ATTR_DEPLOYMENT, route.deployment)
        span.set_attribute(ATTR_MODEL, route.public_model)
        if caller.name is not None:
            span.set_attribute(ATTR_KEY_NAME, caller.name)
    return note, span


def _peer_failure(
    fleet: PeerDispatch,
    deployment: str,
    exc: SbproxyError,
    spilled: SbproxyError | None,
    note: AccessNote | None,
) -> SbproxyError:
    """The error to answer when peer dispatch raised ``exc``: ``spilled`` (this host's own
    refusal) when a spill-over found no peer replica ready, else ``exc`` (a spill-over that
    tried a peer is counted)."""
    if spilled is not None:
        if isinstance(exc, NoReadyReplica):
            exc = spilled
        else:
            fleet.spills[(deployment, spilled.code)] += 1
    if note is not None:
        note.outcome = exc.code
    return exc


def _peer_note(
    node: str, spilled: SbproxyError | None, span: trace.Span | None, note: AccessNote | None
) -> tuple[tuple[bytes, bytes], ...]:
    """Note on the request's span and access-log line that peer ``node`` answered (after this
    host refused with ``spilled``); the answer's headers saying so."""
    code = spilled.code if spilled is not None else None
    if note is not None:
        note.peer, note.spilled = node, code
    if span is not None:
        span.set_attribute(ATTR_PEER_NODE, node)
        if code is not None:
            span.set_attribute(ATTR_SPILLED, code)
    named = (_PEER_NODE, node.encode("latin-1"))
    return (named,) if code is None else (named, (_SPILLED, code.encode("latin-1")))


def _first_limit(upstream: Upstream, *, streamed: bool) -> tuple[Limit, float]:
    """The limit that bounds a request until its answer's headers (for a stream, until its
    first event: llama-server sends both together), and its value in seconds."""
    if streamed and upstream.first_token_timeout_s < upstream.request_timeout_s:
        return Limit.FIRST_TOKEN, upstream.first_token_timeout_s
    return Limit.REQUEST, upstream.request_timeout_s


def _end(upstream: Upstream | None, response: EngineResponse | None, *, timed_out: bool) -> None:
    """End an exchange that has no stream to relay: close the upstream response (the engine
    stops generating), report the outcome to the runtime, then free the permit."""
    if response is not None:
        response.close()
    if upstream is not None:
        upstream.report(timed_out=timed_out)
        upstream.release()


def ask_for_usage(head: Head) -> tuple[dict[str, Any], bool]:
    """The fields a streamed chat body needs so that the engine reports ``usage``, and
    whether the client had not asked for it itself (then the usage-only event is dropped
    from the relay)."""
    if head.stream_options is not None and head.stream_options.get("include_usage") is True:
        return {}, False
    return {"stream_options": {**(head.stream_options or {}), "include_usage": True}}, True


# The inference routes: served by GatewayApp itself, each a POST of a JSON body.
INFERENCE_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})


class GatewayApp:
    """The gateway's ASGI app: a ``POST`` to an inference route (:data:`INFERENCE_PATHS`)
    is served here directly, everything else (``/v1/models``, other methods and paths, the
    lifespan, a fleet's peer routes) by the Litestar app (``app``).

    Why: on a fast engine, Litestar's request handling -- its router, the ``Request`` and
    the handler's signature model, the response conversion, the middleware's per-request
    layers -- was the largest part of what the gateway added over a bare pass-through on the
    same server and client (``benchmarks/proxy.py``, issue 31). An inference request needs
    none of it: its headers are read from the scope, its body from ``receive``
    (:func:`read_body`, with Litestar's limits and answers) and its answer is raw ASGI
    already. What the Litestar routes do is done here the same way: the access log and the
    server span (the same middleware, :func:`~sbproxy.api.access.access_log` and
    :func:`~sbproxy.api.tracing.server_spans`, around this route only), and every error
    answered by :func:`~sbproxy.api.errors.gateway_error`, the map the Litestar app's
    exception handlers use. The Litestar app keeps its own routes for the same paths (a
    trailing slash, say), which end in :meth:`Gateway.forward` too.

    Args:
        app: The Litestar app of :func:`create_gateway_app` (with its lifespan).
        gateway: The gateway state the routes serve.
    """

    __slots__ = ("app", "gateway", "inference")

    def __init__(self, app: Litestar, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway
        self.inference: ASGIApp = access_log(gateway.activity)(server_spans("gateway")(self._serve))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == ScopeType.HTTP
            and scope["method"] == "POST"
            and scope["path"] in INFERENCE_PATHS
        ):
            await self.inference(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            answer = await self.gateway.forward(scope, receive, scope["path"])
        except Exception as exc:  # noqa: BLE001 - every error gets the gateway's answer
            # forward sends nothing itself: no byte of an answer is out yet.
            status, envelope, extra = gateway_error(exc)
            note = access_note(scope)
            if note is not None and note.outcome is None:
                # The access log names why (a bad body's code included), as for refusals.
                note.outcome = str(cast("dict[str, Any]", envelope["error"])["code"])
            body = _ERROR_ENCODER.encode(envelope)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            headers += [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()
            ]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await answer(scope, receive, send)


_ERROR_ENCODER: Final = msgspec.json.Encoder()


def create_gateway_app(
    gateway: Gateway, *, debug: bool = False, extra: Sequence[HTTPRouteHandler] = ()
) -> GatewayApp:
    """The gateway app: ``/v1/models``, chat/completions/embeddings relays (and ``extra``
    routes: the fleet's peer route on a cluster host), as a :class:`GatewayApp` over a
    Litestar app.

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
    async def chat_completions(request: Request[Any, Any, Any]) -> ASGIApp:
        return await gateway.forward(request.scope, request.receive, "/v1/chat/completions")

    @post("/v1/completions")
    async def completions(request: Request[Any, Any, Any]) -> ASGIApp:
        return await gateway.forward(request.scope, request.receive, "/v1/completions")

    @post("/v1/embeddings")
    async def embeddings(request: Request[Any, Any, Any]) -> ASGIApp:
        return await gateway.forward(request.scope, request.receive, "/v1/embeddings")

    app = Litestar(
        route_handlers=[list_models, chat_completions, completions, embeddings, *extra],
        exception_handlers=gateway_exception_handlers(),
        on_startup=[gateway.open],
        on_shutdown=[gateway.close],
        middleware=[access_log(gateway.activity), server_spans("gateway")],
        request_max_body_size=MAX_BODY_BYTES,
        openapi_config=None,
        debug=debug,
        # Logging is configured once by the process (sbproxy serve / run), not per app.
        logging_config=None,
    )
    return GatewayApp(app, gateway)
