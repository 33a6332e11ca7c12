"""How long the gateway waits for an engine, and noticing a client that went away.

Three limits per deployment bound an admitted request at its engine (fields of
``proxy.model_host.deployments.<id>``, handed over on the :class:`Upstream`):

* ``request_timeout_ms`` -- the whole exchange, from sending the request upstream to the
  last byte of the answer (a stream's last event included);
* ``first_token_timeout_ms`` -- streams only: from sending to the first complete SSE event
  (llama-server sends a stream's headers with its first result, so this covers prompt
  processing);
* ``stall_timeout_ms`` -- streams only: the longest wait for the next event. Time the relay
  spends handing events to a slow client does not count: a slow reader is not a stuck engine.

When one runs out the gateway closes the upstream connection (which is how llama-server
learns to stop generating), frees the admission permit at once and answers 504
``engine_timeout`` (:class:`EngineTimeout`), or, for a stream whose headers already went
out, ends the stream with an SSE error event.

Costs on the hot path: a plain request runs inside one anyio cancel scope with a deadline,
and one watcher task (:class:`ClientWatch`) waits on the ASGI ``receive`` channel for
``http.disconnect``, as Starlette's and Litestar's streaming responses do. A stream's limits
are one lazily re-armed timer (:class:`StreamDeadlines`): per event the relay stores a
number, and the timer re-arms itself only when it wakes early -- no task and no timer
churn per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from enum import StrEnum

import anyio
from litestar.types import Receive

from sbproxy.api.errors import ApiError

__all__ = ["ClientWatch", "EngineTimeout", "Limit", "StreamDeadlines", "engine_timeout"]

logger = logging.getLogger(__name__)


class Limit(StrEnum):
    """A supervision limit, by the name of its deployment field (milliseconds)."""

    REQUEST = "request_timeout_ms"
    FIRST_TOKEN = "first_token_timeout_ms"  # noqa: S105 - a field name, not a secret
    STALL = "stall_timeout_ms"


class EngineTimeout(ApiError):
    """A supervision limit ran out at the engine (``engine_timeout``, HTTP 504).

    ``details``: ``deployment``, ``limit`` (the field name) and ``limit_ms``. A stuck first
    token or a stall is retryable (the next try may reach a healthy engine); a request that
    ran out of ``request_timeout_ms`` is not, since it would run as long again.
    """

    default_code = "engine_timeout"


_WHAT: dict[Limit, str] = {
    Limit.REQUEST: "did not finish the request within {s}",
    Limit.FIRST_TOKEN: "sent no first token within {s}",
    Limit.STALL: "sent nothing for {s} in the middle of a stream",
}


def _seconds(value_s: float) -> str:
    return f"{value_s:g} s"


def engine_timeout(deployment: str, limit: Limit, value_s: float) -> EngineTimeout:
    """The error of ``deployment``'s engine running out of ``limit`` (``value_s`` seconds).

    The message names the deployment, the limit and its value, and what to do: raise the
    field, or look at the engine.
    """
    millis = round(value_s * 1000)
    field = f"proxy.model_host.deployments.{deployment}.{limit.value}"
    what = _WHAT[limit].format(s=_seconds(value_s))
    return EngineTimeout(
        f"the engine of deployment {deployment!r} {what} ({limit.value}={millis}); the "
        f"request was cancelled at the engine. Raise {field} if such requests need longer, "
        "or check the engine (its log, GET /admin/model-host/status).",
        retryable=limit != Limit.REQUEST,
        details={"deployment": deployment, "limit": limit.value, "limit_ms": millis},
    )


async def _until_disconnect(receive: Receive) -> None:
    # The request body has been read: what is left on the channel is the disconnect (a
    # server may repeat empty body messages; those are skipped).
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    """Cancels ``scope`` when the client of the current request disconnects.

    One task waits on ``receive`` for ``http.disconnect`` (read the body first: the watch
    consumes the channel). It is a plain asyncio task, not an anyio task group, so that
    :meth:`stop` does not wait a loop turn for the watcher to finish. ``disconnected`` tells
    afterwards why ``scope`` was cancelled.

    Args:
        receive: The request's ASGI ``receive``.
        scope: The cancel scope the gateway waits in (admission, the engine's answer).
    """

    __slots__ = ("_scope", "_task", "disconnected")

    def __init__(self, receive: Receive, scope: anyio.CancelScope) -> None:
        self.disconnected = False
        self._scope = scope
        self._task = asyncio.get_running_loop().create_task(_until_disconnect(receive))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        failure = task.exception()  # retrieved, so never reported as unhandled
        if failure is not None:
            logger.debug("disconnect watch failed: %r", failure)
            return
        self.disconnected = True
        self._scope.cancel()

    def stop(self) -> None:
        """Stop watching (idempotent); the channel is free for the response."""
        self._task.cancel()


class StreamDeadlines:
    """The three limits of one stream as one timer (see the module docstring).

    The relay calls :meth:`paused` when it hands events to the client, and :meth:`waiting`
    when it goes back to reading the engine (the first-token limit becomes the stall limit
    after the first event). When a deadline passes, ``on_expire`` is called once with the
    limit that ran out; the relay then closes the upstream response, which wakes its pending
    read with a connection error.

    Args:
        started: Loop time (seconds) the request was sent upstream.
        request_s: ``request_timeout_ms`` in seconds.
        first_token_s: ``first_token_timeout_ms`` in seconds.
        stall_s: ``stall_timeout_ms`` in seconds.
        on_expire: Called at most once, from the event loop, with the limit that ran out.
    """

    __slots__ = (
        "_armed_at",
        "_event",
        "_handle",
        "_limit",
        "_loop",
        "_on_expire",
        "_stall_s",
        "_total",
    )

    def __init__(
        self,
        *,
        started: float,
        request_s: float,
        first_token_s: float,
        stall_s: float,
        on_expire: Callable[[Limit], None],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._total = started + request_s
        self._event = started + first_token_s
        self._limit = Limit.FIRST_TOKEN
        self._stall_s = stall_s
        self._on_expire = on_expire
        self._armed_at = min(self._event, self._total)
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._armed_at, self._check)

    def paused(self) -> None:
        """The relay hands events to the client: no event deadline until :meth:`waiting`."""
        self._event = math.inf

    def waiting(self) -> None:
        """The relay waits for the engine's next event: ``stall_timeout_ms`` from now."""
        self._limit = Limit.STALL
        self._event = self._loop.time() + self._stall_s
        if self._handle is not None and self._event < self._armed_at:
            # The timer woke during a pause and re-armed for the total deadline.
            self._arm()

    def cancel(self) -> None:
        """Stop the timer (the stream ended); idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = min(self._event, self._total)
        self._handle = self._loop.call_at(self._armed_at, self._check)

    def _check(self) -> None:
        self._handle = None
        now = self._loop.time()
        if now >= self._total:
            expired = Limit.REQUEST
        elif now >= self._event:
            expired = self._limit
        else:
            self._arm()  # an event moved the deadline since the timer was armed
            return
        self._on_expire(expired)
