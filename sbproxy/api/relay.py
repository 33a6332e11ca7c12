"""Relaying an engine's answer: the public model name in it, its usage, and a stream under
its limits.

Answers carry the public model name in ``model``: a plain answer's JSON body and each SSE
event's ``data:`` object are rewritten (one decode, which also reads ``usage``).

A stream (:class:`StreamRelay`) is relayed event by event as the engine writes it: bytes go
out as soon as a complete SSE event has arrived (an event split across reads waits only for
its own end). Its limits (:class:`~sbproxy.api.supervision.StreamDeadlines`) run while it
waits for the engine; when one runs out the upstream connection is closed, the permit freed
at once, and the stream ends with an ``engine_timeout`` error event. An engine that goes
away mid-stream ends it with an ``upstream_unavailable`` error event. Either way the client
gets a well-formed end of stream, without ``[DONE]``.

The end of a stream, for the client, is the ``data: [DONE]`` event (or, before it, the
event that carries ``usage``, which the engine sends last): once it went out the request is
complete, whatever the client does next. An OpenAI client stops reading at ``[DONE]`` and
closes its connection -- often before the engine's own end of the chunked body has arrived
-- and that is no disconnect: the relay stops reading at ``[DONE]``, and a client that
leaves after either event is logged with the status it got and not counted in
``sbproxy_gateway_client_disconnects_total``. One that leaves before is.

Usage: llama-server puts ``usage`` in the last event of a streamed *completion* always, but
in a streamed *chat completion* only when ``stream_options.include_usage`` is true (then as
an extra last event with ``choices: []``); the gateway asks for it on every streamed chat
request and, when the client had not, the relay drops that usage-only event. A stream that
ends without ``usage`` (the client left early, the engine died) is counted as one completion
token per relayed event and no prompt tokens -- an estimate, so that leaving before the last
event does not make tokens free.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncGenerator, Callable
from typing import Final, Protocol

import aiohttp
import msgspec

from sbproxy.api.access import CLIENT_DISCONNECTED
from sbproxy.api.engine_http import EngineResponse
from sbproxy.api.errors import ApiError, stream_error_event
from sbproxy.api.supervision import Limit, StreamDeadlines, engine_timeout

__all__ = [
    "RelayUpstream",
    "StreamRelay",
    "UpstreamUnavailable",
    "Usage",
    "answer_usage",
    "rewrite_answer",
    "rewrite_event",
    "rewrite_model",
    "split_events",
    "usage_of",
]

logger = logging.getLogger(__name__)

# (prompt tokens, completion tokens) of one answer.
Usage = tuple[int, int]

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


class UpstreamUnavailable(ApiError):
    """The engine could not be reached after admission (``upstream_unavailable``)."""

    default_code = "upstream_unavailable"
    default_retryable = True


_STREAM_CUT: Final = stream_error_event(
    UpstreamUnavailable("the engine stopped before the stream ended")
)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage_of(document: object) -> Usage | None:
    """``(prompt_tokens, completion_tokens)`` of an OpenAI ``usage`` object in ``document``.

    ``None`` when there is no ``usage`` object; a missing or malformed count reads as 0
    (embeddings report no ``completion_tokens``).
    """
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict):
        return None
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def rewrite_answer(data: bytes, public_model: str) -> tuple[bytes, Usage | None]:
    """``data`` with a top-level JSON ``model`` set to ``public_model`` (else unchanged),
    and the answer's usage if it reports one (one decode for both)."""
    try:
        document = _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return data, None
    usage = usage_of(document)
    if not isinstance(document, dict) or "model" not in document:
        return data, usage
    document["model"] = public_model
    return _ENCODER.encode(document), usage


def answer_usage(data: bytes) -> Usage | None:
    """The usage a plain JSON answer reports, if any; ``data`` itself is not changed (a peer's
    answer goes to the client byte for byte)."""
    try:
        return usage_of(_DECODER.decode(data))
    except (msgspec.DecodeError, RecursionError):
        return None


def rewrite_model(data: bytes, public_model: str) -> bytes:
    """``data`` with a top-level JSON ``model`` set to ``public_model`` (else unchanged)."""
    return rewrite_answer(data, public_model)[0]


def rewrite_event(event: bytes, public_model: str) -> bytes:
    """One SSE event with the ``model`` of its JSON ``data:`` line rewritten."""
    return _rewrite_event(event, public_model)[0]


# The top-level ``model`` member of an event's JSON: only its string value is replaced, so
# every other byte of the event (spacing, key order, line endings) reaches the client as the
# engine wrote it.
_MODEL_MEMBER = re.compile(rb'("model"\s*:\s*)"(?:[^"\\]|\\.)*"')
# An SSE event ends with a blank line; lines end with CRLF, LF or CR (the SSE spec).
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class _EventFields(msgspec.Struct):
    """The members of an event's JSON object the relay reads; the others are skipped by the
    decoder (checked as JSON, never built as Python objects)."""

    model: object = None
    usage: object = None
    choices: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b""))


