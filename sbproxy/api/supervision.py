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

Costs on the hot path (``benchmarks/proxy.py`` against the fast upstream): the wait for
admission and for an answer's headers runs inside one :class:`ExchangeBound` -- a
synchronous context manager that cancels its task the way ``asyncio.timeout`` does, cheaper
than an anyio cancel scope or ``asyncio.timeout`` itself -- and one timer. Only when the
exchange is still waiting :data:`WATCH_AFTER_S` later does that timer start the watcher task
(:class:`ClientWatch`) that waits on the ASGI ``receive`` channel for ``http.disconnect``, as
Starlette's and Litestar's streaming responses do, and re-arm itself for the limit's
deadline: most answers of a fast engine come sooner and never pay for a task, and a client
that leaves is noticed at most :data:`WATCH_AFTER_S` late. A
stream's limits are one lazily re-armed timer (:class:`StreamDeadlines`): per event the
relay stores a number, and the timer re-arms itself only when it wakes early -- no task and
no timer churn per chunk.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from enum import StrEnum
from types import TracebackType
from typing import Final

from litestar.types import Receive

from sbproxy.api.errors import ApiError

__all__ = [
    "WATCH_AFTER_S",
    "ClientWatch",
    "EngineTimeout",
    "ExchangeBound",
    "Limit",
    "StreamDeadlines",
    "engine_timeout",
]

logger = logging.getLogger(__name__)

# Seconds an exchange waits before its client is watched and its deadline armed (see the
# module docstring): well under what a person notices, well over a fast engine's answer.
WATCH_AFTER_S: Final = 0.05


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
    """Calls ``on_disconnect`` when the client of the current request disconnects.

    One task waits on ``receive`` for ``http.disconnect`` (read the body first: the watch
    consumes the channel). It is a plain asyncio task, not an anyio task group, so that
    :meth:`stop` does not wait a loop turn for the watcher to finish.

    Args:
        receive: The request's ASGI ``receive``.
        on_disconnect: Called once, from the event loop, when the client went away (never
            after :meth:`stop`).
    """

    __slots__ = ("_on_disconnect", "_task")

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]) -> None:
        self._on_disconnect = on_disconnect
        self._task = asyncio.get_running_loop().create_task(_until_disconnect(receive))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        failure = task.exception()  # retrieved, so never reported as unhandled
        if failure is not None:
            logger.debug("disconnect watch failed: %r", failure)
            return
        self._on_disconnect()

    def stop(self) -> None:
        """Stop watching (idempotent); the channel is free for the response."""
        self._task.cancel()


class ExchangeBound:
    """Bounds one exchange's wait by a deadline and by its client staying connected.

    Use as ``with ExchangeBound(receive) as bound:`` (or ``async with``) inside a task,
    around the wait for admission and for the engine's answer (its headers, for a stream),
    and call :meth:`set_deadline` once the limit is known. When the deadline passes or the
    client disconnects, the block's task is cancelled and the exit swallows that
    cancellation: ``cancelled_caught`` is then true and ``disconnected`` says which of the
    two it was. A cancellation from outside (a shutdown, the server) passes through
    unchanged: as :func:`asyncio.timeout` does, the exit swallows only when no other
    cancellation of the task is pending (:meth:`asyncio.Task.uncancel`).

    The deadline and the :class:`ClientWatch` are armed only once the block has run for
    :data:`WATCH_AFTER_S` (or at once for a deadline sooner than that), by one timer that
    later carries the deadline; an exchange that ends sooner never creates them (see the
    module docstring). A synchronous context manager, because nothing in it awaits: an
    asynchronous one cost two coroutines per request.

    Args:
        receive: The request's ASGI ``receive`` (its body read already).
        watch_after_s: When to start watching, in seconds after entering.
    """

    __slots__ = (
        "_cancelling",
        "_deadline",
        "_exited",
        "_expired",
        "_loop",
        "_receive",
        "_task",
        "_timer",
        "_watch",
        "_watch_after_s",
        "_watching",
        "cancelled_caught",
        "disconnected",
    )

    def __init__(self, receive: Receive, *, watch_after_s: float = WATCH_AFTER_S) -> None:
        self._receive = receive
        self._watch_after_s = watch_after_s
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watch: ClientWatch | None = None
        self._watching = False
        self._exited = False
        self._expired = False
        self.cancelled_caught = False
        self.disconnected = False

    def __enter__(self) -> ExchangeBound:
        loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("an ExchangeBound must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._timer = loop.call_later(self._watch_after_s, self._start_watching)
        return self

    async def __aenter__(self) -> ExchangeBound:
        return self.__enter__()

    def set_deadline(self, when: float) -> None:
        """Cancel the block at loop time ``when`` (seconds, :func:`anyio.current_time`)."""
        self._deadline = when
        if self._expired:
            return  # the client left already; the cancellation is on its way
        timer = self._timer
        if self._watching or (timer is not None and when < timer.when()):
            self._arm(when)  # the watch is running, or the deadline comes before it

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._deadline_passed)

    def _start_watching(self) -> None:
        self._timer = None
        if self._expired:
            return
        self._watching = True
        self._watch = ClientWatch(self._receive, self._client_left)
        if self._deadline is not None:
            self._arm(self._deadline)

    def _deadline_passed(self) -> None:
        self._timer = None
        self._cancel()

    def _client_left(self) -> None:
        if self._exited or self._expired:
            return  # over already, or the deadline ran out first: why the exchange ended
        self.disconnected = True
        self._cancel()

    def _cancel(self) -> None:
        if self._exited or self._expired:
            return
        self._expired = True
        self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        self._exited = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watch is not None:
            self._watch.stop()
        if self._expired and self._task.uncancel() <= self._cancelling:
            # Ours was the only cancellation: the block ends here.
            self.cancelled_caught = exc_type is asyncio.CancelledError
            return self.cancelled_caught
        return False

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        return self.__exit__(exc_type, exc, traceback)


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