_EVENT_DECODER = msgspec.json.Decoder(_EventFields)


def _rewrite_event(
    event: bytes, public_model: str, name: bytes | None = None
) -> tuple[bytes, Usage | None, bool]:
    """One SSE event (without its closing blank line) with its ``model`` renamed, its usage
    if any, and whether it is a usage-only event (``choices: []`` with ``usage``).

    ``name`` is ``public_model`` JSON-encoded, when the caller has it already."""
    if b'"model"' not in event and b'"usage"' not in event:
        return event, None, False
    if name is None:
        name = _ENCODER.encode(public_model)
    if b"\n" not in event and b"\r" not in event:  # one line, as engines write events
        if not event.startswith(b"data:"):
            return event, None, False
        return _rewrite_data(event, event[5:].strip(), name)
    usage: Usage | None = None
    usage_only = False
    out = event
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        out, found, only = _rewrite_data(out, line[5:].strip(), name)
        if found is not None:
            usage, usage_only = found, only
    return out, usage, usage_only


def _rewrite_data(event: bytes, payload: bytes, name: bytes) -> tuple[bytes, Usage | None, bool]:
    """``event`` with the ``model`` of its ``data:`` line ``payload`` renamed to ``name``,
    the usage ``payload`` reports and whether it is a usage-only event."""
    if not payload.startswith(b"{"):
        return event, None, False
    try:
        fields = _EVENT_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError):  # not an object, or not JSON
        return event, None, False
    found = fields.usage
    usage = (
        (_count(found.get("prompt_tokens")), _count(found.get("completion_tokens")))
        if isinstance(found, dict)
        else None
    )
    usage_only = usage is not None and bytes(fields.choices).replace(b" ", b"") == b"[]"
    if isinstance(fields.model, str):
        member = _MODEL_MEMBER.search(payload)
        if member is not None:
            renamed = payload[: member.end(1)] + name + payload[member.end() :]
            event = event.replace(payload, renamed, 1)
    return event, usage, usage_only


def split_events(pending: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The complete events at the start of ``pending`` as ``(event, separator)`` pairs, and
    the incomplete rest (an event still arriving)."""
    if b"\r" not in pending:  # LF line endings, as llama-server writes: a plain split
        *complete, rest = pending.split(b"\n\n")
        return [(event, b"\n\n") for event in complete], rest
    events: list[tuple[bytes, bytes]] = []
    start = 0
    for boundary in _BOUNDARY.finditer(pending):
        events.append((pending[start : boundary.start()], boundary.group()))
        start = boundary.end()
    return events, pending[start:]


class RelayUpstream(Protocol):
    """Where a relayed stream comes from, as :class:`StreamRelay` uses it: a local engine's
    :class:`~sbproxy.model_host.runtime.manager.Upstream`, or a peer host's gateway
    (:mod:`sbproxy.api.peers`)."""

    @property
    def deployment(self) -> str: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def first_token_timeout_s(self) -> float: ...
    @property
    def stall_timeout_s(self) -> float: ...

    def report(self, *, timed_out: bool) -> None:
        """Say how the exchange ended (first call wins)."""

    def release(self) -> None:
        """Free what the exchange held (idempotent)."""


class StreamRelay:
    """One streamed answer: yields complete SSE events under the stream's limits, frees
    everything exactly once, reports the stream's usage once (see the module docstring for
    the estimate) and how it ended.

    Args:
        response: The engine's streamed response (headers read): of this host's engine
            client (:mod:`sbproxy.api.engine_http`), or aiohttp's for a peer host.
        upstream: The admitted engine (or the peer serving the request); reported and
            released exactly once.
        public_model: Written into each event's ``model``.
        started: Loop time (seconds) the request was sent upstream.
        strip_usage: Drop the usage-only event (the gateway asked for it, not the client).
        on_usage: Called once with the stream's usage (or its estimate), if any.
        on_end: Called once when the relay closes, with ``None`` for a stream whose end
            went out to the client (see the module docstring), else ``engine_timeout``,
            ``upstream_unavailable`` or ``client_disconnected`` (the client went away
            first).
    """

    def __init__(
        self,
        response: aiohttp.ClientResponse | EngineResponse,
        upstream: RelayUpstream,
        public_model: str,
        *,
        started: float,
        strip_usage: bool = False,
        on_usage: Callable[[Usage], None] | None = None,
        on_end: Callable[[str | None], None] | None = None,
    ) -> None:
        self.response = response
        self.upstream = upstream
        self.public_model = public_model
        self._name = _ENCODER.encode(public_model)
        self.strip_usage = strip_usage
        self.on_usage = on_usage
        self.on_end = on_end
        self.usage: Usage | None = None
        self.relayed_events = 0
        # time.perf_counter() when the first event went to the client (time to first token).
        self.first_event_at: float | None = None
        # The engine's stream was relayed to its end (``[DONE]``, or the end of the body).
        self.finished = False
        # The client was handed the end of the stream: the usage event or ``[DONE]``.
        self.delivered = False
        # The batch being relayed holds the end of the stream / the ``[DONE]`` event.
        self._ending = False
        self._done = False
        self.closed = False
        self.cut = False
        self.expired: Limit | None = None
        self.deadlines = StreamDeadlines(
            started=started,
            request_s=upstream.request_timeout_s,
            first_token_s=upstream.first_token_timeout_s,
            stall_s=upstream.stall_timeout_s,
            on_expire=self._expire,
        )

    @property
    def at_done(self) -> bool:
        """Whether the batch :meth:`events` yielded last holds ``[DONE]`` (nothing but the
        end of the body follows it)."""
        return self._done

    def _event(self, event: bytes, separator: bytes) -> bytes:
        rewritten, usage, usage_only = _rewrite_event(event, self.public_model, self._name)
        if usage is not None:
            self.usage = usage
            if usage_only and self.strip_usage:
                return b""
            self._ending = True
        if event.rstrip().endswith(b"[DONE]"):
            self._ending = self._done = True
        else:
            self.relayed_events += 1
        return rewritten + separator

    def _expire(self, limit: Limit) -> None:
        # From the timer: close the upstream connection (the engine stops, and the pending
        # read wakes with a connection error) and give the slot back now, not when the
        # client has taken the error event.
        if self.closed or self.finished:
            return
        self.expired = limit
        self.response.close()
        self.upstream.report(timed_out=True)
        self.upstream.release()

    def _limit_s(self, limit: Limit) -> float:
        upstream = self.upstream
        if limit == Limit.FIRST_TOKEN:
            return upstream.first_token_timeout_s
        if limit == Limit.STALL:
            return upstream.stall_timeout_s
        return upstream.request_timeout_s

    async def events(self) -> AsyncGenerator[bytes, None]:
        pending = b""
        content = self.response.content
        deadlines = self.deadlines
        try:
            while True:
                if chunk := await content.readany():
                    complete, pending = split_events(pending + chunk)
                elif pending:  # the body ended inside an event: relay what there is
                    complete, pending = [(pending, b"")], b""
                else:
                    break
                if not complete:
                    continue  # no complete event yet: the event deadline stands
                out = b"".join([self._event(event, separator) for event, separator in complete])
                if out:
                    if self.first_event_at is None:
                        self.first_event_at = time.perf_counter()
                    deadlines.paused()  # a slow client is not a stalled engine
                    yield out
                    self.delivered = self._ending
                    if self._done:
                        break  # nothing follows [DONE] but the end of the body
                deadlines.waiting()
            self.finished = True
        except aiohttp.ClientError as exc:
            yield self._failed(exc)
        finally:
            await self.close()

    def _failed(self, exc: aiohttp.ClientError) -> bytes:
        """The last event of a stream whose upstream read failed: a limit ran out (the timer
        closed the connection), or the engine went away mid-stream (stopped by a drain
        deadline, crashed); either way the client gets an OpenAI-style error event and a
        well-formed end of stream."""
        if self.expired is not None:
            deployment = self.upstream.deployment
            error = engine_timeout(deployment, self.expired, self._limit_s(self.expired))
            logger.warning("gateway stream cut: %s (%s)", error.message, error.code)
            return stream_error_event(error)
        self.cut = True
        logger.warning("upstream stream ended early: %s", type(exc).__name__)
        return _STREAM_CUT

    async def close(self) -> None:
        """Release the permit; close the upstream connection unless it was read to its end
        (a closed connection is how the engine learns to stop generating; one whose last
        bytes are still on their way after ``[DONE]`` is closed by the release); count
        usage; report how the stream ended (to the runtime, then to ``on_end``)."""
        if self.closed:
            return
        self.closed = True
        self.deadlines.cancel()
        if self.finished:
            self.response.release()
        else:
            self.response.close()
        if self.expired is None:  # an expired stream was reported and released already
            self.upstream.report(timed_out=False)
            self.upstream.release()
        if self.on_usage is not None:
            usage = self.usage
            if usage is None and self.relayed_events:
                usage = (0, self.relayed_events)
            if usage is not None:
                self.on_usage(usage)
        if self.on_end is not None:
            if self.expired is not None:
                outcome: str | None = "engine_timeout"
            elif self.cut:
                outcome = "upstream_unavailable"
            elif self.finished or self.delivered:
                outcome = None  # the client had the end of the stream
            else:
                outcome = CLIENT_DISCONNECTED
            self.on_end(outcome)
